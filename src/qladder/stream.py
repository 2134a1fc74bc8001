"""Streaming-correct answer text: what may be shown to a client after each accepted token.

A token is released (its id and its text sent to the client) only when nothing later can take it
back:
- UTF-8: the bytes up to the token's end form whole characters. A byte-level BPE splits rare
  characters (emoji, CJK, symbols) over several byte tokens; a token that ends inside a character
  waits for the one that completes it, so a stream never shows a half character as U+FFFD.
- Stop strings: text that could be the start of a stop string waits until it is known not to be
  one; a stop string that matches ends the answer *before the token in which it starts*, so the
  answer's `token_ids` and its `text` always agree (`text == decode(token_ids)`). A stop string
  that starts inside a token cuts that token's leading bytes too (OpenAI cuts at the character:
  the difference is at most one token's text, and only when a stop string is not token-aligned).
- Loops: the ladder ends an answer that the model keeps repeating with one copy of the pattern
  (the rest of the loop is never part of the answer). So that a stream never shows what the end
  takes back, a tail that already repeats itself (a pattern of period p <= `loop_max_period`
  seen more than once in a row) is held past its first copy until it stops repeating. The cost:
  on clean text, a held token or two whenever the last tokens happen to repeat (" the the");
  on a real loop, at most the loop's repeats, which are withheld at the end anyway (a period-p
  loop is caught within max(8p, 32) tokens on the default guard, short ones within 12).
- At the end, tokens whose bytes end inside a character (an answer cut by max_tokens mid-way
  through a multi-byte character) are dropped: the answer never ends in a made-up U+FFFD. Bytes
  that are invalid UTF-8 in the model's own tokens still decode to U+FFFD: that is the model's
  output, shown as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from qladder.health.repetition import loop_start

TokenBytes = Callable[[Sequence[int]], bytes]
Tag = TypeVar("Tag")


def _complete(data: bytes) -> bool:
    """Whether data does not end inside a UTF-8 character (invalid bytes count as complete)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return True  # ASCII: whatever came before is complete or invalid
        if b >= 0xC0:  # a lead byte: complete when the sequence it opens is whole
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
            return back >= need
    return True  # only continuation bytes within reach: invalid, decoded as U+FFFD


def decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class TextStream(Generic[Tag]):
    """The released part of one answer. `push` each accepted token with its tag (what the answer
    reports per token: the machine's is its rung and its log-probability), then read `release()`.
    A token's tag is dropped with it."""

    def __init__(self, token_bytes: TokenBytes, stops: Sequence[str] = (), loop_max_period: int = 0):
        self._bytes = token_bytes
        self.stops = tuple(s for s in stops if s)
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self.loop_max_period = loop_max_period
        self.ids: list[int] = []  # every accepted token, released or not
        self.tags: list[Tag] = []  # one per id
        self._pieces: list[bytes] = []
        self.released = 0  # tokens released so far
        self.hold = 0  # the last `hold` accepted tokens stay unreleased until the answer ends
        self.whole = False  # the client is sent the whole answer at its end: what was released may be withdrawn
        self.text = ""  # their text
        self.stopped_at: int | None = None  # tokens kept when a stop string matched

    def push(self, token: int, tag: Tag) -> None:
        self.ids.append(token)
        self.tags.append(tag)
        self._pieces.append(self._bytes([token]))

    def truncate(self, n: int) -> None:
        """Forget accepted tokens past n (a loop withheld at the end); never below what was released."""
        n = max(n, self.released)
        del self.ids[n:]
        del self.tags[n:]
        del self._pieces[n:]

    def withdraw(self) -> None:
        """Forget every token, released or not: only for an answer its client reads whole (`whole`),
        which nothing of has been sent yet."""
        assert self.whole, "a streamed answer's released tokens are the client's"
        self.ids, self.tags, self._pieces = [], [], []
        self.released, self.text, self.stopped_at = 0, "", None

    def keep_one_period(self, period: int) -> None:
        """An answer that ends on a loop of `period` tokens keeps one copy of the repeated pattern."""
        self.truncate(loop_start(self.ids, period) + period)

    def _loop_hold(self) -> int:
        """Tokens from the end that the loop rule holds back."""
        ids, n, hold = self.ids, len(self.ids), 0
        for p in range(1, min(self.loop_max_period, n - 1) + 1):
            if ids[-1] != ids[-1 - p]:
                continue
            start = loop_start(ids, p)
            if n - start > p:
                hold = max(hold, n - start - p)
        return hold

    def release(self, final: bool = False) -> tuple[int, str]:
        """Release what is safe now: returns (new tokens released, their text). With `final`
        (the answer ended), everything left is released except a trailing partial character.
        When a stop string matches, the tokens before it are released, `stopped_at` is set, and
        nothing more is released."""
        if self.stopped_at is not None:
            return 0, ""
        end = len(self.ids) if final else len(self.ids) - max(self._loop_hold() if self.loop_max_period else 0,
                                                              self.hold)
        start = self.released
        if end <= start:
            return 0, ""
        # Cumulative byte ends of the candidate tokens.
        data = b"".join(self._pieces[start:end])
        cuts, acc = [], 0
        for piece in self._pieces[start:end]:
            acc += len(piece)
            cuts.append(acc)
        # The longest candidate prefix that ends on a whole character.
        k = end - start
        while k > 0 and not _complete(data[: cuts[k - 1]]):
            k -= 1
        if k == 0:
            return 0, ""
        text = decode(data[: cuts[k - 1]])
        if self.stops:
            k, text = self._stop_cut(start, k, cuts, data, text, final)
        self.released = start + k
        self.text += text
        return k, text

    def _stop_cut(self, start: int, k: int, cuts: list[int], data: bytes, text: str,
                  final: bool) -> tuple[int, str]:
        """Within k candidate tokens: stop at a matched stop string, or hold a possible start of one."""
        tail = self.text[-self._max_stop:] if self._max_stop else ""
        window = tail + text
        hit = min((i for i in (window.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            limit = max(hit - len(tail), 0)  # characters of `text` before the stop string
            keep = self._keep_within(k, cuts, data, limit)
            self.stopped_at = start + keep
            return keep, decode(data[: cuts[keep - 1]]) if keep else ""
        if final:
            return k, text
        # Hold the tokens that overlap the longest suffix of the window that begins a stop string.
        held_chars = 0
        for s in self.stops:
            for m in range(min(len(s) - 1, len(window)), 0, -1):
                if window.endswith(s[:m]):
                    held_chars = max(held_chars, m)
                    break
        if held_chars == 0:
            return k, text
        keep = self._keep_within(k, cuts, data, len(text) - held_chars)
        return keep, decode(data[: cuts[keep - 1]]) if keep else ""

    @staticmethod
    def _keep_within(k: int, cuts: list[int], data: bytes, limit: int) -> int:
        """The most of k tokens whose text fits in `limit` characters and ends on a whole one."""
        keep = 0
        while keep < k and len(decode(data[: cuts[keep]])) <= limit:
            keep += 1
        while keep > 0 and not _complete(data[: cuts[keep - 1]]):
            keep -= 1
        return keep

    @property
    def final_ids(self) -> list[int]:
        return self.ids[: self.released]
