"""Two of the three boundaries: precision (fault magnitude x rung) and latency (cost per check level).

Precision boundary. For each gain x (the massive-activation fault, layer 11 channel 507) and each
rung, decode greedily on short prompts and record:
    first_nonfinite   the first step whose logits row holds NaN/Inf
    first_div_fault   the first token that differs from fp32 under the *same* fault: the rung's
                      precision, not the fault, broke the answer (fp32: never, by definition)
    first_div_clean   the first token that differs from fp32 without any fault
    detected          the first step the default step guard flags on this rung's own rows, with
                      the rung's activation peaks (torch hooks; on int4 the C cb_eval monitor,
                      when it could be built), and with which check
    peak              the largest per-layer |hidden| seen (inf once it overflowed)
Every rung's activation limit is its engine's `activation_limit`: fp16's 65,504 for w4a16 and for
int4 (the dtype of the GPU W4A16 kernels it stands for), fp32's maximum for fp32.
On int4 the gain goes through a llama.cpp control vector, which adds (x - 1) x 24,900 at every
position instead of multiplying the first-token outlier, so its column is a harsher fault than the
torch rungs' (see fault_models.py).

Latency boundary. The same prompts through the naive greedy loop (bare) and through the ladder at
each check level, interleaved round by round with a rotating order so drift and the neighbours'
load hit every level alike. Ratios are against bare; a second bare level (the A/A control) shows
how far two identical configurations drift apart in the same run: the noise floor of every ratio.
The per-token figures are decode-step intervals (prefill excluded: the ladder's `step_ms`), the
per-request ones wall times. Ladders set their engines' monitors per request, so "default" over
"logits+repetition" is the int4 activation monitor's cost; the fp32 rung's torch hooks are
measured on their own (`monitor_cost`). Every request decodes exactly `max_tokens` (ignore_eos).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qladder.engines import instrument
from qladder.engines.base import Engine
from qladder.health.guard import GUARD_PRESETS, GuardConfig, StepGuard
from qladder.ladder import Ladder, LadderConfig
from qladder.percentiles import mean, percentile, ratio
from qladder.sampling import SamplingParams
from qladder.testing.faults import Fault, engine_faults

Tick = Callable[[], None]


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    first_nonfinite: int | None = None
    detected: int | None = None
    detected_check: str | None = None
    peak: float | None = None


def trace(engine: Engine, ids: Sequence[int], n_tokens: int, faults: Sequence[Fault],
          guard: StepGuard) -> Trace:
    """Greedy decoding that keeps going through bad rows, watching them with the guard."""
    out = Trace()
    with engine_faults(engine, faults):
        peaks = getattr(engine, "activation_peaks", None)  # None while the engine's monitor is off
        limit = getattr(engine, "activation_limit", None) if peaks is not None else None
        s = engine.open(list(ids))
        try:
            for step in range(n_tokens):
                row = s.logits()
                if out.first_nonfinite is None and not bool(torch.isfinite(row).all()):
                    out.first_nonfinite = step
                if peaks is not None:
                    p = float(peaks.max())
                    p = p if p == p else float("inf")  # NaN peak: the stream overflowed
                    out.peak = p if out.peak is None else max(out.peak, p)
                if out.detected is None:
                    h = guard.check(row, out.tokens, engine.name, peaks, limit)
                    if h is not None:
                        out.detected, out.detected_check = step, h.check
                tok = int(row.argmax())
                out.tokens.append(tok)
                s.push(tok)
        finally:
            s.close()
    return out


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def precision_sweep(engines: dict[str, Engine], prompts: Sequence[tuple[str, list[int]]], xs: Sequence[float],
                    n_tokens: int, tick: Tick = lambda: None) -> dict[str, Any]:
    """Points for every (prompt, rung, x) and a per-(rung, x) summary. `engines` must hold fp32."""
    info = getattr(engines["fp32"], "info", None)
    guard = StepGuard(GUARD_PRESETS["default"], info.identity if info is not None else None)
    for e in engines.values():
        e.instrument(True, False)
    points = []
    for pid, ids in prompts:
        clean = trace(engines["fp32"], ids, n_tokens, [], guard).tokens
        for x in xs:
            faults = [Fault("gain", x=x)] if x != 1.0 else []
            ref = trace(engines["fp32"], ids, n_tokens, faults, guard)
            for rung, engine in engines.items():
                t = ref if rung == "fp32" else trace(engine, ids, n_tokens, faults, guard)
                broke = [v for v in (t.first_nonfinite, _first_diff(t.tokens, ref.tokens)) if v is not None]
                points.append({"prompt": pid, "rung": rung, "x": x, "first_nonfinite": t.first_nonfinite,
                               "first_div_fault": _first_diff(t.tokens, ref.tokens),
                               "first_div_clean": _first_diff(t.tokens, clean),
                               "detected": t.detected, "detected_check": t.detected_check, "peak": t.peak,
                               "broken": bool(broke),
                               "caught_in_time": t.detected is not None and (not broke or t.detected <= min(broke))})
                tick()
    return {"points": points, "summary": _sweep_summary(points, list(engines), xs),
            "boundary": _first_break(points, list(engines), xs)}


def _sweep_summary(points: list[dict[str, Any]], rungs: list[str], xs: Sequence[float]) -> list[dict[str, Any]]:
    rows = []
    for rung in rungs:
        for x in xs:
            ps = [p for p in points if p["rung"] == rung and p["x"] == x]
            n = len(ps) or 1
            broken = [p for p in ps if p["broken"]]
            rows.append({"rung": rung, "x": x, "prompts": len(ps),
                         "nonfinite_rate": sum(p["first_nonfinite"] is not None for p in ps) / n,
                         "diverged_fault_rate": sum(p["first_div_fault"] is not None for p in ps) / n,
                         "diverged_clean_rate": sum(p["first_div_clean"] is not None for p in ps) / n,
                         "detection_rate": sum(p["detected"] is not None for p in ps) / n,
                         "broken_caught_rate": (sum(p["caught_in_time"] for p in broken) / len(broken))
                         if broken else None,
                         "peak_max": max((p["peak"] for p in ps if p["peak"] is not None), default=None)})
    return rows


def _first_break(points: list[dict[str, Any]], rungs: list[str], xs: Sequence[float]) -> dict[str, Any]:
    """Per rung: the smallest x with a non-finite row, and with a divergence from fp32 (same fault)."""
    out = {}
    for rung in rungs:
        def first(key: str, rung: str = rung) -> float | None:
            return next((x for x in xs if any(p["rung"] == rung and p["x"] == x and p[key] is not None
                                                for p in points)), None)

        out[rung] = {"first_nonfinite_x": first("first_nonfinite"), "first_divergence_x": first("first_div_fault"),
                     "first_detection_x": first("detected")}
    return out


BARE = "bare (naive loop)"
LEVELS: dict[str, LadderConfig | None] = {  # None: the naive greedy loop, no ladder, no monitor
    BARE: None,
    "bare (A/A control)": None,  # the same again: the noise floor of every ratio
    "ladder, guard off": LadderConfig(guard=GUARD_PRESETS["off"]),
    "logits": LadderConfig(guard=GUARD_PRESETS["logits"]),
    "logits+repetition": LadderConfig(guard=GuardConfig(check_activations=False)),
    "default (+activations)": LadderConfig(guard=GUARD_PRESETS["default"]),
    "default+warm_shadow": LadderConfig(guard=GUARD_PRESETS["default"], warm_shadow=True),
}


def naive_steps(engine: Engine, ids: Sequence[int], n: int) -> list[float]:
    """Greedy decoding of exactly n tokens with no guard instruments; the ms between accepted tokens.
    The last token is not pushed: the same forward passes as the ladder's (prefill + n - 1)."""
    instrument(engine, activations=False, row_stats=False)
    s = engine.open(list(ids))
    steps: list[float] = []
    try:
        last = None
        tok = None
        for _ in range(n):
            if tok is not None:
                s.push(tok)
            tok = int(s.logits().argmax())
            now = time.perf_counter()
            if last is not None:
                steps.append((now - last) * 1e3)
            last = now
    finally:
        s.close()
    return steps


