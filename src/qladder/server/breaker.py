"""A circuit breaker per pool: closed / open / half-open on the hazard and error rates of the
pool's recent requests (a sliding time window), as one pure `transition(state, event, now)`.

    CLOSED     requests flow; each outcome enters the window. When the window holds at least
               `min_requests` outcomes and the hazard rate or the error rate passes its bound,
               the breaker opens.
    OPEN       the router sends new requests to the next pool; after `open_s` a new request
               may probe (the first admission check after that moves it to half-open).
    HALF_OPEN  up to `probes` requests are let through; `probes` clean outcomes close it, any
               hazard or error opens it again (for another `open_s`).

The clock is passed in (`now`), so tests drive the breaker with a fake clock; `Breaker` wraps the
state in a lock for the serving threads (outcomes come from the engine's threads, admissions from
the HTTP loop). Follows pybreaker's states, with rates over a window instead of a failure count:
an INT4 pool under a burst of NaN rows has a high hazard *rate*, not a run of consecutive failures.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from qladder.config import knob


class BreakerMode(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


MODE_VALUE = {BreakerMode.CLOSED: 0, BreakerMode.HALF_OPEN: 1, BreakerMode.OPEN: 2}  # the metrics gauge


@dataclass(frozen=True)
class BreakerConfig:
    """Every pool's circuit breaker (its requests go elsewhere while it is open)."""

    window_s: float = knob(30.0, "outcomes older than this leave the breaker's window")
    min_requests: int = knob(10, "no verdict on fewer outcomes than this")
    max_hazard_rate: float = knob(0.5, "open when more than this share of the window's requests hit a hazard")
    max_error_rate: float = knob(0.2, "... or failed outright (an engine error, a stalled step)")
    open_s: float = knob(10.0, "how long an open breaker sends traffic elsewhere before probing")
    probes: int = knob(3, "clean probe outcomes that close a half-open breaker")

    def __post_init__(self) -> None:
        from qladder.errors import ConfigError

        if self.window_s <= 0 or self.open_s <= 0:
            raise ConfigError("breaker window_s and open_s must be > 0")
        if self.min_requests < 1 or self.probes < 1:
            raise ConfigError("breaker min_requests and probes must be >= 1")
        for name in ("max_hazard_rate", "max_error_rate"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"breaker {name} must be in (0, 1]")


@dataclass(frozen=True)
class Outcome:
    """One finished request on the pool: whether it hit a hazard there, or failed there."""

    hazard: bool = False
    error: bool = False


@dataclass(frozen=True)
class Admit:
    """The router asks whether a new request may start on the pool."""


BreakerEvent = Outcome | Admit


@dataclass(frozen=True)
class BreakerState:
    mode: BreakerMode = BreakerMode.CLOSED
    window: tuple[tuple[float, bool, bool], ...] = ()  # (time, hazard, error), oldest first
    opened_at: float = 0.0
    probes_admitted: int = 0
    probes_ok: int = 0
    admitted: bool = True  # the verdict of the last Admit event


def transition(state: BreakerState, event: BreakerEvent, now: float, config: BreakerConfig) -> BreakerState:
    """The breaker's next state; pure."""
    if state.mode is BreakerMode.OPEN:
        if isinstance(event, Admit):
            if now - state.opened_at < config.open_s:
                return replace(state, admitted=False)
            return BreakerState(BreakerMode.HALF_OPEN, probes_admitted=1, admitted=True)
        return state  # a late outcome of a request admitted before the breaker opened
    if state.mode is BreakerMode.HALF_OPEN:
        if isinstance(event, Admit):
            ok = state.probes_admitted < config.probes
            return replace(state, probes_admitted=state.probes_admitted + ok, admitted=ok)
        if event.hazard or event.error:
            return BreakerState(BreakerMode.OPEN, opened_at=now, admitted=False)
        if state.probes_ok + 1 >= config.probes:
            return BreakerState(BreakerMode.CLOSED)
        return replace(state, probes_ok=state.probes_ok + 1)
    # closed
    window = tuple(w for w in state.window if now - w[0] <= config.window_s)
    if isinstance(event, Admit):
        return replace(state, window=window, admitted=True)
    window = (*window, (now, event.hazard, event.error))
    n = len(window)
    if n >= config.min_requests:
        hazards = sum(1 for w in window if w[1]) / n
        errors = sum(1 for w in window if w[2]) / n
        if hazards > config.max_hazard_rate or errors > config.max_error_rate:
            return BreakerState(BreakerMode.OPEN, opened_at=now, admitted=False)
    return replace(state, window=window)


Stamped = tuple[float, BreakerEvent]  # an event and the time it was applied


class Breaker:
    """One pool's breaker, shared by the HTTP loop (admit) and the engine's threads (record)
    through one lock; `on_change(pool, old, new)` is called outside it on every mode change.

    `shared`: gateways share the breaker (qladder.server.shared_state): every event applied here
    is also journaled, the state sync merges the journal into the shared state and the breaker
    `adopt`s the result. The journal keeps the newest `JOURNAL_MAX` events while the store is away
    (the merge drops outcomes older than the shared window anyway)."""

    JOURNAL_MAX = 4096

    def __init__(self, pool: str, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, BreakerMode, BreakerMode], None] | None = None, shared: bool = False):
        self.pool = pool
        self.config = config or BreakerConfig()
        self.clock = clock
        self.on_change = on_change
        self._state = BreakerState()
        self._lock = threading.Lock()
        self._journal: deque[Stamped] | None = deque(maxlen=self.JOURNAL_MAX) if shared else None
        self._journaled = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def journal(self) -> tuple[BreakerState, list[Stamped], int]:
        """This breaker's state, the events applied here and not yet merged into the shared state
        (oldest first; the state includes them), and a mark to hand back to `adopt` (how many
        events were ever journaled: the last one's sequence number), all at one instant."""
        with self._lock:
            return self._state, list(self._journal or ()), self._journaled

    def adopt(self, shared: BreakerState, mark: int) -> None:
        """The shared state now holds the events journaled before `mark`: take it as this
        breaker's, with the events applied here since (still journaled) replayed on top."""
        with self._lock:
            assert self._journal is not None, "adopt() on a breaker that is not shared"
            for _ in range(max(0, mark - (self._journaled - len(self._journal)))):
                self._journal.popleft()
            old, new = self._state, shared
            for at, event in self._journal:
                new = transition(new, event, at, self.config)
            self._state = new
        if new.mode is not old.mode and self.on_change is not None:
            self.on_change(self.pool, old.mode, new.mode)

    @property
    def mode(self) -> BreakerMode:
        with self._lock:
            return self._state.mode

    def allow(self) -> bool:
        """May a new request start on this pool now? (Counts as a probe when half-open.)"""
        return self._apply(Admit()).admitted

    def record(self, hazard: bool = False, error: bool = False) -> None:
        self._apply(Outcome(hazard, error))

    def _apply(self, event: BreakerEvent) -> BreakerState:
        with self._lock:
            old, now = self._state, self.clock()
            self._state = new = transition(old, event, now, self.config)
            if self._journal is not None:
                self._journal.append((now, event))
                self._journaled += 1
        if new.mode is not old.mode and self.on_change is not None:
            self.on_change(self.pool, old.mode, new.mode)
        return new
