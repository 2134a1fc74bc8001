"""What a server's silence owes to the prompts it was prefilling meanwhile (the remote pool's
inter-token deadline, relative to the server's own pace).

A llama-server (or vLLM) decodes its slots in one batch, and a new request's prompt joins that
batch: while it is prefilled, every other stream on that server waits. A 1,000-token prompt on a
one-thread server is seconds without a token for anyone, and a fixed inter-token deadline read
that as a stall and handed clean answers up. The ledger keeps, per remote rung (its owner: the
pool's loop thread), the prompts sent there and not yet answered (no first token yet), those
answered lately, and the rung's measured prefill rate (a prompt's tokens over its time to first
token: the median of the last RATES_KEPT of at least MIN_RATE_TOKENS). A stream silent since
`since` is owed the time the other prompts' prefills take at that rate, counted where they
overlap its silence (an answered prompt's prefill is taken to be the last n/rate seconds before
its first token; an open one, from when it was sent), capped at `cap_s`:

    limit = step_deadline_s + MARGIN * owed(since)       (MARGIN = 1.5: a prefill's time varies)

A server that stalls with nothing to prefill still meets the plain deadline; one that stalls
beside a prefill of P seconds is caught when its silence passes the deadline plus 1.5 P (the
margin: a prefill on a busy machine runs slower than its measured rate says). Until a rate is measured nothing is
owed (the plain deadline). The cause a deadline hazard records carries what was owed.
Pure: the pool's clock is passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MARGIN = 1.5  # what is owed, over the prefills' expected time
MIN_RATE_TOKENS = 64  # a shorter prompt's time to first token is the server's overhead, not its rate
RATES_KEPT = 16
KEEP_DONE_S = 120.0


@dataclass
class _Prefill:
    start: float
    n: int
    end: float | None = None


class PrefillLedger:
    """The prompts one remote rung is prefilling, and what a stream's silence owes them."""

    def __init__(self, clock: Callable[[], float], cap_s: float):
        self.clock, self.cap_s = clock, cap_s
        self._open: dict[int, _Prefill] = {}
        self._done: deque[_Prefill] = deque()
        self._rates: deque[float] = deque(maxlen=RATES_KEPT)
        self._keys = 0

    def begin(self, n_tokens: int) -> int:
        """A prompt of `n_tokens` was sent to the server: its key, for `end`."""
        self._keys += 1
        self._open[self._keys] = _Prefill(self.clock(), n_tokens)
        return self._keys

    def sent(self, n_tokens: int) -> SentPrompt:
        """A stream's prompt of `n_tokens` was sent to the server: its handle (answered, re-sent
        to a sibling replica, closed)."""
        return SentPrompt(self, n_tokens)

    def end(self, key: int, answered: bool) -> None:
        """The prompt's first token came (`answered`: its time measures the rate), or its stream
        ended without one (its prefill, if any, is still counted where it overlaps). Idempotent."""
        p = self._open.pop(key, None)
        if p is None:
            return
        p.end = now = self.clock()
        if answered and p.n >= MIN_RATE_TOKENS and now > p.start:
            self._rates.append(p.n / (now - p.start))
        self._done.append(p)
        while self._done and (self._done[0].end or 0.0) < now - KEEP_DONE_S:
            self._done.popleft()

    @property
    def rate(self) -> float | None:
        """Prompt tokens a second, as this server has prefilled them lately (None: not measured yet)."""
        return statistics.median(self._rates) if self._rates else None

    @property
    def pending(self) -> int:
        return len(self._open)

    def owed(self, since: float) -> float:
        """Seconds of the silence since `since` owed to the prompts the server prefilled (or is
        prefilling) meanwhile: their expected time there, times MARGIN, capped."""
        rate = self.rate
        if rate is None:
            return 0.0
        now, total = self.clock(), 0.0
        for p in self._open.values():  # being prefilled now (or queued): its whole time, from when it was sent on
            d = p.n / rate
            if now > p.start + MARGIN * d:  # overdue: a server that hangs owes nothing to what it never answers
                continue
            total += max(0.0, min(d, p.start + d - since)) if p.start < since else d
        for p in reversed(self._done):  # (in the order they ended: the newest first, back to `since`)
            if p.end is None or p.end <= since:
                break
            d = p.n / rate
            total += max(0.0, min(p.end, now) - max(p.end - d, p.start, since))
        return min(self.cap_s, MARGIN * total)


class SentPrompt:
    """One stream's prompt on its rung's ledger, as the stream goes: waiting for its first token,
    answered, re-sent (a replica died: its sibling prefills the context), closed. The one owner
    is the stream's task; `close` is idempotent (a stream ends however it ends)."""

    def __init__(self, ledger: PrefillLedger, n_tokens: int):
        self.ledger = ledger
        self.key = ledger.begin(n_tokens)
        self.waiting = True  # no token yet on this prompt (its wait is a first token's)

    def answered(self) -> bool:
        """A token came; True if it is the prompt's first (its wait measured the rate)."""
        if not self.waiting:
            return False
        self.waiting = False
        self.ledger.end(self.key, answered=True)
        return True

    def resent(self, n_tokens: int) -> None:
        """The stream goes on at another server of the rung, which prefills `n_tokens` anew."""
        self.ledger.end(self.key, answered=False)
        self.key = self.ledger.begin(n_tokens)
        self.waiting = True

    def close(self) -> None:
        self.ledger.end(self.key, answered=False)
