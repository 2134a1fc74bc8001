"""Repetition loops: the generated tail repeats with a period in [min, max] at least N times.

The shape of vLLM's `repetition_detection`. Cheap enough for every step: a period p is only
examined when the last token equals the token p positions back, a plain int comparison.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_repetition(
    ids: Sequence[int], min_period: int, max_period: int, min_repeats: int, min_span: int = 0
) -> int | None:
    """The smallest period p in [min_period, max_period] such that the tail of ids is one p-token
    pattern repeated max(min_repeats, ceil(min_span / p)) times; None when there is none."""
    n = len(ids)
    if n < 2:
        return None
    last = ids[-1]
    for p in range(max(min_period, 1), min(max_period, n - 1) + 1):
        if ids[-1 - p] != last:
            continue
        span = p * max(min_repeats, -(-min_span // p))
        if span > n:
            continue
        tail = ids[n - span :]
        if tail[p:] == tail[:-p]:  # periodic with period p over the whole span
            return p
    return None


def loop_start(ids: Sequence[int], period: int) -> int:
    """Where the longest period-p tail of ids begins: ids[start:] repeats one p-token pattern."""
    n = len(ids)
    if period < 1 or n <= period:
        return 0 if period >= 1 else n
    i = n - period - 1
    while i >= 0 and ids[i] == ids[i + period]:
        i -= 1
    return i + 1
