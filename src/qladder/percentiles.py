"""The one percentile definition every report and benchmark uses."""

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
