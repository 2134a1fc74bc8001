"""The INT4 pool's prompt cache: a prompt's KV state, kept in host memory after its prefill, so
that the same prompt again (a retry, a health check, an eval replayed, a fixed few-shot prompt)
is restored instead of prefilled. llama-server does the same by default (`--cache-ram`, 8 GiB).

An entry is what the prefill of the prompt `key` left: the slot's sequence state
(`llama_state_seq_get_data`, every position of the prompt) and, when the prefill was monitored,
its per-layer peaks. On a hit the scheduler restores the state less the prompt's last position and
decodes that last token in the next batch with the other slots' rows, its peaks carried on: the
request's first row is then the one a full prefill gives (bit-identical here: measured, and
tests/test_serving.py checks the answers), and its guard judges the same peaks. A prefill of N
tokens costs about what N batch rows do (~2.5 ms a token here), so a hit saves the prompt's
whole prefill but one row.

Exact prompts only: an entry serves a request whose whole prompt (the token ids it prefills,
the chat template's included) equals its key. Least recently used entries leave when the bytes
held pass `budget_bytes`. Faulted requests are never stored nor restored (their prefill runs
through the faults), nor are requests coming back from a handoff.

Thread ownership: the scheduler's thread only (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptState:
    state: np.ndarray  # (uint8) the slot's sequence state after the prompt's prefill (every position)
    peaks: np.ndarray | None  # (L,) per-layer max |hidden| over the prompt, if the prefill was monitored
    rest: np.ndarray | None  # the same away from position 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (self.peaks.nbytes if self.peaks is not None else 0) \
            + (self.rest.nbytes if self.rest is not None else 0)


class PromptStates:
    """Prompt token ids -> PromptState, least recently used first out, within `budget_bytes`
    (0: nothing is kept)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], PromptState] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def get(self, key: tuple[int, ...], monitored: bool) -> PromptState | None:
        """The entry for this exact prompt, if any, and usable: a request whose guard checks
        activations needs the entry's peaks (an entry stored from an unmonitored prefill is a
        miss for it)."""
        e = self._entries.get(key)
        if e is None or (monitored and e.peaks is None):
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: tuple[int, ...], entry: PromptState) -> None:
        """Keep `entry` for `key` (replacing one there), then drop the least recently used
        entries until the budget holds; an entry larger than the whole budget is not kept."""
        if entry.nbytes > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.budget_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evictions += 1
