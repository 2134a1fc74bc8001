"""Ratio verdicts with an interval: the one place a ratio figure is turned into pass, fail or inconclusive.

A ratio read off one noisy run (a median of three rounds, a pooled P99) passes or fails on noise. So
every ratio verdict here is a point value with a percentile bootstrap interval (scipy.stats.bootstrap,
BOOTSTRAP resamples, a fixed seed, so recompute gets the same interval from the same outcomes), and:

    pass          the whole interval is on the target's good side
    fail          the whole interval is on the wrong side
    inconclusive  the interval straddles the target: the data cannot tell (a longer run can)

Two resampling units:

    paired_mean_ratio   per unit (a prompt, a round of interleaved windows), one value for each
                        side; resample units, the ratio of the two sides' sums. Latency: a
                        prompt's median latency over its rounds, guarded and bare.
    window_rate_ratio   closed-loop windows, each tokens over span: resample each side's windows
                        (paired by round where both sides ran in the same round: the interleaved
                        design), the ratio of pooled rates (the windows' tokens over their spans).

A latency verdict also needs its A/A (two identical configurations measured the same way) to
contain 1: an A/A whose interval excludes 1 says the measurement itself is biased, and the
verdict is inconclusive whatever the candidate reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import bootstrap

BOOTSTRAP = 2000
CONFIDENCE = 0.95
SEED = 20261206
MIN_WINDOWS = 6  # per side, for a throughput verdict


@dataclass(frozen=True)
class Interval:
    value: float | None  # the point estimate (all units)
    low: float | None
    high: float | None
    units: int  # what was resampled: prompts, rounds or windows per side
    unit: str
    method: str

    def contains(self, x: float) -> bool:
        return self.low is not None and self.high is not None and self.low <= x <= self.high

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _interval(data: tuple[np.ndarray, ...], stat: Callable[..., np.ndarray], paired: bool,
              seed: int) -> tuple[float | None, float | None]:
    """scipy's percentile bootstrap (a fixed seed: the same outcomes give the same interval)."""
    if min(len(d) for d in data) < 2:
        return None, None
    with np.errstate(divide="ignore", invalid="ignore"):
        ci = bootstrap(data, stat, paired=paired, vectorized=True, n_resamples=BOOTSTRAP, method="percentile",
                       confidence_level=CONFIDENCE, rng=np.random.default_rng(seed)).confidence_interval
    lo, hi = float(ci.low), float(ci.high)
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else (None, None)


