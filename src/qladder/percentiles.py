"""The one percentile definition (and mean, ratio) every report and benchmark uses."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100], over the finite values;
    None when there are none."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the finite values; None when there are none."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is zero."""
    return a / b if a is not None and b else None
