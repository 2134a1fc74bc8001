"""The prompt cache's policy (serving/prompt_states.py): exact prompts, least recently used out
within its bytes, unmonitored entries useless to a monitored request."""

from __future__ import annotations

import numpy as np
import pytest

from qladder.serving.prompt_states import PromptState, PromptStates


def _entry(n: int, peaks: bool = True) -> PromptState:
    p = np.zeros(4, np.float32) if peaks else None
    return PromptState(np.zeros(n, np.uint8), p, p.copy() if p is not None else None)


def test_least_recently_used_leave_within_the_budget():
    c = PromptStates(budget_bytes=3 * (100 + 32))
    for k in range(3):
        c.put((k, 1), _entry(100))
    assert len(c) == 3 and c.bytes == 3 * 132
    assert c.get((0, 1), True) is not None  # (0, 1) is now the most recent
    c.put((3, 1), _entry(100))
    assert c.evictions == 1 and c.get((1, 1), True) is None  # the least recent left
    assert c.get((0, 1), True) is not None and c.get((3, 1), True) is not None
    assert (c.hits, c.misses) == (3, 1)
    assert c.get((0,), True) is None and c.get((0, 1, 2), True) is None  # exact prompts only


def test_a_replaced_entry_counts_once_and_a_huge_one_is_not_kept():
    c = PromptStates(budget_bytes=1000)
    c.put((1, 2), _entry(100))
    c.put((1, 2), _entry(200))
    assert len(c) == 1 and c.bytes == 232
    c.put((5, 6), _entry(2000))
    assert len(c) == 1 and c.get((5, 6), False) is None


def test_an_unmonitored_entry_is_a_miss_for_a_monitored_request():
    c = PromptStates(budget_bytes=1 << 20)
    c.put((1, 2), _entry(10, peaks=False))
    assert c.get((1, 2), True) is None
    assert c.get((1, 2), False) is not None


def test_off_keeps_nothing_and_a_negative_budget_is_refused():
    c = PromptStates(0)
    assert not c.enabled
    c.put((1, 2), _entry(1))
    assert len(c) == 0
    with pytest.raises(ValueError):
        PromptStates(-1)
