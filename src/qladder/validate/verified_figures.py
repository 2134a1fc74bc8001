"""The figures of `qladder bench verified`, from its outcomes (called by `recompute.figures`).

    results[config][concurrency]   figure_parts.load_cell: tok/s (pooled over the rounds' windows:
                                   their tokens over their spans), latency P50/P99 (a failed
                                   request counts as the slowest), TTFT, per-token gaps
    ratios                         each with its bootstrap interval over the interleaved rounds
                                   (intervals.window_rate_ratio; a verdict needs MIN_WINDOWS a side):
                                   verified over fp32 alone at c1 and c8, over vLLM's fp32 at c1 and
                                   c8, fp32's c8 over its c1; verified-drafting's beside (every
                                   request drafting: the mechanism's own numbers, no verdict); the
                                   drift audit's: int4-audit's tok/s over int4's at c8
    exactness                      greedy answers of both verified configurations token-identical to
                                   the reference (fp32's naive greedy loop on the same ids)
    acceptance                     per prompt class: drafts that stood / drafts, and the tokens a
                                   window gave ((kept + windows) / windows: each window also gives
                                   the verifier's own token)
    sampled                        a two-sample chi-square test per answer position of the token's
                                   distribution, verified against fp32 alone (tokens drawn >= 5
                                   times over both binned, the rest pooled into one bin; the p-value
                                   scipy's chi2.sf)
    bound                          alpha, k, c measured in the run and the speculative bound they
                                   give; the c1 verdict is the measured speedup against 0.8 of it
The targets (issue 21) are fixed in TARGETS before any run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from scipy.stats import chi2

from qladder.validate import intervals
from qladder.validate.calibration import rejudge
from qladder.validate.figure_parts import group_by, load_cell, overall, throughput_verdict, verdict_of, windows
from qladder.validate.outcome import Outcome

# verified_over_fp32_c1_of_bound: the measured c1 speedup over fp32 alone, as a share of the speculative
# bound its own alpha, k and c give (its interval's bottom, against the bound read at the point values)
TARGETS = {"verified_over_fp32_c1_of_bound": 0.8, "verified_over_vllm_fp32_c8": 1.0, "fp32_c8_over_c1": 3.0,
           "exactness": 1.0, "sampled_min_p": 0.001, "audit_kept_c8": 0.97}


def speculative_bound(alpha: float, k: float, c: float) -> float | None:
    """The expected speedup of speculative decoding over the verifier alone (Leviathan et al. 2023,
    eq. 1 with the cost ratio): (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); alpha = 1: (k + 1)/(k c + 1)."""
    if k <= 0:
        return None
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return float((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)))


def _mean_step(outs: Sequence[Outcome]) -> float | None:
    steps = [x for o in outs if o.ok for x in o.step_ms]
    return sum(steps) / len(steps) if steps else None


def bound(greedy: Sequence[Outcome]) -> dict[str, Any]:
    """alpha (drafts that stood over drafts), k (drafts per window) of the verified answers at c1,
    and c: INT4's mean token interval over fp32's, each alone at c1 (one draft step over one
    verify pass); the bound they give."""
    v = [o for o in greedy if o.config == "verified" and o.concurrency == 1 and o.ok and o.verify_windows]
    w = sum(o.verify_windows or 0 for o in v)
    d = sum(o.verify_drafts or 0 for o in v)
    kept = sum(o.verify_kept or 0 for o in v)
    draft = _mean_step([o for o in greedy if o.config == "int4" and o.concurrency == 1])
    verify = _mean_step([o for o in greedy if o.config == "fp32" and o.concurrency == 1])
    alpha = kept / d if d else None
    k = d / w if w else None
    c = draft / verify if draft is not None and verify else None
    b = speculative_bound(alpha, k, c) if alpha is not None and k is not None and c is not None else None
    return {"alpha": alpha, "k": k, "c": c, "draft_step_ms": draft, "verify_pass_ms": verify, "bound": b,
            "answers": len(v), "windows": w, "drafts": d, "kept": kept,
            "c_note": "one INT4 step (llama.cpp alone, c1) over one fp32 step (torch alone, c1): a verify pass "
                      "over k+1 positions costs at least one step, so the bound read with it is an upper one"}


def chi_square_two_sample(a: Sequence[int], b: Sequence[int], min_count: int = 5) -> dict[str, Any]:
    """Are draws `a` and `b` from one distribution? Pearson's chi-square on a 2 x bins table."""
    ca, cb = Counter(a), Counter(b)
    total = ca + cb
    bins = sorted(t for t, n in total.items() if n >= min_count)
    rows = [[ca[t] for t in bins], [cb[t] for t in bins]]
    rest_a, rest_b = len(a) - sum(rows[0]), len(b) - sum(rows[1])
    if rest_a + rest_b:
        rows[0].append(rest_a)
        rows[1].append(rest_b)
    n = len(a) + len(b)
    cols = [x + y for x, y in zip(*rows, strict=True)]
    stat = 0.0
    for r, side in zip(rows, (len(a), len(b)), strict=True):
        for o, col in zip(r, cols, strict=True):
            e = side * col / n
            stat += (o - e) ** 2 / e if e > 0 else 0.0
    df = len(cols) - 1
    p = float(chi2.sf(stat, df)) if df > 0 else 1.0
    return {"statistic": stat, "df": df, "p": p, "bins": len(cols), "n": [len(a), len(b)]}


