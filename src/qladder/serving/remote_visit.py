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

The draft: an answer whose first tokens will be scored by the rung above (a flagged input, a
prompt with a lone byte's id, `draft_check = "all"`, a greedy answer under drift windows) holds
them from the start (`await_draft_check`). Any other is `watch`ed: its first `WATCH_MIN` tokens
are held and decided on together (`decide`: the mean of their own logprobs under the suspect
bound, or an answer that ends inside them and is unsure, sends them to be scored; sure, they go
out), then its tokens stream while the mean from the first stays at or over the bound; the
token that takes it under holds the draft from its first unreleased token to its end, scored
then (`hold_watched`). Tokens out before that were never scored: the price of streaming. An
answer's first token is where it picks its phrasing, often at -1.5 to -2.2 on a clean answer,
so one token says too little: over the first two, five clean greedy answers of the embedded
model ran -1.08 to -1.17 (bound -1.25), none under, as over their first eight. On a hazard, a
watched draft's held tokens are rolled back with the rest (`leave`).
A visit ends when the request leaves the rung; the next visit starts empty.
"""

from __future__ import annotations

import math

from qladder.health.remote import RemoteToken, check_remote
from qladder.machine import RequestMachine
from qladder.types import Hazard

WATCH_MIN = 2  # a watched draft's first tokens, held and decided on together


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
        # the diffuse check's reach back: the tokens a refusal at the next token rolls back
        self.reach = r.diffuse_window - 1 if self.climb and g.check_logits and r.diffuse_logprob is not None else 0
        # a token at or over both bounds cannot take a window's mean (or a prefix's) under them
        self.sure = max(r.diffuse_logprob, r.diffuse_first_logprob) if r.diffuse_logprob is not None else -math.inf
        self.watch_until = 0  # a watched draft's end (the answer's step); 0: none, or no longer watched
        self.watch_from = 0  # its first token's index in `drawn`
        self.watched = False  # this visit watched a draft ...
        self.scored = False  # ... and sent a window of it to the rung above
        self.counted = False  # ... or was counted "confident" by the pool
        self.check_at = 0  # the step at which a window held by the watch is checked (0: none pending)
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
            if m.unchecked:  # a window awaiting its check is held whole until then
                return None
            if self.watch_until and self.unsure():  # decided before anything more is released
                self.check_at = self.hold_watched()
            else:
                m.hold(self.held())  # counts the token about to be accepted: one more held meanwhile
        return hazard

    def watch(self, n: int) -> int:
        """The next `n` tokens are the draft: its first `WATCH_MIN` held and decided on together
        (`decide`), the rest watched token by token. The step of that first decision."""
        self.watch_until, self.watch_from, self.watched = self.m.step + n, len(self.drawn), True
        k = min(WATCH_MIN, n)
        self.await_draft_check(k)
        return self.m.step + k

    def unsure(self) -> bool:
        """The watched draft's tokens so far (the one just judged included) average under the
        suspect bound."""
        bound = self.m.config.guard.draft.verify_suspect_logprob
        own = self.drawn[self.watch_from:]
        return bound is not None and bool(own) and sum(own) / len(own) < bound

    def decide(self, final: bool) -> bool:
        """The watched draft's first tokens are in (held), or its answer leaves the rung first
        (`final`): True when the held window goes to the rung above now. Sure: released, and
        watched on. Unsure with the draft still going: held to its end (`check_at`)."""
        if not self.unsure():
            if self.m.step >= self.watch_until:  # the whole draft was in the first decision
                self.watch_until = 0
            self.draft_checked([])
            return False
        if not final and self.m.step < self.watch_until:
            self.check_at = self.hold_watched()
            return False
        self.watch_until = 0
        return True

    def hold_watched(self) -> int:
        """The watched draft is unsure: hold it from its first unreleased token to its end, for
        the rung above. The step at which that window is checked."""
        self.held_from = self.m.released
        end, self.watch_until = self.watch_until, 0
        self.m.hold(end - self.held_from, check=True)
        return end

    def leave(self, hazard: bool) -> None:
        """The request leaves this rung. On a hazard, a watched draft's held tokens, never scored,
        are rolled back with what awaits a check (nothing unchecked is handed on)."""
        if hazard and self.watch_until and not self.m.unchecked:
            self.m.hold(0, check=True)

    def await_draft_check(self, n: int) -> None:
        """The rung above checks the next `n` tokens before any of them is released."""
        self.held_from = self.m.step
        self.m.hold(n, check=True)

    def draft_checked(self, flags: list[bool]) -> None:
        """The standby passed the window (`flags`: per token, its argmax; none when it could not
        say or did not score): release as a remote rung does."""
        self.flags.extend(flags)
        self.m.hold(self.held())
