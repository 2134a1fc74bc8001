"""The offline judge of one answer: is it garbage? Pure functions on text and token ids.

An answer is garbage when it shows any of the incident's symptoms:

    nan_text          "NaN NaN NaN": three or more NaN words in a row
    replacement_char  U+FFFD inside the text (a trailing one from a max_tokens cut mid-character
                      is not counted)
    black_squares     a run of three or more U+25A0 / U+25A1 / U+2588 / U+2B1B
    loop              degenerate repetition, by measures the step guard does not use (the neural
                      text degeneration literature): rep-4, the share of the answer's token
                      4-grams that repeat an earlier one, at least LOOP_REP4 over at least
                      LOOP_MIN_TOKENS tokens, and the text compresses well (zlib ratio at least
                      LOOP_ZLIB; short texts, whose ratio zlib's overhead hides, by rep-4 alone).
                      Calibrated on 64 normal prompts x 128 int4 tokens: clean answers reach rep-4
                      0.43 / zlib 3.0 (a poem's refrain 0.68 / 3.98); the model's own loops
                      ('a sanctuary of the soul, a sanctuary of ...') 0.77-0.82 / 5.6-6.1.
                      The guard's rule (a periodic tail, `find_repetition`) is not used here, so
                      "guarded loops 0%" does not hold by construction.
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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

_NAN_RUN = re.compile(r"(?i)(?:\bnan\b[\W_]*){3,}")
_SQUARES = re.compile("[\u25a0\u25a1\u2588\u2b1b]{3,}")
LOOP_REP4 = 0.6
LOOP_ZLIB = 4.0
LOOP_MIN_TOKENS = 12
ZLIB_MIN_BYTES = 200  # below this zlib's fixed overhead dominates the ratio
TOKEN0_FLOOD = 3
IMPLAUSIBLE_NLL = 4.0  # nats per token under the fp32 reference
REASONS = ("nan_text", "replacement_char", "black_squares", "loop", "token0_flood", "empty", "implausible")


@dataclass(frozen=True)
class Verdict:
    reasons: tuple[str, ...]
    rep4: float = 0.0
    zlib_ratio: float | None = None

    @property
    def garbage(self) -> bool:
        return bool(self.reasons)


def rep_n(token_ids: Sequence[int], n: int = 4) -> float:
    """The share of n-grams that repeat an earlier n-gram of the same sequence (rep-n)."""
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def zlib_ratio(text: str) -> float | None:
    """Raw UTF-8 bytes over zlib-compressed bytes (None for text too short to say)."""
    data = text.encode("utf-8", "surrogatepass")
    return len(data) / len(zlib.compress(data, 9)) if len(data) >= ZLIB_MIN_BYTES else None


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
    r4, z = rep_n(token_ids), zlib_ratio(text)
    if len(token_ids) >= LOOP_MIN_TOKENS and r4 >= LOOP_REP4 and (z is None or z >= LOOP_ZLIB):
        reasons.append("loop")
    if sum(1 for t in token_ids if t == 0) >= TOKEN0_FLOOD:
        reasons.append("token0_flood")
    if not text.strip():
        reasons.append("empty")
    if nll is not None and nll > IMPLAUSIBLE_NLL:
        reasons.append("implausible")
    return Verdict(tuple(reasons), r4, z)