def verified_figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    cal = rejudge(outcomes)
    greedy = [o for o in outcomes if o.phase == "greedy"]
    slowest = max((o.latency_ms for o in greedy), default=0.0)
    results = {c: {str(int(k)): load_cell(v, slowest) for k, v in
                   sorted(group_by([x for x in greedy if x.config == c], lambda x: f"{x.concurrency:04d}").items())}
               for c in sorted({o.config for o in greedy})}

    def cell(config: str, c: int) -> list[Outcome]:
        return [o for o in greedy if o.config == config and o.concurrency == c]

    pairs = {"verified_over_fp32_c1": (("verified", 1), ("fp32", 1)),
             "verified_over_fp32_c8": (("verified", 8), ("fp32", 8)),
             "verified_over_vllm_fp32_c1": (("verified", 1), ("vllm-fp32", 1)),
             "verified_over_vllm_fp32_c8": (("verified", 8), ("vllm-fp32", 8)),
             "fp32_c8_over_c1": (("fp32", 8), ("fp32", 1)),
             "verified_c8_over_c1": (("verified", 8), ("verified", 1)),
             "verified_over_int4_c1": (("verified", 1), ("int4", 1)),
             "drafting_over_fp32_c1": (("verified-drafting", 1), ("fp32", 1)),
             "drafting_over_fp32_c8": (("verified-drafting", 8), ("fp32", 8)),
             "int4_audit_over_int4_c8": (("int4-audit", 8), ("int4", 8))}
    ratios: dict[str, Any] = {}
    checks: dict[str, tuple[dict[str, Any], intervals.Interval]] = {}
    names = {"verified_over_fp32_c1": "verified / fp32 alone, tok/s at c1, as a share of the speculative bound",
             "verified_over_vllm_fp32_c8": "verified / vLLM fp32, tok/s at c8",
             "fp32_c8_over_c1": "batched fp32 alone, tok/s c8 / c1",
             "int4_audit_over_int4_c8": "drift audit at rate 0.1: INT4 tok/s kept at c8 (int4-audit / int4)"}
    spec = bound(greedy)
    t = TARGETS
    limits = {"verified_over_fp32_c1": t["verified_over_fp32_c1_of_bound"] * spec["bound"] if spec["bound"] else 0.0,
              "verified_over_vllm_fp32_c8": t["verified_over_vllm_fp32_c8"], "fp32_c8_over_c1": t["fp32_c8_over_c1"],
              "int4_audit_over_int4_c8": t["audit_kept_c8"]}
    for key, (x, y) in pairs.items():
        if key in names:
            checks[key] = throughput_verdict(names[key], cell(*x), cell(*y), limits[key])
            ratios[key] = checks[key][1].to_dict()
        elif cell(*x) and cell(*y):
            ratios[key] = intervals.window_rate_ratio(windows(cell(*x)), windows(cell(*y))).to_dict()
    c1 = checks["verified_over_fp32_c1"][0]
    if spec["bound"] is None:
        c1["status"], c1["note"] = "no data", "no bound: alpha, k or c not measured"
    else:
        c1["note"] = (f"bound {spec['bound']:.3f} (alpha {spec['alpha']:.3f}, k {spec['k']:.2f}, c {spec['c']:.3f}); "
                      f"limit = {t['verified_over_fp32_c1_of_bound']} x bound; {c1['note']}").rstrip("; ")
    ref = {o.prompt_id: o.token_ids for o in outcomes if o.phase == "reference"}
    verified = [o for o in greedy if o.config in ("verified", "verified-drafting")]
    same = [o for o in verified if o.ok and o.token_ids == ref.get(o.prompt_id)]
    fp32_same = [o for o in greedy if o.config == "fp32" and o.ok and o.token_ids == ref.get(o.prompt_id)]
    vllm = [o for o in greedy if o.config == "vllm-fp32"]
    share = len(same) / len(verified) if verified else None
    n_prompts = len({o.prompt_id for o in verified})
    longest = max((len(o.token_ids) for o in verified), default=0)
    exactness = {"verified_identical": len(same), "verified": len(verified), "prompts": n_prompts,
                 "tokens": sum(len(o.token_ids) for o in verified), "longest": longest,
                 "share": share,
                 "differ": sorted({o.prompt_id for o in verified if o not in same}),
                 "fp32_alone_identical": [len(fp32_same), sum(o.config == "fp32" for o in greedy)],
                 "vllm_identical": [sum(o.ok and o.token_ids == ref.get(o.prompt_id) for o in vllm), len(vllm)]}
    acceptance: dict[str, Any] = {}
    for cls, group in sorted(group_by([o for o in verified if o.verify_windows], lambda o: o.prompt_class).items()):
        # every drafted answer, of either verified configuration
        w = sum(o.verify_windows or 0 for o in group)
        d = sum(o.verify_drafts or 0 for o in group)
        k = sum(o.verify_kept or 0 for o in group)
        acceptance[cls] = {"windows": w, "drafts": d, "kept": k, "acceptance": k / d if d else None,
                           "tokens_per_window": (k + w) / w if w else None}
    sampled: dict[str, Any] = {}
    sv = [o for o in outcomes if o.phase == "sampled" and o.config == "verified" and o.ok]
    sf = [o for o in outcomes if o.phase == "sampled" and o.config == "fp32" and o.ok]
    width = max((len(o.token_ids) for o in sv + sf), default=0)
    for pos in range(width):
        sampled[str(pos)] = chi_square_two_sample([o.token_ids[pos] for o in sv if len(o.token_ids) > pos],
                                                  [o.token_ids[pos] for o in sf if len(o.token_ids) > pos])
    min_p = min((v["p"] for v in sampled.values()), default=None)
    five_xx = sum(o.five_xx for o in greedy)
    s_prompts = len({o.prompt_id for o in sv + sf})
    verdicts = [
        c1, checks["verified_over_vllm_fp32_c8"][0], checks["fp32_c8_over_c1"][0],
        verdict_of("greedy verified answers identical to fp32's greedy answers", share, t["exactness"],
                 lambda v: v >= t["exactness"], f"{len(same)} of {len(verified)} answers: {n_prompts} prompts, "
                 f"each answered {len(verified) // max(n_prompts, 1)} times, up to {longest} tokens"),
        verdict_of("sampled: smallest p of the per-position chi-square tests, verified vs fp32", min_p,
                 t["sampled_min_p"], lambda v: v >= t["sampled_min_p"],
                 f"{s_prompts} prompt x {width} positions; {len(sv)} and {len(sf)} answers"),
        checks["int4_audit_over_int4_c8"][0],
        verdict_of("requests without an answer (5xx)", five_xx, 0, lambda v: v == 0),
    ]
    return {"mode": "bench-verified", "targets": dict(TARGETS), "calibration": cal.to_dict(), "results": results,
            "ratios": ratios, "bound": spec, "exactness": exactness, "acceptance": acceptance, "sampled": sampled,
            "verdicts": verdicts, "verdict": overall(verdicts)}
