"""Every figure of a validation report, from its `outcomes.jsonl` alone: the one module that computes them.

    python -m qladder.validate.recompute DIR            recompute DIR/results.json's "figures" from
                                                        DIR/outcomes.jsonl (and the run's raw
                                                        observations); print every verdict

Exit status: 0 every verdict passes and every figure reproduced; 1 a figure differs or a verdict
fails; 3 (EXIT_INCONCLUSIVE) nothing failed but a verdict could not be decided (an interval that
straddles its target, too few windows, no data). `--check` is accepted and changes nothing: a miss
is never an exit 0. No verdict field stored anywhere is read: every answer is judged again from its
text, ids, prompt and raw score (calibration.rejudge), every ratio bootstrapped again from its raw
latencies or window timings (intervals). It imports no torch.

`qladder validate` and `qladder validate --remote` write their outcomes first, read them back and
call `figures()` on what they read, so the file a reader gets is exactly what the report shows.

The targets are fixed here, per mode, before any run (`TARGETS`); a run cannot choose them. Each
is a verdict: pass, fail, inconclusive (an interval that straddles the target), "no data" (nothing
to judge: not a pass). Rules that hold for every figure:

- warm-up requests are written but never counted;
- a request without an answer (5xx, timeout, 4xx) counts, in every latency figure, as the run's
  slowest latency: never dropped;
- `answered clean` = an answer that is neither garbage nor stopped nor the fallback nor unjudged,
  for bare and guarded alike: a guard that gives up on a request, or cuts it short, loses it here;
- `stopped` (Outcome.stopped): the guard ended the answer with fewer tokens than fp32's reference
  (or with no reference to show otherwise); it counts against the guard like garbage and is never
  fp32-identical unless the whole reference was produced;
- garbage is shown raw and net of the answers fp32 alone gives too (`identical`, recomputed from
  the saved reference ids where the run kept them), for bare and guarded alike;
- the latency verdict is, over normal prompts, the paired ratio of the sums of each prompt's median
  latency over its rounds (guarded / bare) with its bootstrap interval over prompts, beside the
  same figure of an A/A pair (bare_aa / bare: two identical processes), whose interval must
  contain 1; per-prompt P90 / P99 and pooled P99 ratios are beside, for reading.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qladder.percentiles import percentile, ratio
from qladder.validate import intervals
from qladder.validate.calibration import Calibration, rejudge
from qladder.validate.figure_parts import (
    effective_latencies,
    group_by,
    load_cell,
    overall,
    throughput_verdict,
    verdict_of,
    window_rate,
    windows,
)
from qladder.validate.fleet_figures import fleet_figures
from qladder.validate.outcome import Outcome, read_jsonl
from qladder.validate.verified_figures import verified_figures

EXIT_INCONCLUSIVE = 3

SPLITS = ("train", "test")
CANDIDATE, BASE, AA = "guarded", "bare", "bare_aa"


@dataclass(frozen=True)
class Targets:
    latency_ratio: float  # the paired mean ratio over prompts, guarded over bare: its interval's top
    quality_share: float = 0.99  # greedy faulted answers equal to fp32's continuation
    max_unjudged_share: float = 0.01
    max_false_handoff_rate: float = 0.005  # normal prompts, no fault


TARGETS = {"in-process": Targets(latency_ratio=1.01), "remote": Targets(latency_ratio=1.05)}


def _rate(k: int, n: int) -> float | None:
    return k / n if n else None


def row(outs: Sequence[Outcome]) -> dict[str, Any]:
    """The table's counts and rates over some requests."""
    n = len(outs)
    garbage = [o for o in outs if o.garbage]
    bad = [o for o in outs if o.bad]
    own = sum(1 for o in bad if o.identical)
    counts = {"requests": n, "answered_clean": sum(o.answered_clean for o in outs), "garbage": len(garbage),
              "stopped": sum(o.stopped for o in outs), "garbage_or_stopped": len(bad),
              "garbage_fp32_identical": own, "garbage_net": len(bad) - own,
              "fallback": sum(o.ok and o.fallback for o in outs), "five_xx": sum(o.five_xx for o in outs),
              "four_xx": sum(o.four_xx for o in outs), "unjudged": sum(o.unjudged for o in outs)}
    out: dict[str, Any] = dict(counts)
    out |= {f"{k}_rate": _rate(v, n) for k, v in counts.items() if k != "requests"}
    out["reasons"] = dict(sorted(Counter(r for o in garbage for r in o.reasons).items()))
    out["errors"] = dict(sorted(Counter((o.error or str(o.status)).split(":")[0] for o in outs if not o.ok).items()))
    out["max_latency_ms"] = max((o.latency_ms for o in outs), default=None)
    return out


