"""`qladder bench serving`: many requests at once on the INT4 pool, guarded vs bare vs a raw loop.

The same prompts (EOS ignored, so every answer is `max_tokens` long) run at each concurrency
through the configurations below. Prompts are screened first (`_loop_free`): forced past its end
a 135M model often loops, and the guard would end those answers early, which is its policy, not
its cost; the prompts kept are those whose raw greedy answer never loops by the guard's rules, so
every configuration does the same work (the JSON records how many were screened and which kept).
    guarded          the serving engine with the default guard, standby fp32
    bare             the serving engine with the guard off and no standby (scheduler cost only)
    raw              a batched llama.cpp loop over the same engine API with no scheduler: decode
                     every active row, prefill one waiting prompt alone (after the same cached
                     system-turn prefix), argmax (the ceiling)
    guarded_faulted  guarded, with `fault_share` of the requests given `nan@step=K` (K seeded,
                     uniform in [1, max_tokens / 2]): they must end clean through the standby
Clients are closed-loop: `concurrency` threads each take the next prompt when their last answer
is done. Configurations rotate inside each concurrency level (interleaved), so slow drift of the
machine hits them alike. Per request: TTFT (submit -> first accepted token) and the intervals
between accepted tokens; aggregate tok/s = tokens / wall time of the level (median of the
rounds); in the faulted run `unfaulted_tok_s` counts the tokens of the unfaulted requests only.
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from qladder.benchmarks.common import environment, percentile
from qladder.config import Settings
from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry
from qladder.faults import parse_fault
from qladder.health.guard import GUARD_PRESETS, GuardConfig
from qladder.health.repetition import find_repetition
from qladder.machine import LadderConfig
from qladder.model import inspect_model, user_prompt_ids
from qladder.sampling import SamplingParams
from qladder.serving import SchedulerConfig, ServingConfig, ServingEngine
from qladder.serving.engine import template_prefix
from qladder.validate.corpora import load_corpora, subset

Sample = tuple[float, list[float], int, bool, bool]  # ttft_s, token intervals (s), tokens, clean, faulted


def _closed_loop(n_clients: int, jobs: list[Any], run: Callable[[Any], Sample]) -> tuple[float, list[Sample]]:
    lock = threading.Lock()
    todo = list(jobs)
    out: list[Sample] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop(0)
            s = run(job)
            with lock:
                out.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def _serve(se: ServingEngine, params: SamplingParams) -> Callable[[Any], Sample]:
    def run(job: Any) -> Sample:
        ids, fault = job
        r = se.generate_sync(se.request(ids, params, faults=[fault] if fault is not None else []))
        intervals = [ms / 1e3 for ms in r.step_ms]
        clean = r.finish_reason.value in ("stop", "length", "repetition") and not r.fallback
        if fault is not None:  # a faulted request is clean only when the standby finished it
            clean = clean and bool(r.handoffs) and r.token_rungs[-1] != "int4"
        return r.timings.get("ttft_ms", float("nan")) / 1e3, intervals, len(r.token_ids), clean, fault is not None

    return run


def _raw(engine: BatchedLlamaCpp, prompts: list[list[int]], concurrency: int, max_tokens: int
         ) -> tuple[float, list[Sample]]:
    """A batched greedy loop with no scheduler, no guard, no events: the ceiling."""
    waiting = list(range(len(prompts)))
    free = list(range(engine.n_slots))[:concurrency]
    active: dict[int, dict[str, Any]] = {}
    out: list[Sample] = []
    t0 = time.perf_counter()
    asked = [t0] * concurrency  # when each client's next request was sent (closed loop)
    while waiting or active:
        rows = [(slot, a) for slot, a in sorted(active.items()) if a["n"] > 0]
        if rows:
            engine.decode([Entry(slot, [a["last"]], a["pos"]) for slot, a in rows])
        now = time.perf_counter()
        for slot, a in rows:
            a["pos"] += 1
            a["last"] = int(np.argmax(engine.row(slot).numpy()))
            a["n"] += 1
            a["times"].append(now)
        for slot, a in list(active.items()):
            if a["n"] >= max_tokens:
                ts = a["times"]
                out.append((ts[0] - a["t"], [b - x for x, b in itertools.pairwise(ts)], a["n"], True, False))
                engine.truncate(slot, 0)
                free.append(slot)
                del active[slot]
                asked.append(now)  # that client sends its next request now
        if waiting and free:
            k, slot, t = waiting.pop(0), free.pop(0), asked.pop(0)
            p = prompts[k]
            held = engine.copy_prefix(slot) if tuple(p[:len(engine.prefix)]) == engine.prefix else 0
            engine.decode([Entry(slot, p[held:], held)])  # a prompt alone, as the scheduler does
            first = int(np.argmax(engine.row(slot).numpy()))
            active[slot] = {"pos": len(prompts[k]), "last": first, "n": 1, "t": t, "times": [time.perf_counter()]}
    return time.perf_counter() - t0, out


def _loop_free(engine: BatchedLlamaCpp, candidates: list[list[int]], max_tokens: int, n: int,
               guard: GuardConfig) -> tuple[list[list[int]], dict[str, Any]]:
    """The first n candidates whose `max_tokens`-token greedy answer (EOS ignored) never repeats
    itself by the guard's loop rules. Forced past its end, a 135M model often loops; the guard
    then stops that answer early, which is its policy, not its cost: every configuration here
    must do the same work. Greedy answers are bit-identical on every configuration (one KV
    stream per slot), so the raw loop's tokens tell what the guard would see."""
    kept: list[int] = []
    start = 0
    rules = ((guard.repetition_short_max_period, guard.repetition_short_min_repeats, guard.repetition_short_min_span),
             (guard.repetition_max_period, guard.repetition_min_repeats, guard.repetition_min_span))
    slots = engine.n_slots
    for start in range(0, len(candidates), slots):
        group = candidates[start:start + slots]
        answers = _raw_answers(engine, group, max_tokens)
        for k, toks in enumerate(answers):
            loops = any(find_repetition(toks[:i], guard.repetition_min_period, mp, rep, span) is not None
                        for mp, rep, span in rules for i in range(span, len(toks) + 1))
            if not loops:
                kept.append(start + k)
        if len(kept) >= n:
            break
    kept = kept[:n]
    return [candidates[k] for k in kept], {"candidates_screened": min(len(candidates), start + slots),
                                           "kept": kept, "rule": "no loop by the default guard's repetition "
                                           "rules within the answer (raw greedy, EOS ignored)"}


