"""Statistics over replay outcomes: percentiles and the `bare` / `guarded` sections of results.json.

Populations:
    normal_clean   normal prompts, no fault (latency, false handoffs, agreement with fp32)
    abnormal_clean abnormal prompts, no fault
    faulted        abnormal prompts with a fault model attached
    crafted        abnormal_clean + faulted: the set the top-level garbage and error rates cover,
                   as the original write-up reported them "on the crafted prompts"
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from qladder.percentiles import percentile
from qladder.validate.replay import Outcome


def mean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def population(outcomes: Iterable[Outcome], name: str) -> list[Outcome]:
    if name == "crafted":
        return [o for o in outcomes if o.population == "abnormal"]
    if name == "faulted":
        return [o for o in outcomes if o.fault != "none"]
    pop, _, _ = name.partition("_")
    return [o for o in outcomes if o.population == pop and o.fault == "none"]


def rates(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    garbage = sum(o.is_garbage for o in outcomes)
    errors = sum(o.status == "error" for o in outcomes)
    rejected = sum(o.status == "rejected" for o in outcomes)
    return {
        "requests": n,
        "garbage": garbage,
        "errors": errors,
        "rejected": rejected,
        "fallback": sum(o.fallback for o in outcomes),
        "garbage_rate": garbage / n if n else None,
        # garbage the fp32 rung alone gives too (the model's own; judged for the guarded ladder)
        "garbage_model_own": sum(o.is_garbage and o.model_own for o in outcomes),
        "garbage_beyond_fp32_rate": (garbage - sum(o.is_garbage and o.model_own for o in outcomes)) / n
        if n else None,
        "error_rate": errors / n if n else None,  # 5xx
        "reject_rate": rejected / n if n else None,  # 4xx
        "failure_rate": (garbage + errors + rejected) / n if n else None,
        "garbage_reasons": dict(Counter(r for o in outcomes if o.is_garbage for r in o.garbage)),
        "error_kinds": dict(Counter((o.error_kind or "").split(":")[0] for o in outcomes
                                    if o.status != "ok")),
        "max_wall_ms": max((o.wall_ms for o in outcomes), default=None),  # a stall shows here
    }


def latency(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "ok"]
    walls = [o.wall_ms for o in ok]
    per_tok = [o.per_token_ms for o in ok if o.per_token_ms is not None]
    return {"samples": len(walls), "p50_ms": percentile(walls, 50), "p99_ms": percentile(walls, 99),
            "mean_ms": mean(walls), "per_token_p50_ms": percentile(per_tok, 50),
            "per_token_p99_ms": percentile(per_tok, 99)}


def rung_share(outcomes: Sequence[Outcome]) -> dict[str, float]:
    c = Counter(r for o in outcomes for r in o.token_rungs)
    total = sum(c.values())
    return {k: v / total for k, v in sorted(c.items())} if total else {}


def handoffs(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    lat = [x for o in outcomes for x in o.handoff_ms]
    return {"count": len(lat), "mean_ms": mean(lat), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat) if lat else None}


def section(outcomes: Sequence[Outcome], agreement: dict[str, float | None] | None,
            memory_mb: float | None) -> dict[str, Any]:
    """One configuration's section of results.json."""
    crafted = population(outcomes, "crafted")
    normal = population(outcomes, "normal_clean")
    clean = [o for o in outcomes if o.fault == "none"]
    out: dict[str, Any] = dict(rates(crafted))
    out["latency_normal"] = latency(normal)
    out["memory_rss_mb"] = memory_mb
    out["handoff"] = handoffs(outcomes)
    out["rung_share_all"] = rung_share(outcomes)
    out["rung_share_normal"] = rung_share(normal)
    out["false_handoff_rate"] = (sum(bool(o.handoff_ms) for o in clean) / len(clean)) if clean else None
    out["clean_hazards"] = dict(Counter(h for o in clean for h in o.hazards))
    out["agreement_fp32"] = agreement or {}
    out["populations"] = {p: rates(population(outcomes, p))
                          for p in ("normal_clean", "abnormal_clean", "faulted")}
    out["by_fault"] = {f: rates([o for o in outcomes if o.fault == f and o.population == "abnormal"])
                       for f in sorted({o.fault for o in outcomes})}
    out["by_class"] = {c: rates([o for o in crafted if o.cls == c]) for c in sorted({o.cls for o in crafted})}
    out["finish_reasons"] = dict(Counter(o.finish_reason or o.status for o in outcomes))
    # Answers the ladder ended on a loop the reference rung confirmed (the model's own): their own
    # row, neither hidden among clean answers nor counted as handed off.
    ended = [o for o in crafted if o.finish_reason == "repetition"]
    out["ended_on_repetition"] = {"requests": len(ended), "rate": len(ended) / len(crafted) if crafted else None,
                                  "judged_garbage": sum(o.is_garbage for o in ended)}
    return out


def prompt_medians(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Each prompt's median latency over its rounds (answered requests only)."""
    by: dict[str, list[float]] = {}
    for o in outcomes:
        if o.status == "ok":
            by.setdefault(o.prompt_id, []).append(o.wall_ms)
    return {k: v for k, v in ((k, percentile(v, 50)) for k, v in by.items()) if v is not None}


def paired_ratio(bare: Sequence[Outcome], guarded: Sequence[Outcome]) -> dict[str, float | None]:
    """Guarded over bare on normal clean prompts: p50/p99 of requests and of per-token latency, the
    median of per-request ratios paired by (prompt, round), which is robust to drift, and the P99
    over prompts of each prompt's median over its rounds (`p99_prompt_medians`): the tail of the
    workload (which prompts are slow) with the machine's transient noise damped by repetition.
    Both configurations run the same prompts with the same greedy answers, interleaved."""
    lb, lg = latency(population(bare, "normal_clean")), latency(population(guarded, "normal_clean"))
    mb, mg = prompt_medians(population(bare, "normal_clean")), prompt_medians(population(guarded, "normal_clean"))
    common = sorted(set(mb) & set(mg))
    key = {(o.prompt_id, o.round): o for o in population(bare, "normal_clean") if o.status == "ok"}
    pairs = [o.wall_ms / key[(o.prompt_id, o.round)].wall_ms for o in population(guarded, "normal_clean")
             if o.status == "ok" and (o.prompt_id, o.round) in key and key[(o.prompt_id, o.round)].wall_ms]
    return {"p50": ratio(lg["p50_ms"], lb["p50_ms"]), "p99": ratio(lg["p99_ms"], lb["p99_ms"]),
            "per_token_p50": ratio(lg["per_token_p50_ms"], lb["per_token_p50_ms"]),
            "per_token_p99": ratio(lg["per_token_p99_ms"], lb["per_token_p99_ms"]),
            "paired_median": percentile(pairs, 50), "pairs": len(pairs),
            "p99_prompt_medians": ratio(percentile([mg[k] for k in common], 99),
                                        percentile([mb[k] for k in common], 99)),
            "prompts": len(common),
            "bare_p99_prompt_medians_ms": percentile([mb[k] for k in common], 99),
            "guarded_p99_prompt_medians_ms": percentile([mg[k] for k in common], 99)}