RUNG0 = frozenset({"int4", "llama-server"})  # the rungs an answer starts on when nothing moved it


def moved(o: Outcome) -> bool:
    """Did the answer leave (or never start on) the INT4 rung: a handoff, or a gateway that routed
    the request to the standby (a quarantined prompt, an open breaker)?"""
    return o.handed_off or bool(o.rungs and o.rungs[0] not in RUNG0)


def quality(outs: Sequence[Outcome]) -> dict[str, Any]:
    """Greedy faulted requests of the guarded configuration that left the INT4 rung: the share whose
    answer, after its rung-0 prefix, is token-identical to fp32's greedy continuation of that prefix.
    A request with no answer, a fallback, or no reference computed counts as not identical; faulted
    requests that never left the INT4 rung have no continuation to compare (counted beside: the
    garbage verdicts judge them)."""
    faulted = [o for o in outs if o.config == CANDIDATE and o.fault is not None and o.greedy]
    pop = [o for o in faulted if not o.ok or o.fallback or moved(o)]
    same = sum(1 for o in pop if o.ok and not o.fallback and o.fp32_continuation_identical is True)
    return {"requests": len(pop), "identical": same, "share": _rate(same, len(pop)),
            "not_computed": sum(1 for o in pop if o.ok and o.fp32_continuation_identical is None),
            "faulted_never_moved": len(faulted) - len(pop)}



def _medians(outs: Sequence[Outcome], slowest: float) -> dict[str, float]:
    by = group_by(outs, lambda o: o.prompt_id)
    meds = {k: percentile(effective_latencies(v, slowest), 50) for k, v in by.items()}
    return {k: v for k, v in meds.items() if v is not None}


def latency_side(outs: Sequence[Outcome], slowest: float) -> dict[str, Any]:
    eff = effective_latencies(outs, slowest)
    ttft = [o.ttft_ms for o in outs if o.ok and o.ttft_ms is not None]
    return {"requests": len(outs), "failed": sum(not o.ok for o in outs), "p50_ms": percentile(eff, 50),
            "p90_ms": percentile(eff, 90), "p99_ms": percentile(eff, 99),
            "mean_ms": sum(eff) / len(eff) if eff else None,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "rounds": {str(r): {"requests": len(v), "p50_ms": percentile(effective_latencies(v, slowest), 50),
                                "p99_ms": percentile(effective_latencies(v, slowest), 99)}
                       for r, v in group_by(outs, lambda o: str(o.round)).items()}}


def latency_ratio(cand: Sequence[Outcome], base: Sequence[Outcome], slowest: float) -> dict[str, Any]:
    """cand over base on the same prompts: per-prompt ratios of the medians over rounds, pooled
    percentiles, per round, and the median of the ratios paired by (prompt, round)."""
    mc, mb = _medians(cand, slowest), _medians(base, slowest)
    common = sorted(set(mc) & set(mb))
    per_prompt = [mc[k] / mb[k] for k in common if mb[k]]
    ec, eb = effective_latencies(cand, slowest), effective_latencies(base, slowest)
    key = {(o.prompt_id, o.round): (o.latency_ms if o.ok else slowest) for o in base}
    pairs = [(o.latency_ms if o.ok else slowest) / key[(o.prompt_id, o.round)] for o in cand
             if key.get((o.prompt_id, o.round))]
    rounds = {}
    for r, outs in group_by(cand, lambda o: str(o.round)).items():
        b = [o for o in base if str(o.round) == r]
        ea, eb2 = effective_latencies(outs, slowest), effective_latencies(b, slowest)
        rounds[r] = {"p50": ratio(percentile(ea, 50), percentile(eb2, 50)),
                     "p99": ratio(percentile(ea, 99), percentile(eb2, 99))}
    mean_ratio = intervals.paired_mean_ratio([(mc[k], mb[k]) for k in common])
    return {"prompts": len(per_prompt), "mean_ratio": mean_ratio.to_dict(),
            "per_prompt_p50": percentile(per_prompt, 50),
            "per_prompt_p90": percentile(per_prompt, 90), "per_prompt_p99": percentile(per_prompt, 99),
            "per_prompt_max": max(per_prompt, default=None),
            "prompts_over_1_05": sum(1 for x in per_prompt if x > 1.05),
            "pooled_p50": ratio(percentile(ec, 50), percentile(eb, 50)),
            "pooled_p99": ratio(percentile(ec, 99), percentile(eb, 99)),
            "requests_per_side": min(len(ec), len(eb)), "paired_median": percentile(pairs, 50),
            "pairs": len(pairs), "rounds": rounds}


