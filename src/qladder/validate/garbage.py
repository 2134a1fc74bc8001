"""The offline judge of one answer: is it garbage? Pure functions on text and token ids.

An answer is garbage when it shows any of the incident's symptoms:

    nan_text          "NaN NaN NaN": three or more NaN words in a row
    replacement_char  U+FFFD inside the text (a trailing one from a max_tokens cut mid-character
                      is not counted)
    black_squares     a run of three or more U+25A0 / U+25A1 / U+2588 / U+2B1B
    loop              the token tail repeats a short pattern (period <= 16) at least 6 times over
                      at least 12 tokens (qladder.health.find_repetition)
    token0_flood      token id 0 (`<|endoftext|>`, what argmax returns on an all-NaN or all-zero
                      row) three or more times
    empty             nothing but whitespace
    implausible       fluent-looking nonsense (`' the] is 3 the  the]'`): the full-precision model,
                      reading the answer after the same prompt, gives its tokens a mean negative
                      log-likelihood over IMPLAUSIBLE_NLL nats (each token ~55x less likely than
                      e^-1 on average). Clean answers of the int4 and fp32 rungs score 0.1-1.5;
                      a corrupted scale's 6.9-7.6, NaN or zero rows' 10-11. Needs the score,
                      so it is judged only where the replay computed one.

The judge is stricter than the step guard on short answers on purpose (the guard's repetition
check waits for 32 tokens); it runs after the fact and never sees the logits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from qladder.health.repetition import find_repetition

_NAN_RUN = re.compile(r"(?i)(?:\bnan\b[\W_]*){3,}")
_SQUARES = re.compile("[\u25a0\u25a1\u2588\u2b1b]{3,}")
LOOP_MAX_PERIOD = 16
LOOP_MIN_REPEATS = 6
LOOP_MIN_SPAN = 12
TOKEN0_FLOOD = 3
IMPLAUSIBLE_NLL = 4.0  # nats per token under the fp32 reference
REASONS = ("nan_text", "replacement_char", "black_squares", "loop", "token0_flood", "empty", "implausible")


@dataclass(frozen=True)
class Verdict:
    reasons: tuple[str, ...]
    loop_period: int | None = None

    @property
    def garbage(self) -> bool:
        return bool(self.reasons)


def mean_nll(logprobs: Sequence[float]) -> float | None:
    return -sum(logprobs) / len(logprobs) if logprobs else None


def judge(text: str, token_ids: Sequence[int], truncated: bool = False, nll: float | None = None) -> Verdict:
    """`truncated`: the answer was cut by max_tokens (so one partial character may end it);
    `nll`: the answer's mean negative log-likelihood under the fp32 reference, when scored."""
    reasons = []
    if _NAN_RUN.search(text):
        reasons.append("nan_text")
    body = text.rstrip("\ufffd") if truncated and text.endswith("\ufffd") and len(text) - len(
        text.rstrip("\ufffd")) <= 3 else text
    if "\ufffd" in body:
        reasons.append("replacement_char")
    if _SQUARES.search(text):
        reasons.append("black_squares")
    period = find_repetition(list(token_ids), 1, LOOP_MAX_PERIOD, LOOP_MIN_REPEATS, LOOP_MIN_SPAN)
    if period is not None:
        reasons.append("loop")
    if sum(1 for t in token_ids if t == 0) >= TOKEN0_FLOOD:
        reasons.append("token0_flood")
    if not text.strip():
        reasons.append("empty")
    if nll is not None and nll > IMPLAUSIBLE_NLL:
        reasons.append("implausible")
    return Verdict(tuple(reasons), period)
