"""One visit of a request to a remote rung: what the remote pool keeps while it streams there.

A remote rung streams sampled tokens, not rows, so its checks (`health/remote.py`) read each
token's logprob and top-k. Across the tokens of one visit they need the rung's top-1 logprobs
(the `diffuse` window) and the logprobs of the tokens it drew (the standby's draft check); the
visit keeps both, and tells the machine how many tokens to hold back.

Released on confidence. With a rung above, a window the `diffuse` check refuses is rolled back to
what was released (`RequestMachine.on_hazard`). A window's mean top-1 logprob can fall under the
bound only through a token whose own top-1 is under it, so the visit holds, of the last
`diffuse_window - 1` tokens (those a refusal at the next token would take back), the ones from the
first such unsure token on; a run of sure tokens streams at once, and a refusal rolls back from
the first unsure token of its window. (It used to hold the last `diffuse_window - 1` whatever they
were: no answer's first text before its 8th token.)

The draft: an answer whose first tokens will be scored by the rung above (a flagged input, a
greedy answer under drift windows) holds them from the start (`await_draft_check`); any other is
`watch`ed: its first `WATCH_MIN` tokens are held, then its tokens stream while the mean of their
own logprobs (from the first) stays at or over the suspect bound; the token that takes it under
starts a held window to the draft's end (from the first token when that is the `WATCH_MIN`th),
scored then. An answer's first token is where it picks its phrasing, often at -1.5 to -2.2 on a
clean answer, so one token says too little: over the first two, five clean greedy answers of the
embedded model ran -1.08 to -1.17 (bound -1.25), none under, as over their first eight.
A visit ends when the request leaves the rung; the next visit starts empty.
"""

from __future__ import annotations

import math

from qladder.health.remote import RemoteToken, check_remote
from qladder.machine import RequestMachine
from qladder.types import Hazard

WATCH_MIN = 2  # a watched draft's tokens held before its mean logprob says anything


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
        self.sure = r.diffuse_logprob if r.diffuse_logprob is not None else -math.inf
        self.watch_until = 0  # a watched draft's end (the answer's step), 0: none
        self.watch_start = 0  # its first token's step
        self.watch_from = 0  # its first token's index in `drawn`
        self.check_at = 0  # set when a watched draft turns unsure: the step its window is checked at
        m.hold(self.held())

    def held(self) -> int:
        """Tokens to hold from the end: of the last `reach`, those from the first unsure one on;
        and a watched draft's tokens until `WATCH_MIN` are in."""
        recent = self.top1[len(self.top1) - min(self.reach, len(self.top1)):]
        first = next((i for i, v in enumerate(recent) if not v >= self.sure), None)
        n = 0 if first is None else len(recent) - first
        seen = len(self.drawn) - self.watch_from
        return max(n, seen) if self.watch_until and seen < WATCH_MIN else n

    def ended(self) -> bool:
        """The request ended (what a hold released completed a stop string). A method, not a
        property: a hold inside `judge` can end it, which a type checker's narrowing of a
        property read once would not see."""
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
            bound = m.config.guard.draft.verify_suspect_logprob
            if self.watch_until and bound is not None and self.unsure(bound):  # before any release
                self.check_at = self.hold_watched()
            elif not m.unchecked:  # (a window awaiting its check is held whole until then)
                m.hold(self.held())  # counts the token about to be accepted: one more held meanwhile
        return hazard

    def watch(self, n: int) -> None:
        """The next `n` tokens are the draft, held only once their mean logprob is unsure."""
        self.watch_until, self.watch_start, self.watch_from = self.m.step + n, self.m.step, len(self.drawn)

    def unsure(self, bound: float) -> bool:
        """The watched draft's tokens so far (the one just judged included, `WATCH_MIN` at least)
        average under `bound`."""
        own = self.drawn[self.watch_from:]
        return len(own) >= WATCH_MIN and sum(own) / len(own) < bound

    def hold_watched(self) -> int:
        """The watched draft turned unsure at the token just judged: hold it from its first
        unreleased token (the draft's first, if it turned at `WATCH_MIN`) to its end, for the
        rung above. The step at which the window is checked."""
        seen = len(self.drawn) - self.watch_from
        self.held_from = self.watch_start if seen <= WATCH_MIN else self.m.step
        end, self.watch_until = self.watch_until, 0
        self.m.hold(end - self.held_from, check=True)
        return end

    def await_draft_check(self, n: int) -> None:
        """The rung above checks the next `n` tokens before any of them is released."""
        self.held_from = self.m.step
        self.m.hold(n, check=True)

    def draft_checked(self, flags: list[bool]) -> None:
        """The standby passed the window (`flags`: per token, its argmax; none when it could not
        say or did not score): release as a remote rung does."""
        self.flags.extend(flags)
        self.m.hold(self.held())
