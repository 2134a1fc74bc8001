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

A checked window (`Drafted.checked`: a greedy INT4 answer's drift window, outside verified
decoding) is only scored: `check` flags each draft that is the rung above's argmax and applies the
drift rule (health/drift.check_drift). A window that passes stands whole as INT4's tokens (no
token of the rung above is added); a refused one keeps the drafts before its first departure from
fp32's argmax, and the hazard moves the request (the policy: the rest on the rung above). The
repetition rule runs on the way, as `step` would run it on INT4's rows, and a loop it finds is
confirmed on the rung above's row at that position (`m.on_verify`), as a handoff's would be.

The session on the verifying rung keeps every accepted token but the last in its cache between
windows (`keep`): the next window starts with that token, so each window has at least one
token to give the row that decides its first draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qladder.actions import Action, Continue, Done, Drafted
from qladder.engines.base import StepOutput
from qladder.health.drift import check_drift
from qladder.machine import RequestMachine, step
from qladder.types import FinishReason, Hazard


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


def check(m: RequestMachine, rows: torch.Tensor, d: Drafted, before: list[bool], window: int,
          bound: float) -> tuple[Action, list[bool], Hazard | None]:
    """A checked window: the rung above's rows (one per draft, and one past) score INT4's drafts.
    Returns the action, the flags of the drafts that stood (each: the rung above's argmax or not)
    and the drift refusal, if the window was refused. `before`: the flags of this answer's
    checked tokens so far (the last `window` of them)."""
    rung = m.rungs[m.rung]
    flags = [int(rows[i].argmax()) == t for i, t in enumerate(d.ids)]
    refused = check_drift(d.ids, flags, before, rung, m.rungs[d.rung], window, bound, m.step)
    n = len(d.ids) if refused is None else refused.step - m.step
    for i in range(n):
        loop = m.guard.check_repetition(m.accepted, rung)
        if loop is not None:  # INT4's token here was d.ids[i]; the rung above says rows[i]
            m.on_hazard(loop, d.ids[i])
            return m.on_verify(int(rows[i].argmax())), flags[:i], None
        action = m.accept_token(d.ids[i], d.lps[i] if d.lps else None)
        if not isinstance(action, Continue):
            return action, flags[:i + 1], None
    hazard = refused or d.hazard  # a drafted row the guard refused, right after the window
    if hazard is not None:
        return m.on_hazard(hazard, None), flags[:n], refused
    return Continue(), flags, None


def _ended_on(action: Action, draft: int, eos_ids: frozenset[int]) -> bool:
    """The answer ended at this row on the drafted token itself (an end token both rungs chose)."""
    return isinstance(action, Done) and action.result.finish_reason == FinishReason.STOP and draft in eos_ids


def keep(m: RequestMachine) -> int:
    """How many of the context's ids the verifying session keeps between windows."""
    return len(m.context) - 1
