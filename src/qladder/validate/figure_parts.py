"""The pieces every figure module of a run shares (validate/recompute.py, fleet_figures.py,
verified_figures.py): outcomes grouped by a key, a request's effective latency (a request without
an answer counts as the run's slowest), a verdict's record and the overall one, and the load
benchmarks' window rates and throughput verdict. Pure functions of outcomes; no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from qladder.percentiles import percentile
from qladder.validate import intervals
from qladder.validate.outcome import Outcome


def group_by(outs: Iterable[Outcome], key: Callable[[Outcome], str]) -> dict[str, list[Outcome]]:
    groups: dict[str, list[Outcome]] = {}
    for o in outs:
        groups.setdefault(key(o), []).append(o)
    return dict(sorted(groups.items()))


def effective_latencies(outs: Sequence[Outcome], slowest: float) -> list[float]:
    return [o.latency_ms if o.ok else slowest for o in outs]


def verdict_of(name: str, value: float | None, limit: float, ok: Callable[[float], bool], note: str = "",
             status: str | None = None) -> dict[str, Any]:
    if status is None:
        status = "no data" if value is None else ("pass" if ok(value) else "fail")
    return {"name": name, "value": value, "limit": limit, "status": status, "note": note}


def overall(vs: Sequence[dict[str, Any]]) -> str:
    """fail if any verdict fails; pass only if every one passes; inconclusive otherwise."""
    statuses = {v["status"] for v in vs}
    return "fail" if "fail" in statuses else "pass" if statuses <= {"pass"} else "inconclusive"


def window_rate(outs: Sequence[Outcome]) -> dict[str, Any]:
    """One closed-loop window: its tokens over its span (first request sent -> last answer done)."""
    spans = [(o.start_s, o.end_s) for o in outs if o.start_s is not None and o.end_s is not None]
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    tokens = sum(o.tokens for o in outs if o.ok)
    unfaulted = sum(o.tokens for o in outs if o.ok and o.fault is None)
    return {"requests": len(outs), "tokens": tokens, "span_s": span, "tok_s": tokens / span if span > 0 else None,
            "unfaulted_tok_s": unfaulted / span if span > 0 else None}


def windows(outs: Sequence[Outcome]) -> list[intervals.Window]:
    """Each closed-loop window of these requests as (round, tokens, span s): what the interval of a
    throughput ratio resamples."""
    out = []
    for _, v in group_by(outs, lambda o: str(o.window)).items():
        w = window_rate(v)
        out.append((str(v[0].round), float(w["tokens"]), float(w["span_s"])))
    return out


def load_cell(outs: Sequence[Outcome], slowest: float) -> dict[str, Any]:
    """One configuration at one level over its rounds: tok/s pooled over its windows (their tokens
    over their spans), each window's beside."""
    wins = [window_rate(v) for v in group_by(outs, lambda o: str(o.window)).values()]
    steps = [x for o in outs if o.ok for x in o.step_ms]
    ttft = [o.ttft_ms for o in outs if o.ok and o.ttft_ms is not None]
    faulted = [o for o in outs if o.fault is not None]
    via = [o for o in faulted if o.ok and not o.fallback and o.handed_off and o.rungs and o.rungs[-1] != "int4"
           and o.finish_reason in ("stop", "length", "repetition")]
    span = sum(w["span_s"] for w in wins)
    return {"requests": len(outs), "tokens": sum(w["tokens"] for w in wins), "rounds": len(wins),
            "tok_s_rounds": [w["tok_s"] for w in wins],
            "tok_s": sum(w["tokens"] for w in wins) / span if span > 0 else None,
            "unfaulted_tok_s": sum(sum(o.tokens for o in v if o.ok and o.fault is None)
                                   for v in group_by(outs, lambda o: str(o.window)).values()) / span
            if span > 0 else None,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "token_p50_ms": percentile(steps, 50), "token_p99_ms": percentile(steps, 99),
            "latency_p50_ms": percentile(effective_latencies(outs, slowest), 50),
            "latency_p99_ms": percentile(effective_latencies(outs, slowest), 99),
            "five_xx": sum(o.five_xx for o in outs), "fallback": sum(o.ok and o.fallback for o in outs),
            "judged_garbage": sum(o.garbage for o in outs), "stopped": sum(o.stopped for o in outs),
            "faulted": len(faulted), "faulted_answered_via_standby": len(via)}


def throughput_verdict(name: str, a: Sequence[Outcome], b: Sequence[Outcome], limit: float,
                       note: str = "") -> tuple[dict[str, Any], intervals.Interval]:
    """a's pooled tok/s over b's, with its interval (>= MIN_WINDOWS windows a side to decide)."""
    iv = intervals.window_rate_ratio(windows(a), windows(b))
    return intervals.verdict(name, iv, limit, higher_is_better=True, note=note,
                             min_units=intervals.MIN_WINDOWS), iv