def _raw_answers(engine: BatchedLlamaCpp, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out: list[list[int]] = []
    for slot, p in enumerate(prompts):
        engine.decode([Entry(slot, p, 0)])
        out.append([int(np.argmax(engine.row(slot).numpy()))])
    for _ in range(max_tokens - 1):
        engine.decode([Entry(slot, [toks[-1]], len(prompts[slot]) + len(toks) - 1)
                       for slot, toks in enumerate(out)])
        for slot, toks in enumerate(out):
            toks.append(int(np.argmax(engine.row(slot).numpy())))
    for slot in range(len(prompts)):
        engine.truncate(slot, 0)
    return out


def _summary(runs: list[tuple[float, list[Sample]]]) -> dict[str, Any]:
    """tok_s: the median over rounds of tokens / wall; latencies pooled over the rounds."""
    samples = [s for _, ss in runs for s in ss]
    rates = [sum(s[2] for s in ss) / wall for wall, ss in runs if wall]
    others = [sum(s[2] for s in ss if not s[4]) / wall for wall, ss in runs if wall]
    tokens = sum(s[2] for s in samples)
    ttft = [s[0] * 1e3 for s in samples]
    per_tok = [x * 1e3 for s in samples for x in s[1]]
    return {"requests": len(samples), "tokens": tokens, "rounds": len(runs), "tok_s_rounds": rates,
            "tok_s": statistics.median(rates) if rates else None,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "token_p50_ms": percentile(per_tok, 50), "token_p99_ms": percentile(per_tok, 99),
            "unfaulted_tok_s": statistics.median(others) if others else None,
            "clean_answers": sum(s[3] for s in samples), "faulted": sum(s[4] for s in samples),
            "faulted_clean_via_standby": sum(s[3] and s[4] for s in samples)}


def run_serving_bench(n_prompts: int = 32, max_tokens: int = 128, concurrency: tuple[int, ...] = (1, 4, 8, 16),
                      fault_share: float = 0.1, int4_threads: int = 1, standby_threads: int = 1,
                      seed: int = 0, rounds: int = 2) -> dict[str, Any]:
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    slots = max(concurrency)
    n_ctx = 1024
    sched = SchedulerConfig(max_queue=4 * slots)
    common = {"slots": slots, "n_ctx": n_ctx, "int4_threads": int4_threads, "standby_threads": standby_threads,
              "scheduler": sched}
    guarded = ServingEngine(ServingConfig(**common, allow_faults=True), info, settings)  # type: ignore[arg-type]
    bare = ServingEngine(ServingConfig(**common, standby_rungs=(),  # type: ignore[arg-type]
                                       ladder=LadderConfig(guard=GUARD_PRESETS["off"])), info, settings)
    raw = BatchedLlamaCpp(info, n_slots=slots, n_ctx=n_ctx, n_threads=int4_threads, native_dir=None)
    raw.cache_prefix(template_prefix(info, raw.tokenize))  # the same prefill work as the engine's
    try:
        normal, _ = load_corpora()
        corpus = [p for p in subset(normal, max(1, -(-3 * n_prompts // 8))) if isinstance(p.prompt, str)]
        candidates = [user_prompt_ids(info.chat_template, p.prompt, raw.tokenize) for p in corpus]
        prompts, screened = _loop_free(raw, candidates, max_tokens, n_prompts, GUARD_PRESETS["default"])
        screened["ids"] = [corpus[k].id for k in screened.pop("kept")]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        rng = random.Random(seed)  # exactly round(share x prompts) faulted requests, seeded
        hit = set(rng.sample(range(len(prompts)), max(1, round(fault_share * len(prompts))) if fault_share else 0))
        faulted = [parse_fault(f"nan@step={rng.randint(1, max_tokens // 2)}") if k in hit else None
                   for k in range(len(prompts))]
        n_faulted = len(hit)
        # Warm-up: one short pass of each configuration (page faults, caches, first-call costs).
        warm = prompts[:2]
        short = SamplingParams(max_tokens=8, ignore_eos=True)
        for se in (guarded, bare):
            _closed_loop(2, [(p, None) for p in warm], _serve(se, short))
        _raw(raw, warm, 2, 8)
        configs: dict[str, Callable[[int], tuple[float, list[Sample]]]] = {
            "guarded": lambda c: _closed_loop(c, [(p, None) for p in prompts], _serve(guarded, params)),
            "bare": lambda c: _closed_loop(c, [(p, None) for p in prompts], _serve(bare, params)),
            "raw": lambda c: _raw(raw, prompts, c, max_tokens),
            "guarded_faulted": lambda c: _closed_loop(c, list(zip(prompts, faulted, strict=True)),
                                                       _serve(guarded, params)),
        }
        results: dict[str, dict[str, Any]] = {k: {} for k in configs}
        order = list(configs)
        k = 0
        for c in concurrency:
            runs: dict[str, list[tuple[float, list[Sample]]]] = {name: [] for name in order}
            for _ in range(rounds):
                for name in order[k % len(order):] + order[: k % len(order)]:  # rotated: interleaved
                    runs[name].append(configs[name](c))
                k += 1
            for name, rs in runs.items():
                results[name][str(c)] = _summary(rs)
        g = results["guarded"]

        def ratio(a: Any, b: Any) -> float | None:
            return a / b if a and b else None

        ratios = {"guarded_c8_over_c1": ratio(g.get("8", {}).get("tok_s"), g.get("1", {}).get("tok_s")),
                  "guarded_over_raw_c8": ratio(g.get("8", {}).get("tok_s"), results["raw"].get("8", {}).get("tok_s")),
                  "guarded_over_bare_c8": ratio(g.get("8", {}).get("tok_s"), results["bare"].get("8", {}).get("tok_s")),
                  "faulted_over_guarded_c8": ratio(results["guarded_faulted"].get("8", {}).get("tok_s"),
                                                   g.get("8", {}).get("tok_s"))}
        return {"benchmark": "serving", "environment": environment(int4_threads),
                "setup": {"prompts": len(prompts), "prompt_screen": screened, "max_tokens": max_tokens,
                          "ignore_eos": True, "greedy": True,
                          "concurrency": list(concurrency), "slots": slots, "n_ctx_per_slot": n_ctx,
                          "int4_threads": int4_threads, "standby_threads": standby_threads,
                          "standby": "fp32, 4 sessions round-robin", "faulted_requests": n_faulted,
                          "fault": "nan@step=K, K uniform in [1, max_tokens/2], seeded", "seed": seed,
                          "warm_up": "2 prompts x 8 tokens per configuration",
                          "order": "configurations rotate within each concurrency level", "rounds": rounds,
                          "clients": "closed loop, one thread per client"},
                "results": results, "ratios": ratios}
    finally:
        guarded.close()
        bare.close()
        raw.close()
