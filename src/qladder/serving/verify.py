"""Verified decoding, the verifying rung's half: one forward decides a window of drafts.

Rung 0 (INT4) drafts tokens after a request's context; the verifying rung (full precision) runs
one forward over the last accepted token and the drafts, which gives its own row at every
drafted position and one past the last. `decide` walks those rows through the one step every
driver calls (`machine.step`: the deadline, the guard, then the token): each row's token is the
verifying rung's own (greedy: its argmax; sampled: its coupled draw, `Sampler`), so the answer
is the verifying rung's answer whatever was drafted. While
that token equals the draft, the next row stands (its context is the same); at the first
difference the row's token is the correction and the window ends; when every draft stands, the
row past the last gives one token more. A draft row that failed rung 0's guard ended the window
before it (`Drafted.hazard`, recorded): the verifying rung takes that step.

The session on the verifying rung keeps every accepted token but the last in its cache between
windows (`keep`): the next window starts with that token, so each window has at least one
token to give the row that decides its first draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qladder.actions import Action, Continue, Done, Drafted
from qladder.engines.base import StepOutput
from qladder.machine import RequestMachine, step
from qladder.types import FinishReason


def window(m: RequestMachine, n_past: int, d: Drafted) -> list[int]:
    """The ids the verifying session evaluates: what of the context it lacks, then the drafts."""
    return [*m.context[n_past:], *d.ids]


def decide(m: RequestMachine, rows: torch.Tensor, d: Drafted, took_s: float,
           output: Callable[[torch.Tensor], StepOutput]) -> tuple[Action, int]:
    """Walk the verifying rung's rows (len(d.ids) + 1 of them) through `step`; returns the last
    action and how many drafts stood. `output` makes a row into the step's StepOutput (with the
    forward's activation peaks)."""
    for i in range(len(d.ids) + 1):
        draft = d.ids[i] if i < len(d.ids) else None
        n = len(m.accepted)
        action = step(m, output(rows[i]), took_s if i == 0 else 0.0)
        stood = draft is not None and (m.accepted[n] == draft if len(m.accepted) > n
                                       else _ended_on(action, draft, m.eos_ids))
        if not isinstance(action, Continue) or not stood:
            kept = i + int(stood)
            m.rec.verified(len(d.ids), kept)
            return action, kept
    raise AssertionError("unreachable: the last row has no draft")


def _ended_on(action: Action, draft: int, eos_ids: frozenset[int]) -> bool:
    """The answer ended at this row on the drafted token itself (an end token both rungs chose)."""
    return isinstance(action, Done) and action.result.finish_reason == FinishReason.STOP and draft in eos_ids


def keep(m: RequestMachine) -> int:
    """How many of the context's ids the verifying session keeps between windows."""
    return len(m.context) - 1
