"""The figures of `qladder bench verified`, from its outcomes (called by `recompute.figures`).

    results[config][concurrency]   recompute.load_cell: tok/s (the median of the rounds' windows,
                                   each its tokens over its span), latency P50/P99 (a failed
                                   request counts as the slowest), TTFT, per-token gaps
    ratios                         verified over fp32 alone at c1 and c8, over vLLM's fp32 at c1 and
                                   c8, fp32's c8 over its c1; verified-drafting's beside (every
                                   request drafting: the mechanism's own numbers, no verdict); the
                                   drift audit's cost: 1 - int4-audit's tok/s over int4's at c8
    exactness                      greedy answers of both verified configurations token-identical to
                                   the reference (fp32's naive greedy loop on the same ids)
    acceptance                     per prompt class: drafts that stood / drafts, and the tokens a
                                   window gave ((kept + windows) / windows: each window also gives
                                   the verifier's own token)
    sampled                        a two-sample chi-square test per answer position of the token's
                                   distribution, verified against fp32 alone (tokens drawn >= 5
                                   times over both binned, the rest pooled into one bin; the p-value
                                   from the regularised upper incomplete gamma function)
The targets (issue 21) are fixed in TARGETS before any run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from qladder.percentiles import ratio
from qladder.validate.outcome import Outcome

TARGETS = {"verified_over_fp32_c1": 2.5, "verified_over_vllm_fp32_c8": 1.0, "fp32_c8_over_c1": 3.0,
           "exactness": 1.0, "sampled_min_p": 0.001, "audit_cost_c8": 0.03}


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
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if df > 0 else 1.0
    return {"statistic": stat, "df": df, "p": p, "bins": len(cols), "n": [len(a), len(b)]}


def verified_figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    from qladder.validate.recompute import _by, _verdict, load_cell

    greedy = [o for o in outcomes if o.phase == "greedy"]
    slowest = max((o.latency_ms for o in greedy), default=0.0)
    results = {c: {str(int(k)): load_cell(v, slowest) for k, v in
                   sorted(_by([x for x in greedy if x.config == c], lambda x: f"{x.concurrency:04d}").items())}
               for c in sorted({o.config for o in greedy})}

    def tok(config: str, c: str) -> float | None:
        v = results.get(config, {}).get(c, {}).get("tok_s")
        return None if v is None else float(v)

    ratios = {"verified_over_fp32_c1": ratio(tok("verified", "1"), tok("fp32", "1")),
              "verified_over_fp32_c8": ratio(tok("verified", "8"), tok("fp32", "8")),
              "verified_over_vllm_fp32_c1": ratio(tok("verified", "1"), tok("vllm-fp32", "1")),
              "verified_over_vllm_fp32_c8": ratio(tok("verified", "8"), tok("vllm-fp32", "8")),
              "fp32_c8_over_c1": ratio(tok("fp32", "8"), tok("fp32", "1")),
              "verified_c8_over_c1": ratio(tok("verified", "8"), tok("verified", "1")),
              "verified_over_int4_c1": ratio(tok("verified", "1"), tok("int4", "1")),
              "drafting_over_fp32_c1": ratio(tok("verified-drafting", "1"), tok("fp32", "1")),
              "drafting_over_fp32_c8": ratio(tok("verified-drafting", "8"), tok("fp32", "8")),
              "int4_audit_over_int4_c8": ratio(tok("int4-audit", "8"), tok("int4", "8"))}
    ref = {o.prompt_id: o.token_ids for o in outcomes if o.phase == "reference"}
    verified = [o for o in greedy if o.config in ("verified", "verified-drafting")]
    same = [o for o in verified if o.ok and o.token_ids == ref.get(o.prompt_id)]
    fp32_same = [o for o in greedy if o.config == "fp32" and o.ok and o.token_ids == ref.get(o.prompt_id)]
    vllm = [o for o in greedy if o.config == "vllm-fp32"]
    share = len(same) / len(verified) if verified else None
    exactness = {"verified_identical": len(same), "verified": len(verified),
                 "share": share,
                 "differ": sorted({o.prompt_id for o in verified if o not in same}),
                 "fp32_alone_identical": [len(fp32_same), sum(o.config == "fp32" for o in greedy)],
                 "vllm_identical": [sum(o.ok and o.token_ids == ref.get(o.prompt_id) for o in vllm), len(vllm)]}
    acceptance: dict[str, Any] = {}
    for cls, group in sorted(_by([o for o in verified if o.verify_windows], lambda o: o.prompt_class).items()):
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
    t = TARGETS
    kept_share = ratios["int4_audit_over_int4_c8"]
    audit_cost = None if kept_share is None else 1.0 - kept_share
    five_xx = sum(o.five_xx for o in greedy)
    verdicts = [
        _verdict("verified / fp32 alone, tok/s at c1", ratios["verified_over_fp32_c1"], t["verified_over_fp32_c1"],
                 lambda v: v >= t["verified_over_fp32_c1"], f"c8: {ratios['verified_over_fp32_c8']}"),
        _verdict("verified / vLLM fp32, tok/s at c8", ratios["verified_over_vllm_fp32_c8"],
                 t["verified_over_vllm_fp32_c8"], lambda v: v >= t["verified_over_vllm_fp32_c8"],
                 f"c1: {ratios['verified_over_vllm_fp32_c1']}"),
        _verdict("batched fp32 alone, tok/s c8 / c1", ratios["fp32_c8_over_c1"], t["fp32_c8_over_c1"],
                 lambda v: v >= t["fp32_c8_over_c1"]),
        _verdict("greedy verified answers identical to fp32's greedy answers", share, t["exactness"],
                 lambda v: v >= t["exactness"], f"{len(same)} of {len(verified)}"),
        _verdict("sampled: smallest p of the per-position chi-square tests, verified vs fp32", min_p,
                 t["sampled_min_p"], lambda v: v >= t["sampled_min_p"], f"{len(sv)} and {len(sf)} answers"),
        _verdict("drift audit at rate 0.1: INT4 tok/s lost at c8", audit_cost, t["audit_cost_c8"],
                 lambda v: v <= t["audit_cost_c8"], f"int4-audit / int4 = {ratios['int4_audit_over_int4_c8']}"),
        _verdict("requests without an answer (5xx)", five_xx, 0, lambda v: v == 0),
    ]
    return {"mode": "bench-verified", "targets": dict(TARGETS), "results": results, "ratios": ratios,
            "exactness": exactness, "acceptance": acceptance, "sampled": sampled, "verdicts": verdicts,
            "verdict": "pass" if all(v["status"] == "pass" for v in verdicts) else "fail"}
