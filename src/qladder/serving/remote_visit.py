"""One visit of a request to a remote rung: what the remote pool keeps while it streams there.

A remote rung streams sampled tokens, not rows, so its checks (`health/remote.py`) read each
token's logprob and top-k. Across the tokens of one visit they need the rung's top-1 logprobs
(the `diffuse` window) and the logprobs of the tokens it drew (the standby's draft check); the
visit keeps both, and tells the machine how many tokens to hold back: with a rung above, the
last `diffuse_window - 1`, so that a window the `diffuse` check refuses is rolled back whole.
A visit ends when the request leaves the rung; the next visit starts empty.
"""

from __future__ import annotations

import math

from qladder.health.remote import RemoteToken, check_remote
from qladder.machine import RequestMachine
from qladder.types import Hazard


class RemoteVisit:
    """Owned by the remote pool's loop, as the machine is while the request is there."""

    def __init__(self, m: RequestMachine):
        self.m = m
        self.top1: list[float] = []  # the rung's top-1 logprobs (its `diffuse` check)
        self.drawn: list[float] = []  # its logprobs of the tokens it drew (the standby's `verify` check)
        self.start = m.step  # the answer's step when the visit began (drawn[0] is its token)
        self.held_from = m.step  # the first token of the window the rung above checks next
        self.flags: list[bool] = []  # per token it passed: the rung above's argmax (the `drift` check)
        g = m.config.guard
        self.climb = m.rung + 1 < len(m.rungs)
        r = g.remote
        self.hold = r.diffuse_window - 1 if self.climb and g.check_logits and r.diffuse_logprob is not None else 0
        m.hold(self.hold)

    @property
    def ended(self) -> bool:
        """The request ended (what a hold released completed a stop string)."""
        return self.m.done is not None

    def judge(self, tok: RemoteToken, took_s: float, n_vocab: int, expected_bytes: bytes | None) -> Hazard | None:
        """The verdict on a token the rung sampled and streamed: the deadline, then check_remote."""
        m = self.m
        name = m.rungs[m.rung]
        deadline = m.config.guard.step_deadline_s
        if took_s > deadline:
            return Hazard("deadline", name, m.step, took_s, deadline,
                          detail=f"the next token took {took_s * 1e3:.0f} ms")
        hazard = check_remote(m.guard, tok, m.accepted, name, n_vocab, expected_bytes, self.top1, self.climb)
        if hazard is None:
            finite = [v for v in (tok.logprob, *(v for _, v in tok.top)) if v is not None and math.isfinite(v)]
            best = max(finite, default=float("nan"))
            self.top1.append(best)
            own = tok.logprob
            self.drawn.append(own if own is not None and math.isfinite(own) else best)
        return hazard

    def await_draft_check(self, n: int) -> None:
        """The rung above checks the next `n` tokens before any of them is released."""
        self.held_from = self.m.step
        self.m.hold(n, check=True)

    def draft_checked(self, flags: list[bool]) -> None:
        """The standby passed the window (`flags`: per token, its argmax; none when it could not
        say or did not score): release as a remote rung does."""
        self.flags.extend(flags)
        self.m.hold(self.hold)