def latency_levels(int4: Engine, fp32: Engine, prompts: Sequence[list[int]], rounds: int, max_tokens: int,
                   tick: Tick = lambda: None) -> dict[str, Any]:
    """Per level: request wall time and the decode-step intervals (prefill excluded), interleaved."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ladders = {name: Ladder([int4, fp32], cfg) for name, cfg in LEVELS.items() if cfg is not None}
    names = list(LEVELS)
    walls: dict[str, list[float]] = {n: [] for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    paired: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            k = (r + i) % len(names)
            seen: dict[str, float] = {}
            for name in names[k:] + names[:k]:
                t = time.perf_counter()
                if name in ladders:
                    steps[name] += ladders[name].generate(ids, params).step_ms
                else:
                    steps[name] += naive_steps(int4, ids, max_tokens)
                seen[name] = (time.perf_counter() - t) * 1e3
                walls[name].append(seen[name])
                tick()
            for name in names:
                paired[name].append(seen[name] / seen[BARE])
    return {"levels": _level_stats(names, walls, steps, paired), "baseline": BARE, "rounds": rounds,
            "prompts": len(prompts), "max_tokens": max_tokens,
            "configs": {n: (asdict(c.guard) | {"warm_shadow": c.warm_shadow}) if c else "naive greedy loop"
                        for n, c in LEVELS.items()}}


def _level_stats(names: list[str], walls: dict[str, list[float]], steps: dict[str, list[float]],
                 paired: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    levels: dict[str, dict[str, Any]] = {}
    for name in names:
        levels[name] = {"p50_ms": percentile(walls[name], 50), "p99_ms": percentile(walls[name], 99),
                        "step_p50_ms": percentile(steps[name], 50), "step_p99_ms": percentile(steps[name], 99),
                        "samples": len(walls[name]), "steps": len(steps[name]),
                        "paired_median_ratio": percentile(paired[name], 50)}
    base = levels[BARE]
    for v in levels.values():
        v["p99_ratio"] = ratio(v["p99_ms"], base["p99_ms"])
        v["step_p50_ratio"] = ratio(v["step_p50_ms"], base["step_p50_ms"])
        v["step_p99_ratio"] = ratio(v["step_p99_ms"], base["step_p99_ms"])
    return levels


def monitor_cost(fp32: Engine, prompts: Sequence[list[int]], rounds: int, n_tokens: int,
                 tick: Tick = lambda: None) -> dict[str, Any]:
    """Per-token cost of the fp32 rung's per-layer activation hooks, interleaved on/off."""
    monitor = getattr(fp32, "monitor_activations", None)
    if monitor is None:
        return {}
    guard = StepGuard(GUARD_PRESETS["off"])
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            for on in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                monitor(on)
                t = time.perf_counter()
                trace(fp32, ids, n_tokens, [], guard)
                times[on].append((time.perf_counter() - t) * 1e3 / n_tokens)
                tick()
    monitor(True)
    p_on, p_off = percentile(times[True], 50), percentile(times[False], 50)
    return {"per_token_ms_on": p_on, "per_token_ms_off": p_off, "ratio": ratio(p_on, p_off),
            "mean_on": mean(times[True]), "mean_off": mean(times[False]), "samples": len(times[True])}
