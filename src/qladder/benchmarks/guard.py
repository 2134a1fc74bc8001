"""`qladder bench guard`: what the step guard costs on the int4 rung, and what a handoff costs.

1. Step time, guarded vs bare: the same greedy decodes through the real ladder; bare is a plain
   llama.cpp context with the guard preset "off", guarded the context with the C activation
   monitor and the "default" guard, plus bare again as an A/A control (its ratio to bare is the
   run's noise floor); the three rotate run by run (interleaved), each run 64 tokens with EOS
   ignored, until each has `steps` step samples. A step is accept-to-accept: push (decode),
   logits, guard, sample. Reported: medians, p99s and their ratios.
2. Handoff latency: a NaN fault at step K sends the request from int4 to fp32 at a total context
   of about 64, 512 and 1024 tokens (prompt = context / 2, K = context / 2 - 3, so the handoff
   falls between two shadow syncs), with and without a warm shadow; latency is hazard detected ->
   first healthy logits on fp32, also in units of fp32's own decode step at that context. The
   repetition check is off here (EOS is ignored, so a 135M model would loop before K).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from qladder.benchmarks.common import environment, percentile
from qladder.benchmarks.engines import TEXT
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.engines.base import Engine
from qladder.health.guard import GUARD_PRESETS
from qladder.ladder import Ladder, LadderConfig
from qladder.model import inspect_model, user_prompt_ids
from qladder.sampling import SamplingParams
from qladder.testing.faults import parse_fault

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with an example in Python.",
    "Describe the water cycle for a ten-year-old.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a simple vegetable soup, step by step.",
    "Compare TCP and UDP and say when to use each.",
    "Summarize the plot of a heist movie you invent.",
    "Write a polite email asking a colleague to review a document.",
]


def _step_times(bare_int4: Engine, int4: Engine, steps: int, chunk: int) -> dict[str, Any]:
    """bare: a plain llama.cpp context, guard off; guarded: the monitored context, guard on."""
    info = inspect_model()
    ladders = {"bare": Ladder([bare_int4], LadderConfig(guard=GUARD_PRESETS["off"])),
               "guarded": Ladder([int4], LadderConfig(guard=GUARD_PRESETS["default"])),
               "bare_again": Ladder([bare_int4], LadderConfig(guard=GUARD_PRESETS["off"]))}  # A/A control
    samples: dict[str, list[float]] = {name: [] for name in ladders}
    hazards = dict.fromkeys(ladders, 0)
    params = SamplingParams(max_tokens=chunk, ignore_eos=True)
    ids = [user_prompt_ids(info.chat_template, p, int4.tokenize) for p in PROMPTS]
    for ladder in ladders.values():  # warm-up
        ladder.generate(ids[0], params)
    i = 0
    while min(len(v) for v in samples.values()) < steps:
        names = list(ladders)
        order = names[i % 3:] + names[: i % 3]  # rotated every run
        for name in order:
            r = ladders[name].generate(ids[i % len(ids)], params)
            samples[name].extend(r.step_ms)
            hazards[name] += len(r.hazards)
        i += 1
    out: dict[str, Any] = {"runs_each": i, "tokens_per_run": chunk, "hazards": hazards}
    for name, xs in samples.items():
        out[name] = {"steps": len(xs), "median_ms": statistics.median(xs), "p99_ms": percentile(xs, 99),
                     "mean_ms": statistics.fmean(xs)}
    out["overhead_ratio"] = out["guarded"]["median_ms"] / out["bare"]["median_ms"]
    out["overhead_ratio_p99"] = out["guarded"]["p99_ms"] / out["bare"]["p99_ms"]
    out["overhead_us_median"] = (out["guarded"]["median_ms"] - out["bare"]["median_ms"]) * 1e3
    # The noise floor of this run: the same bare configuration measured twice.
    out["aa_ratio"] = out["bare_again"]["median_ms"] / out["bare"]["median_ms"]
    out["aa_ratio_p99"] = out["bare_again"]["p99_ms"] / out["bare"]["p99_ms"]
    return out


def _fp32_step_ms(fp32: Engine, ids: list[int]) -> float:
    s = fp32.open(ids)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        s.push(int(s.logits().argmax()))
        s.logits()
        times.append((time.perf_counter() - t) * 1e3)
    s.close()
    return statistics.median(times)


def _handoffs(int4: Engine, fp32: Engine, contexts: tuple[int, ...], repeats: int) -> dict[str, Any]:
    guard = replace(GUARD_PRESETS["default"], check_repetition=False)
    base: list[int] = []
    while len(base) < max(contexts):
        base += int4.tokenize(TEXT, False)
    out: dict[str, Any] = {}
    for ctx in contexts:
        k = ctx // 2 - 3  # the hazard strikes at ctx - 3 tokens, mid-way between shadow syncs
        prompt = base[: ctx // 2]
        params = SamplingParams(max_tokens=k + 2, ignore_eos=True)
        runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
        for rep in range(repeats):
            for mode in (("cold", "warm") if rep % 2 == 0 else ("warm", "cold")):
                cfg = LadderConfig(guard=guard, warm_shadow=mode == "warm", shadow_sync_every=8)
                r = Ladder([int4, fp32], cfg).generate(prompt, params, faults=[parse_fault(f"nan@step={k}")])
                h = r.handoffs[0]
                runs[mode].append({"latency_ms": h.latency_ms, "caught_up_tokens": h.caught_up_tokens})
        step_ms = _fp32_step_ms(fp32, base[:ctx])
        entry: dict[str, Any] = {"prompt_tokens": len(prompt), "hazard_step": k,
                                 "context_at_handoff": len(prompt) + k, "fp32_decode_step_ms": step_ms}
        for mode, rs in runs.items():
            lat = statistics.median(x["latency_ms"] for x in rs)
            entry[mode] = {"latency_ms": lat, "latency_fp32_steps": lat / step_ms,
                           "caught_up_tokens": statistics.median(x["caught_up_tokens"] for x in rs),
                           "runs_ms": [x["latency_ms"] for x in rs]}
        out[str(ctx)] = entry
    return out


def run_guard_bench(steps: int = 400, chunk: int = 64, contexts: tuple[int, ...] = (64, 512, 1024),
                    repeats: int = 2) -> dict[str, Any]:
    settings = Settings.from_env()
    bare_int4 = load_engine("int4", settings=replace(settings, int4_monitor=False))
    int4 = load_engine("int4", settings=settings)
    fp32 = load_engine("fp32", settings=settings)
    try:
        out: dict[str, Any] = {"benchmark": "guard", "rung": "int4",
                               "int4_activation_monitor": getattr(int4, "monitor", None) is not None}
        out["step"] = _step_times(bare_int4, int4, steps, chunk)
        out["overhead_ratio"] = out["step"]["overhead_ratio"]
        out["overhead_ratio_p99"] = out["step"]["overhead_ratio_p99"]
        out["aa_ratio"], out["aa_ratio_p99"] = out["step"]["aa_ratio"], out["step"]["aa_ratio_p99"]
        out["handoff"] = _handoffs(int4, fp32, contexts, repeats)
        out["env"] = environment(settings.n_threads)
        out["method"] = {"steps_per_side_min": steps, "interleaved": "three configurations, order rotated each run",
                         "warmup": "one bare run", "handoff_repeats": repeats, "shadow_sync_every": 8,
                         "guard_presets": {"bare": "off", "guarded": "default"}}
        return out
    finally:
        for e in (bare_int4, int4, fp32):
            e.close()
