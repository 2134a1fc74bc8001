"""Verified decoding, rung 0's half: what an INT4 slot drafts ahead of its request.

A verified request keeps its INT4 slot for its whole life. The slot drafts tokens after the
request's context (INT4's rows, judged by the guard, drawn as the request draws: greedy, or the
coupled draw of `Sampler` with the request's seed and the draft's position); a window of them goes to the
verifying rung with the machine (`Drafted`), and while the machine is away the slot drafts on,
as if every draft of the window stood and the verifying rung's own next token were INT4's next
draft. When the machine comes back with the verifying rung's tokens, `reconcile` keeps what is
still valid: the drafts past the new context when the new context is a prefix of what was
drafted (the window stood whole and the next draft was right: the decode and the verification
overlapped), otherwise nothing; the slot's KV is cut back to the longest prefix the new context
shares with what it evaluated.

A drafted row the guard refuses ends the drafting there: the verifying rung takes that step (a
rejected draft). A second refusal with no draft between them means INT4 keeps failing on this
request: it leaves verified decoding by an ordinary handoff (`LEAVE_AFTER` strikes).

`next_k` adapts the window to the measured agreement: a window that stood whole grows by 2 (up to
`K_MAX`), one that did not shrinks to what stood plus one (at least `K_MIN`). Pure functions of
their arguments; the state is the scheduler thread's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qladder.actions import Drafted, StepFailed
from qladder.engines.base import StepOutput
from qladder.health.guard import StepGuard
from qladder.sampling import Sampler, SamplingParams
from qladder.types import Hazard

K_START, K_MIN, K_MAX = 6, 2, 16
LEAVE_AFTER = 2


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many ids two sequences share from their start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def should_draft(drafting: int, standby_busy: int, limit: int) -> bool:
    """Whether a new verified request drafts on INT4, or is answered by the full-precision rung
    alone (the same answer: greedy, the rung's argmax; sampled, its distribution). Drafting pays
    while the full-precision rung has little else to do: one forward decides a window, where
    alone it would decode a token. Under load, the batched rung decodes many requests in one
    forward anyway, and on a CPU whose INT4 kernels are compute-bound it then outruns INT4's
    drafts (`qladder bench verified`: on this box drafting wins at 1 request in flight and loses
    from 2). So: draft while fewer than `limit` requests use the full-precision rung."""
    return drafting + standby_busy < limit


def next_k(k: int, sent: int, kept: int) -> int:
    """The next window's size after `kept` of `sent` drafts stood."""
    if sent and kept >= sent:
        return min(k + 2, K_MAX)
    return max(kept + 1, K_MIN)


@dataclass
class Drafts:
    """One verified request's drafts on its INT4 slot. Owned by the scheduler thread."""

    base: list[int]  # the request's context when its machine was last here (prompt + accepted)
    n_prompt: int
    params: SamplingParams
    eos_ids: frozenset[int]
    n_ctx: int
    sampler: Sampler | None = None  # a sampled request's coupled sampler (not its machine's: the same draws)
    ids: list[int] = field(default_factory=list)  # drafted after `base`
    hazard: Hazard | None = None  # a drafted row the guard refused, right after `ids`
    strikes: int = 0  # drafted rows refused in a row (no draft between them)
    away: bool = False  # the machine is at the verifying rung
    sent: int = 0  # drafts in the window out for verification
    k: int = K_START

    @property
    def position(self) -> int:
        """The answer's step the next draft is for."""
        return len(self.base) + len(self.ids) - self.n_prompt

    @property
    def stopped(self) -> bool:
        """No more drafting: a refused row, an end drafted, or no room left (max_tokens, n_ctx)."""
        if self.hazard is not None:
            return True
        if self.ids and self.ids[-1] in self.eos_ids and not self.params.ignore_eos:
            return True
        return self.position >= self.params.max_tokens or len(self.base) + len(self.ids) >= self.n_ctx

    def judge(self, out: StepOutput | StepFailed, checker: StepGuard, rung: str,
              native_argmax: Callable[[], int] | None) -> Hazard | None:
        """A drafted row: the guard (no repetition check: the verifier judges the answer's loops),
        then the draft (greedy: the engine's own argmax where it has the row; sampled: the
        coupled draw at this position). A refused row ends the drafting and is returned."""
        pos = self.position
        if isinstance(out, StepFailed):
            hazard: Hazard | None = Hazard("engine_error", rung, pos, detail=out.error)
        else:
            hazard = checker.check(out.row, (self.base + self.ids)[self.n_prompt:], rung, out.peaks,
                                   out.activation_limit, out.rest_peaks, out.stats, repetition=False)
        if hazard is not None:
            self.hazard, self.strikes = hazard, self.strikes + 1
            return hazard
        assert isinstance(out, StepOutput)
        self.strikes = 0
        if self.sampler is not None:
            self.ids.append(self.sampler.sample(out.row, pos))
        else:
            self.ids.append(native_argmax() if native_argmax is not None else int(out.row.argmax()))
        return None

    def wants_row(self) -> bool:
        """Whether the slot should decode for a next draft (home: up to a window; away: up to a
        window past the one out)."""
        ahead = len(self.ids) - (self.sent if self.away else 0)
        return not self.stopped and ahead < self.k

    def ready(self) -> bool:
        """Home with a window to send (or nothing more to draft: the verifying rung steps alone)."""
        return not self.away and (len(self.ids) >= self.k or self.stopped)

    def window(self, rung: int = 1) -> Drafted:
        """The drafts to send now to `rung` (up to k: the windows do not depend on timing) and
        the hazard after them, if they reach it; marks them sent."""
        n = min(len(self.ids), self.k)
        self.sent, self.away = n, True
        return Drafted(rung, tuple(self.ids[:n]), self.hazard if n == len(self.ids) else None)

    def reconcile(self, context: list[int]) -> int:
        """The machine is back with `context` (prompt + accepted). Keeps the drafts that are still
        valid, adapts k; returns how many of the evaluated ids (base + ids) the new context shares."""
        lcp = common_prefix(self.base + self.ids, context)
        kept = min(lcp, len(self.base) + self.sent) - len(self.base)
        self.k = next_k(self.k, self.sent, kept)
        if lcp == len(context):  # the new context is what was drafted: the rest stands as drafts
            self.ids = self.ids[len(context) - len(self.base):]
        else:
            self.ids = []
            self.hazard = None
        self.base = list(context)
        self.away, self.sent = False, 0
        return lcp