def judge_summary(outs: Sequence[Outcome], cal: Calibration) -> dict[str, Any]:
    answered = [o for o in outs if o.ok and not o.fallback]
    scored = [o for o in answered if o.verdict.get("scored")]
    clean = [float(o.verdict["nll"]) for o in scored if o.fault is None and o.verdict.get("nll") is not None]
    normal_test = {(o.prompt_id, tuple(o.token_ids)): float(o.verdict["nll"]) for o in scored
                   if o.phase == "normal" and o.split == "test" and o.verdict.get("nll") is not None}
    return {"answers": len(answered), "scored": len(scored), "unjudged": sum(o.unjudged for o in outs),
            "unjudged_share": _rate(sum(o.unjudged for o in outs), len(answered)),
            "calibration": cal.to_dict(), "threshold_nll": cal.threshold,
            "normal_test_answers": len(normal_test),
            "normal_test_over_threshold": sum(x > cal.threshold for x in normal_test.values()),
            "normal_test_max_nll": max(normal_test.values(), default=None),
            "clean_scored": len(clean), "clean_max_nll": max(clean, default=None),
            "clean_p50_nll": percentile(clean, 50), "clean_over_threshold": sum(x > cal.threshold for x in clean),
            "stopped": sum(o.stopped for o in outs),
            "identity_from_reference_ids": sum(o.fp32_reference_ids is not None for o in answered),
            "identity_from_stored_flag": sum(o.fp32_reference_ids is None and o.fp32_identical is not None
                                             for o in answered),
            "token_ids_retokenized": sum(o.token_ids_source == "retokenized" for o in answered)}


