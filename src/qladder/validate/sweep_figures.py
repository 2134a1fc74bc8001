"""Every figure of a `qladder sweep`, computed from its outcomes.jsonl (and levels.json: what each
level's file holds); `python -m qladder.validate.sweep_figures DIR` computes them again and exits 1
when they differ from the folder's results.json.

Per level, class group and half (train, test, all):
    top1_agreement   bare answers: the mean share of positions where the level's token is fp32's
                     argmax, teacher-forced on the level's own answer (the audit's score), with a
                     bootstrap interval over answers
    identical        bare answers equal to fp32's own greedy answer (garbage.same_answer), Wilson
    kl_top5          the audit's KL estimate over the level's top 5, mean with its interval
    bare_garbage     bare answers the judge calls garbage, or that got no answer, Wilson
    guarded_bad      guarded answers that are garbage, stopped by the guard, the fallback or no
                     answer (each counts against the guard), Wilson; guarded_garbage and
                     guarded_stopped apart; hazards: guarded answers with a hazard
Per level and concurrency: pooled tokens/s of its closed-loop windows (each window's tokens over
its span), and its ratio to the reference level's with the interleaved windows' bootstrap.

The recommendation, its rule fixed before any run: the bound is the reference level's (Q8_0)
interval on the train half, its low end for agreement and its high end for garbage, unless the
user set one (`min_agreement`, `max_garbage`); a level is within the bound on a class when its
test-half interval lies wholly on the bound's good side, outside when wholly on the other, and
inconclusive otherwise or with fewer than MIN_ANSWERS answers on either side of the comparison;
the recommendation is the level of fewest bits per weight within the bound on every class, or none.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qladder.validate.corpora import NORMAL_CLASSES
from qladder.validate.intervals import Interval, mean_interval, rate_interval, window_rate_ratio
from qladder.validate.outcome import Outcome, read_jsonl

GROUPS: dict[str, tuple[str, ...]] = {"normal": NORMAL_CLASSES, "long_math": ("long_math",), "code": ("code_block",),
                                      "unicode": ("unicode_zero_width_bidi_homoglyph",),
                                      "raw_bytes": ("control_bytes",)}
SPLITS = ("train", "test", "all")
MIN_ANSWERS = 5  # per class and half, for a verdict against the bound (fewer: inconclusive)


def group_of(prompt_class: str) -> str | None:
    return next((g for g, classes in GROUPS.items() if prompt_class in classes), None)


def _iv(iv: Interval) -> dict[str, Any]:
    return {"value": iv.value, "low": iv.low, "high": iv.high, "n": iv.units}


def _rows(outcomes: Sequence[Outcome], level: str, config: str, group: str, split: str) -> list[Outcome]:
    return [o for o in outcomes if o.level == level and o.config == config and o.phase == "sweep"
            and group_of(o.prompt_class) == group and (split == "all" or o.split == split)]


def quality(outcomes: Sequence[Outcome], level: str, group: str, split: str) -> dict[str, Any]:
    bare = _rows(outcomes, level, "bare", group, split)
    guarded = _rows(outcomes, level, "guarded", group, split)
    agree = [o.fp32_top1_agreement for o in bare if o.fp32_top1_agreement is not None]
    kl = [o.kl_top5 for o in bare if o.kl_top5 is not None and math.isfinite(o.kl_top5)]
    refs = [o for o in bare if o.ok and o.fp32_reference_ids is not None]
    return {
        "bare_answers": len(bare), "guarded_answers": len(guarded),
        "top1_agreement": _iv(mean_interval(agree)),
        "identical": _iv(rate_interval(sum(o.identical is True for o in refs), len(refs))),
        "kl_top5": _iv(mean_interval(kl)),
        "bare_garbage": _iv(rate_interval(sum(o.garbage or not o.ok for o in bare), len(bare))),
        "guarded_garbage": _iv(rate_interval(sum(o.garbage for o in guarded), len(guarded))),
        "guarded_stopped": _iv(rate_interval(sum(o.stopped for o in guarded), len(guarded))),
        "guarded_bad": _iv(rate_interval(sum(o.bad or o.fallback or not o.ok for o in guarded), len(guarded))),
        "hazards": _iv(rate_interval(sum(bool(o.hazards) for o in guarded), len(guarded))),
        "unjudged": sum(o.unjudged for o in [*bare, *guarded]),
    }


def windows(outcomes: Sequence[Outcome], level: str, concurrency: int) -> list[tuple[str, float, float]]:
    """(round, tokens, span s) of each closed-loop window of one level at one concurrency."""
    by: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.phase == "throughput" and o.level == level and o.concurrency == concurrency and o.window:
            by.setdefault(o.window, []).append(o)
    out = []
    for w, os_ in sorted(by.items()):
        start = min(o.start_s or 0.0 for o in os_)
        end = max(o.end_s or 0.0 for o in os_)
        out.append((w, float(sum(o.tokens for o in os_ if o.ok)), end - start))
    return out


def throughput(outcomes: Sequence[Outcome], levels: Sequence[str], reference: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in levels:
        out[level] = {}
        for c in (1, 8):
            ws = windows(outcomes, level, c)
            span = sum(s for _, _, s in ws)
            ratio = window_rate_ratio(ws, windows(outcomes, reference, c))
            out[level][f"c{c}"] = {"tokens_per_s": sum(t for _, t, _ in ws) / span if span > 0 else None,
                                   "windows": len(ws), "errors": sum(
                                       1 for o in outcomes if o.phase == "throughput" and o.level == level
                                       and o.concurrency == c and not o.ok),
                                   f"ratio_to_{reference}": _iv(ratio)}
    return out


def recommendation(q: dict[str, Any], levels: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The rule in the module docstring."""
    ref = cfg["reference_level"]
    bounds: dict[str, dict[str, float | None]] = {}
    for g in GROUPS:
        r = q[ref][g]["train"]
        bounds[g] = {"min_agreement": cfg.get("min_agreement") if cfg.get("min_agreement") is not None
                     else r["top1_agreement"]["low"],
                     "max_garbage": cfg.get("max_garbage") if cfg.get("max_garbage") is not None
                     else r["bare_garbage"]["high"]}
    user_set = cfg.get("min_agreement") is not None and cfg.get("max_garbage") is not None
    verdicts: dict[str, dict[str, str]] = {}
    for level in q:
        verdicts[level] = {}
        for g in GROUPS:
            t, b = q[level][g]["test"], bounds[g]
            if t["bare_answers"] < MIN_ANSWERS or (not user_set and q[ref][g]["train"]["bare_answers"] < MIN_ANSWERS):
                verdicts[level][g] = "inconclusive"  # too few answers for an interval to mean anything
                continue
            a_lo, a_hi = t["top1_agreement"]["low"], t["top1_agreement"]["high"]
            g_lo, g_hi = t["bare_garbage"]["low"], t["bare_garbage"]["high"]
            if None in (a_lo, a_hi, g_lo, g_hi, b["min_agreement"], b["max_garbage"]):
                verdicts[level][g] = "no data"
            elif a_lo >= b["min_agreement"] and g_hi <= b["max_garbage"]:
                verdicts[level][g] = "within"
            elif a_hi < b["min_agreement"] or g_lo > b["max_garbage"]:
                verdicts[level][g] = "outside"
            else:
                verdicts[level][g] = "inconclusive"
    order = sorted(q, key=lambda lv: levels[lv]["bits_per_weight"])
    chosen = next((lv for lv in order if all(v == "within" for v in verdicts[lv].values())), None)
    source = "set by the user" if cfg.get("min_agreement") is not None or cfg.get("max_garbage") is not None \
        else f"{ref}'s train-half intervals (agreement: low end; garbage: high end)"
    return {"level": chosen, "bits_per_weight": levels[chosen]["bits_per_weight"] if chosen else None,
            "bounds": bounds, "bounds_from": source, "verdicts": verdicts,
            "rule": "the fewest bits per weight whose test-half interval is wholly within the bound on every class"}


