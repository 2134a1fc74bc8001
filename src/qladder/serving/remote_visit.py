"""One visit of a request to a remote rung: what the remote pool keeps while it streams there.

A remote rung streams sampled tokens, not rows, so its checks (`health/remote.py`) read each
token's logprob and top-k. Across the tokens of one visit they need the rung's top-1 logprobs
(the `diffuse` window) and the logprobs of the tokens it drew (the standby's draft check); the
visit keeps both, and tells the machine how many tokens to hold back.

Released on confidence, at an answer's start. With a rung above, a window the `diffuse` check
refuses is rolled back to what was released (`RequestMachine.on_hazard`), so a remote rung holds
its last `diffuse_window - 1` accepted tokens (those a refusal at the next token would take
back). The hold has a second use: a flood of confident tokens (`((((`, tokenized irregularly, so
no period shows in the ids at first) stays unreleased until the repetition rule sees it, and
the end keeps one copy. Within an answer's first window, where that hold alone would keep any
text back until the 8th token, the visit holds only the tokens from the first unsure one on: a
window's mean top-1 logprob can fall under the bound only through a token whose own top-1 is
under it, so a refusal there rolls back from the first unsure token. Past the first window the
last 7 are held again (the stream pauses for those 7 tokens once). Measured before this limit,
with sure tokens released all through the answer: a long-math prompt's `((((` flood, trimmed to
`(((` under the full hold, went out whole (`bench/results/validate-remote-quick-2026-12-04-hold-*`).
What remains of that risk: a confident flood that starts inside the first window goes out as it
comes, up to the window's end, before the repetition rule (12 tokens for short loops) sees it.

The draft: a flagged input's answer (the input defence changed it, or its prompt holds a lone
byte's id) has its first tokens held from the start for the rung above to score
(`await_draft_check`); any other streams as its tokens pass the guard (fast mode: no
full-precision work on the path).
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
        g = m.config.guard
        self.climb = m.rung + 1 < len(m.rungs)
        r = g.remote
        # the diffuse check's reach back: the tokens a refusal at the next token rolls back
        self.reach = r.diffuse_window - 1 if self.climb and g.check_logits and r.diffuse_logprob is not None else 0
        # a token at or over both bounds cannot take a window's mean (or a prefix's) under them
        self.sure = max(r.diffuse_logprob, r.diffuse_first_logprob) if r.diffuse_logprob is not None else -math.inf
        m.hold(self.held())

    def held(self) -> int:
        """Tokens to hold from the end: the last `reach`; within an answer's first window, only
        those from the first unsure one on."""
        recent = self.top1[len(self.top1) - min(self.reach, len(self.top1)):]
        if self.start > 0 or len(self.top1) > self.reach + 1:
            return len(recent)
        first = next((i for i, v in enumerate(recent) if not v >= self.sure), None)
        return 0 if first is None else len(recent) - first

    def ended(self) -> bool:
        """The request ended (what a hold released completed a stop string). A method, not a
        property: a hold inside `judge` can end it, which a type checker's narrowing of a
        property read once would not see."""
        return self.m.done is not None

    def judge(self, tok: RemoteToken, took_s: float, n_vocab: int, expected_bytes: bytes | None,
              deadline_s: float | None = None) -> Hazard | None:
        """The verdict on a token the rung sampled and streamed: the deadline (`deadline_s`: what
        the pool allowed this gap; the guard's step deadline by default), then check_remote."""
        m = self.m
        name = m.rungs[m.rung]
        deadline = m.config.guard.step_deadline_s if deadline_s is None else deadline_s
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
            if m.unchecked:  # a draft awaiting its check is held whole until then
                return None
            m.hold(self.held())  # counts the token about to be accepted: one more held meanwhile
        return hazard

    def await_draft_check(self, n: int) -> None:
        """The rung above checks the next `n` tokens before any of them is released."""
        self.held_from = self.m.step
        self.m.hold(n, check=True)

    def draft_checked(self) -> None:
        """The standby passed the draft (or could not say): release as a remote rung does."""
        self.m.hold(self.held())