def handoffs(outs: Sequence[Outcome]) -> dict[str, Any]:
    lat = [x for o in outs for x in o.handoff_ms]
    return {"count": len(lat), "mean_ms": sum(lat) / len(lat) if lat else None, "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat, default=None)}


def rung_share(outs: Sequence[Outcome]) -> dict[str, float]:
    c = Counter(r for o in outs for r in o.rungs)
    total = sum(c.values())
    return {k: v / total for k, v in sorted(c.items())} if total else {}


def false_handoffs(outs: Sequence[Outcome]) -> dict[str, Any]:
    """Clean requests that left the INT4 rung (a handoff, or a quarantine a handoff left behind)."""
    n, k = len(outs), sum(moved(o) for o in outs)
    return {"requests": n, "handed_off": k, "rate": _rate(k, n),
            "hazards": dict(sorted(Counter(h for o in outs for h in o.hazards).items()))}


def _identical(outs: Sequence[Outcome]) -> dict[str, Any]:
    """Answers whose ids fp32 alone gives too (where that was computed): INT4's drift, read coarsely."""
    done = [o for o in outs if o.identical is not None]
    k = sum(1 for o in done if o.identical)
    return {"computed": len(done), "identical": k, "share": _rate(k, len(done))}


def _at_least(limit: float) -> Callable[[float], bool]:
    return lambda v: v >= limit



def verdicts(f: dict[str, Any], t: Targets) -> list[dict[str, Any]]:
    out = []
    for split in SPLITS:
        g, b = f["crafted"][split].get(CANDIDATE, {}), f["crafted"][split].get(BASE, {})
        n = g.get("requests", 0)
        out.append(verdict_of(f"{split}: guarded garbage or stopped answers beyond fp32-identical ones",
                            g.get("garbage_net") if n else None, 0, lambda v: v == 0,
                            f"crafted prompts (abnormal, faulted or not); {g.get('stopped')} stopped"))
        out.append(verdict_of(f"{split}: guarded fallback answers", g.get("fallback") if n else None, 0,
                            lambda v: v == 0, "a standby was up"))
        out.append(verdict_of(f"{split}: guarded 5xx", g.get("five_xx") if n else None, 0, lambda v: v == 0))
        gc, bc = g.get("answered_clean_rate"), b.get("answered_clean_rate")
        out.append(verdict_of(f"{split}: answered clean, guarded minus bare", None if gc is None or bc is None
                            else gc - bc, 0.0, lambda v: v >= 0, "guarded must answer clean at least as often"))
        q = f["quality"][split]
        out.append(verdict_of(f"{split}: greedy faulted answers token-identical to fp32's continuation",
                            q["share"], t.quality_share, lambda v: v >= t.quality_share))
    g, b = f["normal"].get(CANDIDATE, {}), f["normal"].get(BASE, {})
    n = g.get("requests", 0)
    out.append(verdict_of("normal: guarded 5xx", g.get("five_xx") if n else None, 0, lambda v: v == 0))
    out.append(verdict_of("normal: guarded fallback answers", g.get("fallback") if n else None, 0, lambda v: v == 0))
    gc, bc = g.get("answered_clean_rate"), b.get("answered_clean_rate")
    out.append(verdict_of("normal: answered clean, guarded minus bare", None if gc is None or bc is None else gc - bc,
                        0.0, lambda v: v >= 0))
    j = f["judge"]
    out.append(verdict_of("unjudged answers (likelihood asked for, not computed)", j["unjudged_share"],
                        t.max_unjudged_share, lambda v: v <= t.max_unjudged_share))
    fh = f["false_handoffs"].get(CANDIDATE, {})
    out.append(verdict_of("false handoffs, normal test-half prompts", fh.get("rate"), t.max_false_handoff_rate,
                        lambda v: v <= t.max_false_handoff_rate))
    lr = f["latency"]["ratios"]
    out.append(latency_verdict("latency: mean over normal prompts of each one's median, guarded / bare",
                               lr.get("guarded_over_bare"), lr.get("aa_over_bare"), t.latency_ratio))
    return out


def latency_verdict(name: str, cand: dict[str, Any] | None, aa: dict[str, Any] | None, limit: float) -> dict[str, Any]:
    """The paired mean ratio's interval against `limit`, beside its A/A (which must contain 1)."""
    iv = intervals.Interval(**cand["mean_ratio"]) if cand else intervals.Interval(None, None, None, 0, "prompts", "")
    a = intervals.Interval(**aa["mean_ratio"]) if aa else None
    note = "" if a is not None else "no A/A measured"
    v = intervals.verdict(name, iv, limit, higher_is_better=False, note=note, aa=a)
    if a is None and v["status"] in ("pass", "fail"):
        v["status"] = "inconclusive"
    if cand:
        v["note"] += f"; for reading: per-prompt P99 {cand['per_prompt_p99']}, pooled P99 {cand['pooled_p99']}"
    return v



def figures(outcomes: Sequence[Outcome], mode: str, observations: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every figure of a run's report (`mode`: in-process | remote | bench-serving | bench-serve | bench-fleet;
    `observations`: what bench serve sampled besides its requests, the breaker's modes and counts)."""
    if mode == "bench-serving":
        return serving_figures(outcomes)
    if mode == "bench-serve":
        return serve_figures(outcomes, observations or {})
    if mode == "bench-fleet":
        return fleet_figures(outcomes, observations or {})
    if mode == "bench-verified":
        return verified_figures(outcomes)
    t = TARGETS[mode]
    cal = rejudge(outcomes)
    outs = [o for o in outcomes if o.phase not in ("warmup", "precision")]
    slowest = max((o.latency_ms for o in outs), default=0.0)
    configs = sorted({o.config for o in outs})
    crafted = [o for o in outs if o.population == "abnormal"]
    normal = [o for o in outs if o.phase == "normal"]
    f: dict[str, Any] = {"mode": mode, "targets": asdict(t), "configs": configs,
                         "counts": {c: dict(Counter(o.phase for o in outcomes if o.config == c)) for c in configs},
                         "slowest_latency_ms": slowest}
    f["crafted"] = {split: {c: row([o for o in crafted if o.config == c and (split == "all" or o.split == split)])
                            for c in configs} for split in (*SPLITS, "all")}
    f["normal"] = {c: row([o for o in normal if o.config == c]) for c in configs}
    f["by_fault"] = {c: {k: {"fault_set": v[0].fault_set, **row(v)}
                         for k, v in group_by([o for o in crafted if o.config == c],
                                              lambda o: o.fault or "none").items()}
                     for c in configs}
    f["by_class"] = {c: {k: row(v) for k, v in group_by([o for o in crafted if o.config == c],
                                                   lambda o: o.prompt_class).items()} for c in configs}
    f["quality"] = {split: quality([o for o in crafted if split == "all" or o.split == split])
                    for split in (*SPLITS, "all")}
    # judged on the test half: the guard's bounds were calibrated on clean prompts of both halves once,
    # the bounds tuned since (bench/calibrate_*.py) on the train half only
    f["false_handoffs"] = {c: false_handoffs([o for o in normal if o.config == c and o.split == "test"])
                           for c in configs}
    f["false_handoffs_train"] = {c: false_handoffs([o for o in normal if o.config == c and o.split == "train"])
                                 for c in configs}
    f["false_handoffs_abnormal_clean"] = {c: false_handoffs([o for o in crafted if o.config == c and o.fault is None])
                                          for c in configs}
    sides = {c: [o for o in normal if o.config == c] for c in configs}
    ratios = {}
    if sides.get(CANDIDATE) and sides.get(BASE):
        ratios["guarded_over_bare"] = latency_ratio(sides[CANDIDATE], sides[BASE], slowest)
    if sides.get(AA) and sides.get(BASE):
        ratios["aa_over_bare"] = latency_ratio(sides[AA], sides[BASE], slowest)
    f["latency"] = {"normal": {c: latency_side(v, slowest) for c, v in sides.items()}, "ratios": ratios}
    f["handoff"] = {c: handoffs([o for o in outs if o.config == c]) for c in configs}
    f["rung_share"] = {c: rung_share([o for o in outs if o.config == c]) for c in configs}
    f["finish_reasons"] = {c: dict(sorted(Counter(str(o.finish_reason or o.status) for o in outs
                                                  if o.config == c).items())) for c in configs}
    ended = [o for o in crafted if o.finish_reason == "repetition"]
    f["ended_on_repetition"] = {c: {"requests": sum(o.config == c for o in ended),
                                    "judged_garbage": sum(o.config == c and o.garbage for o in ended),
                                    "stopped": sum(o.config == c and o.stopped for o in ended)}
                                for c in configs}
    f["fp32_identical_normal"] = {c: _identical([o for o in normal if o.config == c]) for c in configs}
    f["judge"] = judge_summary(outs, cal)
    from qladder.validate.precision_table import table

    f["precision"] = table(outcomes)  # for reading: no verdict rests on it
    f["verdicts"] = verdicts(f, t)
    f["verdict"] = overall(f["verdicts"])
    return f


# -- load benchmarks -----------------------------------------------------------------------------------







SERVING_TARGETS = {"guarded_c8_over_c1": 1.3, "guarded_over_raw_c8": 0.95}


def serving_figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """`qladder bench serving`: per prompt set, configuration and concurrency; the ratios; the
    verdicts, on the set of every prompt (loops and all; the screened set is beside, for reading)."""
    cal = rejudge(outcomes)
    outs = [o for o in outcomes if o.phase != "warmup"]
    slowest = max((o.latency_ms for o in outs), default=0.0)
    results: dict[str, Any] = {}
    for name, group in group_by(outs, lambda o: o.phase).items():
        results[name] = {c: {str(k): load_cell(v, slowest) for k, v in group_by([o for o in group if o.config == c],
                                                                           lambda o: f"{o.concurrency:04d}").items()}
                         for c in sorted({o.config for o in group})}
        for cells in results[name].values():  # keys as the concurrency, not its padding
            for k in list(cells):
                cells[str(int(k))] = cells.pop(k)

    def cell(name: str, config: str, c: int) -> list[Outcome]:
        return [o for o in outs if o.phase == name and o.config == config and o.concurrency == c]

    pairs = {"guarded_c8_over_c1": (("guarded", 8), ("guarded", 1)),
             "guarded_over_raw_c8": (("guarded", 8), ("raw", 8)),
             "guarded_over_bare_c8": (("guarded", 8), ("bare", 8)),
             "faulted_over_guarded_c8": (("guarded_faulted", 8), ("guarded", 8)),
             "elastic_over_guarded_c8": (("elastic", 8), ("guarded", 8)),
             "unchecked_elastic_over_unchecked_c8": (("unchecked_elastic", 8), ("unchecked", 8)),
             "unchecked_over_guarded_c8": (("unchecked", 8), ("guarded", 8))}
    ratios: dict[str, Any] = {}
    for name in results:
        ratios[name] = {}
        for k, (x, y) in pairs.items():
            if cell(name, *x) and cell(name, *y):
                iv = intervals.window_rate_ratio(windows(cell(name, *x)), windows(cell(name, *y)))
                ratios[name][k] = iv.to_dict()
    verdicts = []
    for k, lim in SERVING_TARGETS.items():
        (x, y), screened = pairs[k], ratios.get("screened", {}).get(k)
        verdicts.append(throughput_verdict(f"all prompts: {k}", cell("all", *x), cell("all", *y), lim,
                                           f"screened: {intervals.fmt(intervals.Interval(**screened))}"
                                           if screened else "")[0])
    faulted = [o for o in outs if o.fault is not None]
    via = sum(load_cell([o], slowest)["faulted_answered_via_standby"] for o in faulted)
    verdicts.append(verdict_of("faulted requests answered through the standby (share)", _rate(via, len(faulted)),
                             1.0, lambda v: v == 1.0, f"{via} of {len(faulted)}"))
    verdicts.append(verdict_of("requests without an answer (5xx)", sum(o.five_xx for o in outs), 0, lambda v: v == 0))
    return {"mode": "bench-serving", "calibration": cal.to_dict(), "results": results, "ratios": ratios,
            "verdicts": verdicts, "verdict": overall(verdicts)}


SERVE_TARGETS = {"tok_s_ratio": 0.9, "latency_ratio": 1.1}


def serve_figures(outcomes: Sequence[Outcome], observations: dict[str, Any]) -> dict[str, Any]:
    """`qladder bench serve`: the faulted phase, the burst, and the comparison of guarded with
    llama-server (tok/s pooled over interleaved windows, with its interval; the latency verdict,
    beside the A/A pair of llama-servers)."""
    cal = rejudge(outcomes)
    outs = [o for o in outcomes if o.phase != "warmup"]
    slowest = max((o.latency_ms for o in outs), default=0.0)
    faulted = [o for o in outs if o.phase == "faulted"]
    hit = [o for o in faulted if o.fault is not None]
    obs_f, obs_b = observations.get("faulted", {}), observations.get("burst", {})
    f: dict[str, Any] = {"mode": "bench-serve", "targets": dict(SERVE_TARGETS)}
    f["faulted"] = {**row(faulted), "statuses": dict(sorted(Counter(str(o.status) for o in faulted).items())),
                    "answered_or_429": all(o.ok or o.status == 429 for o in faulted), "faulted_requests": row(hit),
                    "faulted_handed_off": sum(o.handed_off for o in hit),
                    "hazards_reported": sum(len(o.hazards) for o in faulted), **obs_f}
    burst = [o for o in outs if o.phase in ("burst", "recovery")]
    modes = [m for _, m in obs_b.get("timeline", [])]
    f["burst"] = {"requests": len(burst), "five_xx": sum(o.five_xx for o in burst), "opened": "open" in modes,
                  "closed_after": bool(modes) and modes[-1] == "closed", **obs_b}
    cmp_ = [o for o in outs if o.phase == "compare"]
    sides = group_by(cmp_, lambda o: o.config)
    f["compare"] = {c: {"windows": {str(r): window_rate(w) for r, w in group_by(v, lambda o: f"{o.round:04d}").items()},
                        "latency": latency_side(v, slowest)} for c, v in sides.items()}

    def pooled(a: str, b: str) -> dict[str, Any] | None:
        if a not in sides or b not in sides:
            return None
        return intervals.window_rate_ratio(windows(sides[a]), windows(sides[b])).to_dict()

    f["ratios"] = {"guarded_over_llama_server_tok_s": pooled("guarded", "llama_server"),
                   "guarded_over_bare_tok_s": pooled("guarded", "bare"),
                   "aa_tok_s": pooled("llama_server_aa", "llama_server")}
    if "unchecked" in sides:  # --box
        f["ratios"]["unchecked_over_llama_server_tok_s"] = pooled("unchecked", "llama_server")
    lat = {k: latency_ratio(sides[a], sides[b], slowest) for k, (a, b) in
           {"guarded_over_llama_server": ("guarded", "llama_server"), "guarded_over_bare": ("guarded", "bare"),
            "aa_over_llama_server": ("llama_server_aa", "llama_server")}.items() if a in sides and b in sides}
    f["latency_ratios"] = lat
    t, v = SERVE_TARGETS, []
    fr = f["faulted"]
    some = bool(faulted)
    v.append(verdict_of("faulted phase: 5xx", fr["five_xx"] if some else None, 0, lambda x: x == 0))
    v.append(verdict_of("faulted phase: every request answered or told 429", float(fr["answered_or_429"]) if some
                      else None, 1.0, lambda x: x == 1.0))
    v.append(verdict_of("faulted phase: faulted requests answered clean (share)", fr["faulted_requests"][
        "answered_clean_rate"], 1.0, lambda x: x == 1.0, f"{fr['faulted_requests']['answered_clean']} of "
        f"{fr['faulted_requests']['requests']}"))
    v.append(verdict_of("faulted phase: incident rows minus the hazards the answers report",
                      None if "incident_rows" not in fr else fr["incident_rows"] - fr["hazards_reported"], 0,
                      lambda x: x == 0))
    v.append(verdict_of("burst: the INT4 breaker opened, then closed", None if not modes else
                      float(f["burst"]["opened"] and f["burst"]["closed_after"]), 1.0, lambda x: x == 1.0, str(modes)))
    v.append(verdict_of("burst: 5xx", f["burst"]["five_xx"] if burst else None, 0, lambda x: x == 0))
    aa_tok = f["ratios"]["aa_tok_s"]
    tv, _ = throughput_verdict("compare: guarded tok/s over llama-server (pooled over interleaved windows)",
                               sides.get("guarded", []), sides.get("llama_server", []), t["tok_s_ratio"],
                               f"A/A: {intervals.fmt(intervals.Interval(**aa_tok)) if aa_tok else 'none'}")
    if aa_tok and tv["status"] in ("pass", "fail") and not intervals.Interval(**aa_tok).contains(1.0):
        tv["status"], tv["note"] = "inconclusive", tv["note"] + ": the A/A interval excludes 1"
    v.append(tv)
    v.append(latency_verdict("compare: latency, mean over prompts of each one's median, guarded / llama-server",
                             lat.get("guarded_over_llama_server"), lat.get("aa_over_llama_server"),
                             t["latency_ratio"]))
    f["calibration"] = cal.to_dict()
    f["verdicts"] = v
    f["verdict"] = overall(v)
    return f


def normalized(x: Any) -> Any:
    """As JSON would give it back (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(x))


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (exactly: floats included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def print_verdicts(f: dict[str, Any], out: Any = sys.stdout) -> None:
    for v in f["verdicts"]:
        iv = v.get("interval")
        shown = f"{v['value']} [{iv[0]}, {iv[1]}]" if iv else f"{v['value']}"
        print(f"{v['status'].upper():>12}  {v['name']}: {shown} (limit {v['limit']}) {v['note']}", file=out)
    print(f"verdict: {f['verdict'].upper()}", file=out)


def exit_code(verdict: str) -> int:
    return 0 if verdict == "pass" else 1 if verdict == "fail" else EXIT_INCONCLUSIVE


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qladder.validate.recompute", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run's output folder (outcomes.jsonl, results.json)")
    ap.add_argument("--check", action="store_true", help="(kept for old scripts: a miss always exits non-zero)")
    a = ap.parse_args(argv)
    results = json.loads((a.dir / "results.json").read_text(encoding="utf-8"))
    stored = results["figures"]
    again = normalized(figures(read_jsonl(a.dir / "outcomes.jsonl"), stored["mode"], results.get("observations")))
    diff = differences(stored, again)
    for d in diff[:50]:
        print(f"DIFFERS {d}")
    print(f"{len(diff)} figure(s) differ" if diff else "every figure reproduced exactly from outcomes.jsonl"
          + (" (and the run's observations)" if results.get("observations") else ""))
    print_verdicts(again)
    return 1 if diff else exit_code(again["verdict"])


if __name__ == "__main__":
    sys.exit(main())