def figures(outcomes: Sequence[Outcome], levels: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    names = [lv for lv in cfg["levels"] if lv in levels]
    q = {lv: {g: {s: quality(outcomes, lv, g, s) for s in SPLITS} for g in GROUPS} for lv in names}
    return {"quality": q, "throughput": throughput(outcomes, names, cfg["reference_level"]),
            "recommendation": recommendation(q, levels, cfg),
            "counts": {"outcomes": len(outcomes), "errors": sum(not o.ok for o in outcomes)}}


# -- the report ---------------------------------------------------------------------------------

def _f(x: float | None, d: int = 3) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _civ(iv: dict[str, Any], d: int = 3) -> str:
    if iv["value"] is None:
        return "-"
    if iv["low"] is None:
        return f"{iv['value']:.{d}f}"
    return f"{iv['value']:.{d}f} [{iv['low']:.{d}f}, {iv['high']:.{d}f}]"


def report_md(results: dict[str, Any]) -> str:
    fig, levels, cfg = results["figures"], results["levels"], results["config"]
    ref = cfg["reference_level"]
    order = sorted(fig["quality"], key=lambda lv: levels[lv]["bits_per_weight"])
    rec = fig["recommendation"]
    lines = [f"# qladder sweep: {Path(results['model']).name}", "",
             f"Levels made by llama.cpp's quantizer from {Path(results['source']['path']).name} "
             f"({results['source']['bits_per_weight']:.2f} bits per weight). Threads "
             f"{results['environment'].get('engine_threads')}, {results['elapsed_s']:.0f} s.", ""]
    dq = results["source"].get("dequantized_from")
    if dq:
        lines += [f"The full-precision weights here are the model's {dq} dequantized (the fp32 rung's): a {dq} "
                  f"level re-quantizes them to nearly the same values, so its distance from full precision is "
                  f"near zero by construction, and every other level is measured against {dq}'s values. A "
                  f"model with its own F16/F32 weights (`--model`) has no such level.", ""]
    if rec["level"]:
        lines.append(f"**Recommendation: {rec['level']}** ({rec['bits_per_weight']:.2f} bits per weight): "
                     f"{rec['rule']}; bounds from {rec['bounds_from']}.")
    else:
        lines.append(f"**Recommendation: none**: no level is within the bound on every class at this run's size "
                     f"({rec['rule']}; bounds from {rec['bounds_from']}); a longer run narrows the intervals.")
    lines += ["", "| level | bits/weight | MB | tensor types | c1 tok/s | c8 tok/s | c8 vs " + ref + " | RSS MB |",
              "|---|---|---|---|---|---|---|---|"]
    for lv in order:
        m, t = levels[lv], fig["throughput"][lv]
        types = ", ".join(f"{k} {v}" for k, v in sorted(m["tensor_types"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {lv} | {m['bits_per_weight']:.2f} | {m['size_mb']:.0f} | {types} | "
                     f"{_f(t['c1']['tokens_per_s'], 1)} | {_f(t['c8']['tokens_per_s'], 1)} | "
                     f"{_civ(t['c8'][f'ratio_to_{ref}'])} | {_f(m.get('serving_engine_rss_mb'), 0)} |")
    lines += ["", "Test half, per class: top-1 agreement with fp32 (teacher-forced), whole-answer identity, "
              "bare garbage, guarded bad (garbage + stopped + fallback + no answer), hazards; "
              "[95% interval]; the verdict against the bound.", ""]
    for g, b in rec["bounds"].items():
        lines += [f"### {g} (bound: agreement >= {_f(b['min_agreement'])}, garbage <= {_f(b['max_garbage'])})", "",
                  "| level | n | top-1 agreement | identical | KL top-5 | bare garbage | guarded bad | hazards "
                  "| verdict |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for lv in order:
            r = fig["quality"][lv][g]["test"]
            lines.append(f"| {lv} | {r['bare_answers']} | {_civ(r['top1_agreement'])} | {_civ(r['identical'], 2)} | "
                         f"{_civ(r['kl_top5'])} | {_civ(r['bare_garbage'], 2)} | {_civ(r['guarded_bad'], 2)} | "
                         f"{_civ(r['hazards'], 2)} | {rec['verdicts'][lv][g]} |")
        lines.append("")
    lines += ["Every figure recomputes from outcomes.jsonl: `python -m qladder.validate.sweep_figures DIR`.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Agreement and garbage against bits per weight, a line per class; throughput on a second axis."""
    from qladder.validate.plots import _plt, available

    if not available():
        return None
    plt = _plt()
    fig_, levels = results["figures"], results["levels"]
    order = sorted(fig_["quality"], key=lambda lv: levels[lv]["bits_per_weight"])
    x = [levels[lv]["bits_per_weight"] for lv in order]
    f, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for g in GROUPS:
        agree = [fig_["quality"][lv][g]["all"]["top1_agreement"]["value"] for lv in order]
        garb = [fig_["quality"][lv][g]["all"]["bare_garbage"]["value"] for lv in order]
        ax1.plot(x, [math.nan if a is None else a for a in agree], marker="o", label=g)
        ax2.plot(x, [math.nan if a is None else a for a in garb], marker="s", label=g)
    for lv, xi in zip(order, x, strict=True):
        ax1.annotate(lv, (xi, 0.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="bottom")
    ax1.set(xlabel="bits per weight (measured)", ylabel="top-1 agreement with fp32 (teacher-forced)",
            title="agreement by class")
    ax2.set(xlabel="bits per weight (measured)", ylabel="bare garbage rate", title="garbage by class; throughput")
    tw = ax2.twinx()
    for c, style in (("c1", ":"), ("c8", "--")):
        tw.plot(x, [fig_["throughput"][lv][c]["tokens_per_s"] or math.nan for lv in order], style, color="gray",
                label=f"tok/s {c}")
    tw.set_ylabel("tokens/s (bare serving engine)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8, loc="upper left")
    tw.legend(fontsize=8, loc="upper right")
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)
    return path


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "report.md").write_text(report_md(results), encoding="utf-8")
    plot(results, out_dir / "boundary.png")


def recompute(folder: Path) -> dict[str, Any]:
    head = json.loads((folder / "levels.json").read_text(encoding="utf-8"))
    return figures(read_jsonl(folder / "outcomes.jsonl"), head["levels"], head["config"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qladder.validate.sweep_figures",
                                 description="Recompute a sweep's figures from its outcomes; exit 1 on a difference.")
    ap.add_argument("folder", type=Path)
    a = ap.parse_args(argv)
    again = json.loads(json.dumps(recompute(a.folder), default=str))
    stored = json.loads((a.folder / "results.json").read_text(encoding="utf-8"))["figures"]
    if again != stored:
        diff = [k for k in again if again.get(k) != stored.get(k)]
        print(f"figures differ from results.json: {diff}", file=sys.stderr)
        return 1
    rec = again["recommendation"]
    print(json.dumps({"recommendation": rec["level"], "bits_per_weight": rec["bits_per_weight"], "same": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
