"""Handoff policy: pure decisions that return actions; the ladder loop carries them out.

    hazard on rung i            -> Handoff(i + 1)             a rung is left
    hazard on the last rung     -> Stop(DEGRADED, fallback)   the safe fallback answer
    engine error, fail_on_engine_error -> Stop(ERROR)         a bare configuration's 5xx
    repetition the next rung reproduces -> Stop(REPETITION)   the model's own loop, not a fault
    K healthy tokens above rung 0 (return_after=K) -> Handoff(0)

The policy never touches an engine (tenacity's DoAttempt/DoSleep shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qladder.health.guard import GUARD_PRESETS, GuardConfig
from qladder.types import FinishReason, Hazard


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Handoff:
    to: int  # rung index


@dataclass(frozen=True)
class Stop:
    reason: FinishReason
    fallback: bool


Action = Continue | Handoff | Stop


@dataclass(frozen=True)
class LadderPolicy:
    return_after: int | None = None  # None: stay on the higher rung for the rest of the answer
    max_handoffs: int = 8  # a bound on climbing back and forth within one answer
    # A bare configuration (validation's naive server): an engine failure ends the request as an
    # error (a 5xx) instead of climbing or answering with the fallback.
    fail_on_engine_error: bool = False

    def on_hazard(self, hazard: Hazard, rung: int, n_rungs: int, handoffs: int,
                  reproduced: bool | None = None) -> Handoff | Stop:
        """`reproduced`: for a repetition, whether the next rung continues the same loop."""
        if hazard.check == "engine_error" and self.fail_on_engine_error:
            return Stop(FinishReason.ERROR, fallback=False)
        if hazard.check == "repetition" and (reproduced or rung + 1 >= n_rungs):
            return Stop(FinishReason.REPETITION, fallback=False)
        if rung + 1 < n_rungs and handoffs < self.max_handoffs:
            return Handoff(rung + 1)
        return Stop(FinishReason.DEGRADED, fallback=True)

    def on_token(self, rung: int, healthy_streak: int, handoffs: int) -> Continue | Handoff:
        """After a healthy token on `rung`, `healthy_streak` tokens in a row there."""
        if (self.return_after is not None and rung > 0 and healthy_streak >= self.return_after
                and handoffs < self.max_handoffs):
            return Handoff(0)
        return Continue()


@dataclass(frozen=True)
class LadderConfig:
    """How one request climbs: the guard's checks, the handoff policy, the warm shadow, records."""

    guard: GuardConfig = field(default_factory=lambda: GUARD_PRESETS["default"])
    policy: LadderPolicy = field(default_factory=LadderPolicy)
    warm_shadow: bool = False
    shadow_sync_every: int = 16
    record_incidents: bool = True  # a bare configuration keeps no incident records
