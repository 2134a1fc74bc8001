"""What a step of a request tells its driver to do next (the machine's verdict, as data).

    Continue        push the accepted token and take the next step on the same rung
    MoveTo(j)       continue on rung j by token ids: the driver opens rung j on m.context and
                    calls m.moved(j, caught, warm) (`poisoned`: the last row was bad, drop it)
    Verify(j)       a repetition: the driver asks rung j for its greedy token on the same
                    context and calls m.on_verify(token)
    Confirm(reason) the answer would end while its first tokens await a check (remote pool)
    Drafted(j, ids) verified decoding: rung 0 drafted `ids` after the context; rung j decides
                    them in one forward, then the request drafts on (serving/verify.py)
    Done(result)    the request has ended; its result

`StepFailed` is what a driver hands the step in place of a StepOutput when the engine raised.
"""

from __future__ import annotations

from dataclasses import dataclass

from qladder.types import FinishReason, GenerationResult, Hazard


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class MoveTo:
    rung: int
    poisoned: bool  # the current rung's last eval produced a bad row


@dataclass(frozen=True)
class Verify:
    rung: int


@dataclass(frozen=True)
class Done:
    result: GenerationResult


@dataclass(frozen=True)
class Confirm:
    """The answer would end (EOS or length) while its first tokens await the standby's check
    (`hold(n, check=True)`, remote pool only): the driver checks them, then `finish(reason)`."""

    reason: FinishReason


@dataclass(frozen=True)
class Drafted:
    """Verified decoding: rung 0 drafted `ids` after the request's context; rung `rung` keeps the
    longest prefix it agrees with and adds its own next token, in one forward. `hazard`: the
    drafted row right after `ids` failed the guard (that draft ends there; rung `rung` takes the
    step)."""

    rung: int
    ids: tuple[int, ...]
    hazard: Hazard | None = None


Action = Continue | MoveTo | Verify | Done | Confirm


@dataclass(frozen=True)
class StepFailed:
    """The engine raised instead of giving this step's row (an engine_error hazard)."""

    error: str


# Where a hazard sends the request: another rung, a check by the next rung, or the end.
Move = MoveTo | Verify | Done
# What a request carries when it leaves a pool for another (`Handoffs.submit`).
Leave = MoveTo | Verify | Drafted
