"""The report's PNG plots, drawn with matplotlib's Agg backend (no display needed).

Each function takes the results dictionary and a path, draws one figure and returns the path, or
None when the data for it is missing. `available()` says whether matplotlib is installed; without
it the report is written with its tables only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"bare": "#c0392b", "bare_aa": "#e59866", "guarded": "#2471a3", "int4": "#d35400", "w4a16": "#8e44ad",
          "fp32": "#117a65"}


def available() -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        return True
    except ImportError:
        return False


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 110})
    return plt


def replay(figures: dict[str, Any], path: Path) -> Path | None:
    """Per fault model, bare vs guarded on crafted prompts: the share of garbage, fallback and 5xx
    answers (stacked; the rest answered clean)."""
    by = figures["by_fault"]
    faults = sorted(set(by.get("bare", {})) | set(by.get("guarded", {})))
    if not faults:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(9, 0.55 * len(faults)), 4.4))
    width = 0.38
    for k, cfg in enumerate(("bare", "guarded")):
        bf = by.get(cfg, {})
        xs = [i + (k - 0.5) * width for i in range(len(faults))]
        bottom = [0.0] * len(faults)
        stacks = (("garbage_rate", 1.0, None), ("fallback_rate", 0.6, ".."), ("five_xx_rate", 0.45, "//"))
        for key, alpha, hatch in stacks:
            vals = [(bf.get(f) or {}).get(key) or 0.0 for f in faults]
            ax.bar(xs, vals, width, bottom=bottom, color=COLORS[cfg], alpha=alpha, hatch=hatch,
                   label=f"{cfg}: {key.removesuffix('_rate').replace('_', ' ')}")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            ax.text(x, total + 0.02, f"{total:.0%}", ha="center", fontsize=6, color=COLORS[cfg])
    counts = [(by.get("bare", {}).get(f) or by.get("guarded", {}).get(f) or {}).get("requests", 0) for f in faults]
    ax.set_xticks(range(len(faults)), [f"{f}\n(n={n})" for f, n in zip(faults, counts, strict=True)], fontsize=6,
                  rotation=30, ha="right")
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("share of requests")
    ax.set_title("Crafted prompts: answers that were not clean, per fault model")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_cdf(walls: dict[str, list[float]], path: Path) -> Path | None:
    """Empirical CDF of per-request latency on normal prompts."""
    if not any(walls.values()):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for cfg, xs in walls.items():
        xs = sorted(xs)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=COLORS[cfg], label=cfg)
    ax.set_xlabel("request latency (ms), normal prompts")
    ax.set_ylabel("share of requests")
    ax.set_title("Latency, bare vs guarded (same prompts, interleaved)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


STATES = (("ok", "#a9dfbf"), ("flagged early", "#aed6f1"), ("broken, caught", "#f8c471"),
          ("broken, missed", "#e74c3c"))


def _state(row: dict[str, Any]) -> int:
    """Worst state of a (rung, x) cell: 0 ok, 1 guard fired before anything broke, 2 broke and was
    caught in time, 3 broke unseen (or too late)."""
    broken = max(row["nonfinite_rate"], row["diverged_fault_rate"]) > 0
    if not broken:
        return 1 if row["detection_rate"] > 0 else 0
    caught = row["broken_caught_rate"]
    return 2 if caught is not None and caught >= 1.0 else 3


def precision(results: dict[str, Any], path: Path) -> Path | None:
    pb = results.get("precision_boundary") or {}
    rows = pb.get("summary") or []
    if not rows:
        return None
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.9), gridspec_kw={"width_ratios": [1, 1.15]})
    styles = {"int4": ("s", "-", 9), "w4a16": ("o", "--", 6), "fp32": ("^", ":", 4)}
    for rung in ("int4", "w4a16", "fp32"):
        pts = [(r["x"], r["peak_max"]) for r in rows if r["rung"] == rung and r["peak_max"] is not None]
        finite = [(x, p) for x, p in pts if p != float("inf")]
        if finite:
            marker, ls, size = styles[rung]
            a1.plot(*zip(*finite, strict=True), marker=marker, ls=ls, ms=size, color=COLORS[rung], label=rung)
        over = [x for x, p in pts if p == float("inf")]
        if over:
            a1.scatter(over, [1.15e5] * len(over), marker="x", s=60, color=COLORS[rung],
                       label=f"{rung}: overflow (inf/NaN)")
    a1.axhline(65504, color="k", ls="--", lw=1, label="fp16 max 65,504")
    a1.axhline(0.6 * 65504, color="gray", ls=":", lw=1, label="guard limit, 60% of fp16")
    a1.set_xlabel("gain x on layer 11, channel 507")
    a1.set_ylabel("largest per-layer |hidden|")
    a1.set_title("Peak activation against the fp16 limit")
    a1.legend(fontsize=7, loc="upper left")
    rungs = [r for r in ("int4", "w4a16", "fp32") if any(x["rung"] == r for x in rows)]
    xs = sorted({r["x"] for r in rows})
    grid = [[next((_state(r) for r in rows if r["rung"] == rung and r["x"] == x), 0) for x in xs] for rung in rungs]
    a2.imshow(grid, cmap=ListedColormap([c for _, c in STATES]), vmin=-0.5, vmax=3.5, aspect="auto")
    for i, rung in enumerate(rungs):
        for j, x in enumerate(xs):
            r = next(r for r in rows if r["rung"] == rung and r["x"] == x)
            a2.text(j, i, f"NaN {r['nonfinite_rate']:.0%}\ndiv {r['diverged_fault_rate']:.0%}\n"
                          f"guard {r['detection_rate']:.0%}", ha="center", va="center", fontsize=7)
    a2.set_xticks(range(len(xs)), [f"x={x:g}" for x in xs])
    a2.set_yticks(range(len(rungs)), rungs)
    a2.grid(False)
    a2.set_title("Where each rung breaks, and whether its guard sees it")
    a2.legend(handles=[Patch(color=c, label=n) for n, c in STATES], fontsize=7, ncol=4,
              loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_levels(results: dict[str, Any], path: Path) -> Path | None:
    levels = (results.get("latency_boundary") or {}).get("levels") or {}
    if not levels:
        return None
    plt = _plt()
    names = list(levels)
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.38
    for k, (key, label) in enumerate((("paired_median_ratio", "per request, paired median"),
                                      ("step_p50_ratio", "per decode step, p50"))):
        vals = [levels[n].get(key) or 0 for n in names]
        ax.bar([i + (k - 0.5) * width for i in range(len(names))], vals, width, label=label,
               color=("#5d6d7e", "#48c9b0")[k])
    ax.axhline(1.0, color="k", lw=1)
    ax.axhline(1.01, color="#c0392b", ls="--", lw=1, label="+1% target")
    aa = levels.get("bare (A/A control)", {}).get("paired_median_ratio")
    if aa is not None:
        floor = abs(aa - 1.0)
        ax.axhspan(1.0 - floor, 1.0 + floor, color="gray", alpha=0.2, label="noise floor (A/A)")
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right")
    lo = min(min((levels[n].get("paired_median_ratio") or 1) for n in names), 0.95)
    hi = max(max((levels[n].get("paired_median_ratio") or 1) for n in names), 1.05)
    ax.set_ylim(lo - 0.02, hi + 0.05)
    ax.set_ylabel("latency / bare int4")
    ax.set_title("Latency boundary: cost of each check level (int4 rung)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def availability(results: dict[str, Any], path: Path) -> Path | None:
    av = results.get("availability_boundary") or {}
    curve = av.get("curve")
    if not curve:
        return None
    plt = _plt()
    fig, a1 = plt.subplots(figsize=(7.5, 3.6))
    shares = [p["share"] * 100 for p in curve]
    a1.plot(shares, [p["utilization"] for p in curve], color="#2471a3", label="standby utilization")
    a1.set_xlabel("share of requests that hand off to the standby (%)")
    a1.set_ylabel("standby utilization")
    a1.set_ylim(0, 1.05)
    a2 = a1.twinx()
    waits = [(x, p["wait_ms"]) for x, p in zip(shares, curve, strict=True) if p["wait_ms"] > 0]
    if waits:
        a2.plot(*zip(*waits, strict=True), color="#c0392b", label="mean wait (M/M/c)")
    a2.set_yscale("log")
    sims = av.get("simulation") or []
    a2.scatter([s["share"] * 100 for s in sims], [s["simulated_wait_ms"] for s in sims], color="#c0392b",
               marker="D", label="simulated (M/G/c, measured service)")
    a2.set_ylabel("mean standby queueing wait (ms)")
    a2.grid(False)
    star = av["model"]["saturation_share"] * 100
    a1.axvline(star, color="k", ls="--", lw=1)
    a1.text(star, 0.5, f"saturates at {star:.1f}% ", fontsize=8, ha="right", rotation=90, va="center")
    m = av["model"]
    a1.set_title(f"Availability boundary: {m['c_standby']} standby of {m['servers']} workers, "
                 f"int4 pool at {m['primary_util']:.0%}")
    h1, l1 = a1.get_legend_handles_labels()
    h2, l2 = a2.get_legend_handles_labels()
    a1.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
