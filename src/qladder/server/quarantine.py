"""Quarantine: prompts that caused a hazard on the INT4 pool start on full precision for a while.

A prompt's fingerprint is the hash of its sanitized, templated token ids (`incidents.prompt_hash`,
the same key the incident store keeps), so a repeat of an offending prompt does not pay the
handoff twice. Bounded: least recently used fingerprints leave first; each entry lives `ttl_s`.
The clock is passed in; one lock guards the table (the HTTP loop reads, the engine's threads add).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qladder.config import knob


@dataclass(frozen=True)
class QuarantineConfig:
    """Prompts that hit a hazard go straight to the standby while quarantined."""

    ttl_s: float = knob(600.0, "how long a prompt's fingerprint stays quarantined")
    max_entries: int = knob(10_000, "the most fingerprints kept (least recently used leave first)")

    def __post_init__(self) -> None:
        from qladder.errors import ConfigError

        if self.ttl_s <= 0 or self.max_entries < 1:
            raise ConfigError("quarantine ttl_s must be > 0 and max_entries >= 1")


class Quarantine:
    def __init__(self, config: QuarantineConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 shared: bool = False):
        self.config = config or QuarantineConfig()
        # shared (qladder.server.shared_state): what was added here, until the state sync pushes it
        self._new: list[tuple[str, float]] | None = [] if shared else None
        self._pushable = 0
        self.clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()  # fingerprint -> expiry, LRU order
        self._lock = threading.Lock()
        self.hits = 0
        self.added = 0
        self.evicted = 0

    def add(self, fingerprint: str) -> None:
        now = self.clock()
        with self._lock:
            self._put(fingerprint, now + self.config.ttl_s)
            self.added += 1
            if self._new is not None:  # the newest max_entries, while the store is away
                self._new.append((fingerprint, now))
                self._pushable += 1
                if len(self._new) > self.config.max_entries:
                    del self._new[0]

    def _put(self, fingerprint: str, until: float) -> None:
        self._until[fingerprint] = max(until, self._until.get(fingerprint, until))
        self._until.move_to_end(fingerprint)
        while len(self._until) > self.config.max_entries:
            self._until.popitem(last=False)
            self.evicted += 1

    def fresh(self) -> tuple[list[tuple[str, float]], int]:
        """Shared: the fingerprints added here (with when) not yet pushed to the shared store,
        and a mark for `merge` (how many were ever added here)."""
        with self._lock:
            return list(self._new or ()), self._pushable

    def merge(self, mark: int, entries: Sequence[tuple[str, float]]) -> None:
        """Shared: the fresh entries added before `mark` reached the store; `entries`,
        fingerprints added by any gateway (with when), join the table until their TTL from then."""
        now = self.clock()
        with self._lock:
            assert self._new is not None, "merge() on a quarantine that is not shared"
            del self._new[:max(0, mark - (self._pushable - len(self._new)))]
            for fingerprint, at in entries:
                if at + self.config.ttl_s > now:
                    self._put(fingerprint, at + self.config.ttl_s)

    def contains(self, fingerprint: str) -> bool:
        """True while the fingerprint is quarantined (a hit refreshes its place in the LRU order)."""
        now = self.clock()
        with self._lock:
            until = self._until.get(fingerprint)
            if until is None:
                return False
            if until <= now:
                del self._until[fingerprint]
                return False
            self._until.move_to_end(fingerprint)
            self.hits += 1
            return True

    def __len__(self) -> int:
        now = self.clock()
        with self._lock:
            for fp in [fp for fp, until in self._until.items() if until <= now]:
                del self._until[fp]
            return len(self._until)