def paired_mean_ratio(pairs: Sequence[tuple[float, float]], unit: str = "prompts", seed: int = SEED) -> Interval:
    """sum(a) / sum(b) over units (a, b), with its bootstrap over units."""
    a = np.array([x for x, _ in pairs], dtype=float)
    b = np.array([y for _, y in pairs], dtype=float)

    def stat(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(x.sum(axis=axis) / y.sum(axis=axis))

    value = float(a.sum() / b.sum()) if len(pairs) and b.sum() > 0 else None
    low, high = _interval((a, b), stat, True, seed)
    return Interval(value, low, high, len(pairs), unit, "paired percentile bootstrap (scipy) of the ratio of "
                    f"sums, {BOOTSTRAP} resamples, {CONFIDENCE:.0%}")


Window = tuple[str, float, float]  # (round, tokens, span seconds)


def _rate(ws: Sequence[Window]) -> float | None:
    span = sum(s for _, _, s in ws)
    return sum(t for _, t, _ in ws) / span if span > 0 else None


def window_rate_ratio(a: Sequence[Window], b: Sequence[Window], seed: int = SEED) -> Interval:
    """Pooled tok/s of windows `a` over windows `b` (each side's tokens over its spans), resampling
    rounds where every round has both sides (interleaved), each side's windows on their own
    otherwise."""
    ra, rb = _rate(a), _rate(b)
    value = ra / rb if ra is not None and rb else None
    n = min(len(a), len(b))
    if a and {r for r, _, _ in a} == {r for r, _, _ in b}:
        keys = sorted({r for r, _, _ in a})
        def per_round(side: Sequence[Window]) -> list[np.ndarray]:  # its tokens, its spans, a round each
            return [np.array([sum(t for r, t, _ in side if r == k) for k in keys], dtype=float),
                    np.array([sum(sp for r, _, sp in side if r == k) for k in keys], dtype=float)]

        cols = [*per_round(a), *per_round(b)]

        def paired(ta: np.ndarray, sa: np.ndarray, tb: np.ndarray, sb: np.ndarray, axis: int = -1) -> np.ndarray:
            return np.asarray((ta.sum(axis=axis) / sa.sum(axis=axis)) / (tb.sum(axis=axis) / sb.sum(axis=axis)))

        low, high = _interval(tuple(cols), paired, True, seed)
        return Interval(value, low, high, n, "windows per side, resampled by round (interleaved)",
                        f"paired percentile bootstrap (scipy) over rounds of the ratio of pooled rates, "
                        f"{BOOTSTRAP} resamples, {CONFIDENCE:.0%}")
    ta, sa = np.array([w[1] for w in a], dtype=float), np.array([w[2] for w in a], dtype=float)
    tb, sb = np.array([w[1] for w in b], dtype=float), np.array([w[2] for w in b], dtype=float)

    def apart(ia: np.ndarray, ib: np.ndarray, axis: int = -1) -> np.ndarray:
        i, j = ia.astype(int), ib.astype(int)
        return np.asarray((ta[i].sum(axis=axis) / sa[i].sum(axis=axis)) / (tb[j].sum(axis=axis) / sb[j].sum(axis=axis)))

    low, high = _interval((np.arange(len(a), dtype=float), np.arange(len(b), dtype=float)), apart, False, seed)
    return Interval(value, low, high, n, "windows per side, resampled per side (not interleaved)",
                    f"percentile bootstrap (scipy) of each side's windows, ratio of pooled rates, {BOOTSTRAP} "
                    f"resamples, {CONFIDENCE:.0%}")


def mean_interval(values: Sequence[float], unit: str = "answers", seed: int = SEED) -> Interval:
    """The mean of per-unit values (an answer's top-1 agreement), with its bootstrap over units."""
    x = np.array(values, dtype=float)

    def stat(v: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(v.mean(axis=axis))

    value = float(x.mean()) if len(x) else None
    low, high = _interval((x,), stat, False, seed)
    if value is not None and low is None and len(x) >= 2 and np.all(x == x[0]):  # all the same: no spread
        low = high = value
    return Interval(value, low, high, len(x), unit, f"percentile bootstrap (scipy) of the mean, {BOOTSTRAP} "
                    f"resamples, {CONFIDENCE:.0%}")


def rate_interval(k: int, n: int, unit: str = "answers") -> Interval:
    """k of n (a garbage rate), with the Wilson score interval (scipy.stats.binomtest)."""
    from scipy.stats import binomtest

    if n == 0:
        return Interval(None, None, None, 0, unit, "Wilson score interval")
    ci = binomtest(k, n).proportion_ci(confidence_level=CONFIDENCE, method="wilson")
    return Interval(k / n, float(ci.low), float(ci.high), n, unit, f"Wilson score interval (scipy), {CONFIDENCE:.0%}")


def status(iv: Interval, limit: float, higher_is_better: bool, min_units: int = 2) -> str:
    """pass, fail or inconclusive (no data: nothing to judge)."""
    if iv.value is None:
        return "no data"
    if iv.low is None or iv.high is None or iv.units < min_units:
        return "inconclusive"
    if higher_is_better:
        return "pass" if iv.low >= limit else "fail" if iv.high < limit else "inconclusive"
    return "pass" if iv.high <= limit else "fail" if iv.low > limit else "inconclusive"


def verdict(name: str, iv: Interval, limit: float, higher_is_better: bool, note: str = "",
            aa: Interval | None = None, min_units: int = 2) -> dict[str, Any]:
    """A ratio verdict with its interval (and its A/A, which must contain 1 where one is given)."""
    st = status(iv, limit, higher_is_better, min_units)
    if iv.value is not None and iv.units < min_units:
        note = f"{note}; {iv.units} {iv.unit} (needs {min_units})".lstrip("; ")
    if aa is not None:
        note = f"{note}; A/A {fmt(aa)}".lstrip("; ")
        if st in ("pass", "fail") and not aa.contains(1.0):
            st, note = "inconclusive", f"{note}: the A/A interval excludes 1"
    return {"name": name, "value": iv.value, "interval": [iv.low, iv.high], "limit": limit, "status": st,
            "note": note, "units": iv.units, "method": iv.method}


def fmt(iv: Interval) -> str:
    if iv.value is None:
        return "no data"
    if iv.low is None or iv.high is None:
        return f"{iv.value:.3f} [no interval]"
    return f"{iv.value:.3f} [{iv.low:.3f}, {iv.high:.3f}]"
