"""The offline judge of one answer: is it garbage? Pure functions on text and token ids.

The judge never sees the logits and does not use the step guard's rules, so "guarded garbage 0%"
cannot hold by construction. An answer is garbage when it shows any of these symptoms, judged
from the ids and the text alone:

    nan_text          "NaN NaN NaN": three or more NaN words in a row
    replacement_char  U+FFFD anywhere in the answer (a cut mid-character included), unless the
                      prompt itself, after sanitizing, holds one
    control_chars     a run of CONTROL_RUN or more control characters (C0 other than tab, newline
                      and carriage return; DEL; C1), unless the prompt holds that run
    black_squares     a run of three or more U+25A0 / U+25A1 / U+2588 / U+2B1B
    token_flood       one token id FLOOD_RUN or more times in a row (`......` is token 30 x 32;
                      token 0, what argmax returns on an all-NaN or all-zero row, is one case),
                      unless the text spells a number that long (SmolLM2 has one token a digit:
                      1000000 is six 0 tokens)
    char_flood        one character, not a space or a digit, FLOOD_RUN or more times in a row
                      ("!!!!!!", "(((((("): text whose ids were merged differently still shows
                      it. The characters of rules and ellipses (- = _ * # ~ .), which markdown,
                      code and prose repeat, flood only when the run is at least half the
                      answer's visible characters ("......" alone, not a table's |------|)
    token0_flood      token id 0 (`<|endoftext|>`) three or more times, anywhere
    empty             nothing but whitespace (an answer of zero tokens included)

Repetition alone is not a symptom. rep-4 (the share of the answer's token 4-grams that repeat an
earlier one) and the zlib ratio are measured and kept (`Verdict.rep4`, `zlib_ratio`) but decide
nothing: full precision's own greedy answers to plain requests loop as hard as a fault does (a haiku
about winter, "A winter's night, a winter's night, ...": rep-4 0.81, zlib 5.8; a short song 0.74 /
5.1; the int4 rung's own loops 0.77-0.82 / 5.6-6.1), so a rule on them calls full precision's
answers garbage. A loop a numeric fault makes is caught by what fp32 thinks of it (` place}/ right}/
right}/`: 2.2 nats/token; `{\nAnother\n\nAnother`: 2.0) or by a flood; a loop fp32 finds as likely
as its own answers is the model's, not the number format's.

and, where the answer was scored:

    implausible       fluent-looking nonsense (`This\nYou areS\nYou areS`, `' the] is 3 the  the]'`):
                      the full-precision model, reading the answer after the same prompt ids, gives
                      its tokens a mean negative log-likelihood over the calibrated threshold. The
                      threshold is never hand-set: `calibrate` derives it from the train half's
                      normal answers of a run (calibration.QUANTILE of their scores plus
                      calibration.MARGIN nats), and the run writes it into its figures. A run
                      with too few such answers of its own (a quick run, a load benchmark) uses
                      the calibration of the committed full run (judge_calibration.json, written
                      by `python -m qladder.validate.calibration DIR`).

An answer whose likelihood was asked for and could not be computed is `unjudged` (unless a
symptom already makes it garbage): it is neither clean nor garbage, and it is counted.
"""

from __future__ import annotations

import math
import re
import unicodedata
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qladder.validate.judge_calibration import committed

_NAN_RUN = re.compile(r"(?i)(?:\bnan\b[\W_]*){3,}")
_SQUARES = re.compile("[\u25a0\u25a1\u2588\u2b1b]{3,}")
ZLIB_MIN_BYTES = 200  # below this zlib's fixed overhead dominates the ratio
FLOOD_RUN = 6
CONTROL_RUN = 2
TOKEN0_FLOOD = 3
REASONS = ("nan_text", "replacement_char", "control_chars", "black_squares", "token_flood", "char_flood",
           "token0_flood", "empty", "implausible")
_CHAR_FLOOD = re.compile(r"([^\s\d])\1{" + str(FLOOD_RUN - 1) + ",}")
_DIGIT_RUN = re.compile(r"(\d)\1*")
GUARD_ENDED = ("repetition", "degraded")  # finishes where the guard, not the model, ended the answer
RULE_CHARS = frozenset("-=_*#~.")  # repeated by markdown rules, code separators and ellipses


@dataclass(frozen=True)
class Verdict:
    """The judge's word on one answer. `scored`: the likelihood was computed; `unjudged`: it was
    asked for, failed, and no symptom decided alone."""

    reasons: tuple[str, ...] = ()
    scored: bool = False
    nll: float | None = None
    unjudged: bool = False
    rep4: float = 0.0
    zlib_ratio: float | None = None

    @property
    def garbage(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"garbage": self.garbage, "reasons": list(self.reasons), "scored": self.scored, "nll": self.nll,
                "unjudged": self.unjudged, "rep4": self.rep4, "zlib_ratio": self.zlib_ratio}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(tuple(d["reasons"]), d["scored"], d["nll"], d["unjudged"], d["rep4"], d["zlib_ratio"])


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


def longest_run(ids: Sequence[int]) -> tuple[int, int | None]:
    """(length, id) of the longest run of one token id."""
    best, best_id, run = 0, None, 0
    for i, t in enumerate(ids):
        run = run + 1 if i and ids[i - 1] == t else 1
        if run > best:
            best, best_id = run, t
    return best, best_id


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) == "Cc" and ch not in "\t\n\r"


def _control_runs(text: str) -> list[str]:
    runs, cur = [], ""
    for ch in text:
        if _is_control(ch):
            cur += ch
        else:
            if len(cur) >= CONTROL_RUN:
                runs.append(cur)
            cur = ""
    if len(cur) >= CONTROL_RUN:
        runs.append(cur)
    return runs


def symptoms(text: str, token_ids: Sequence[int], prompt: str = "") -> tuple[list[str], float, float | None]:
    """The symptoms of an answer (no likelihood), its rep-4 and zlib ratio. `prompt`: the text the
    engine was given after sanitizing (a U+FFFD or control run it holds may be echoed)."""
    reasons = []
    if _NAN_RUN.search(text):
        reasons.append("nan_text")
    if "\ufffd" in text and "\ufffd" not in prompt:
        reasons.append("replacement_char")
    if any(run not in prompt for run in _control_runs(text)):
        reasons.append("control_chars")
    if _SQUARES.search(text):
        reasons.append("black_squares")
    run = longest_run(token_ids)[0]
    if run >= FLOOD_RUN and not any(len(m.group(0)) >= run for m in _DIGIT_RUN.finditer(text)):
        reasons.append("token_flood")
    if _char_flood(text):
        reasons.append("char_flood")
    if sum(1 for t in token_ids if t == 0) >= TOKEN0_FLOOD:
        reasons.append("token0_flood")
    if not text.strip():
        reasons.append("empty")
    return reasons, rep_n(token_ids), zlib_ratio(text)


def _char_flood(text: str) -> bool:
    visible = sum(1 for ch in text if not ch.isspace())
    return any(m.group(1) not in RULE_CHARS or 2 * len(m.group(0)) >= visible for m in _CHAR_FLOOD.finditer(text))


def judge(text: str, token_ids: Sequence[int], prompt: str = "", nll: float | None = None,
          score_failed: bool = False, threshold: float | None = None) -> Verdict:
    """The verdict on one answer. `nll`: its mean negative log-likelihood under the fp32
    reference, when scored; `score_failed`: scoring was asked for and failed; `threshold`: the
    implausibility threshold (nats per token) of the run's calibration (None: the committed one)."""
    reasons, r4, z = symptoms(text, token_ids, prompt)
    if nll is not None and not math.isfinite(nll):  # no score to read: as if scoring had failed
        nll, score_failed = None, True
    if threshold is None:
        threshold = committed().threshold
    if nll is not None and nll > threshold:
        reasons.append("implausible")
    unjudged = score_failed and nll is None and not reasons
    return Verdict(tuple(reasons), nll is not None, nll, unjudged, r4, z)


def periodic_tail(ids: Sequence[int], max_period: int = 32, min_copies: int = 3) -> tuple[int, int] | None:
    """(start, period) of the longest tail of `ids` that repeats one pattern at least `min_copies`
    times (the earliest start; the shortest period among equals), or None."""
    n, best = len(ids), None
    for p in range(1, min(max_period, n // min_copies) + 1):
        s = n - p
        while s > 0 and ids[s - 1] == ids[s - 1 + p]:
            s -= 1
        if n - s >= min_copies * p and (best is None or s < best[0]):
            best = (s, p)
    return best


def same_answer(answer: Sequence[int], reference: Sequence[int], loop_slack: int = 4,
                finish: str | None = None) -> bool:
    """Is `answer` the reference's own (fp32 alone, greedy, on the same prompt ids)? The same ids
    (an answer cut by max_tokens may have dropped the up to 3 tokens of the character the cut fell
    inside), or, for a loop, the same loop (period, and a pattern one is a rotation of the other's)
    starting within `loop_slack` tokens, over as many tokens as the reference. An answer the guard
    ended early (finish "repetition" or "degraded") is the reference's only when it holds the whole
    reference: a prefix is not the answer."""
    n = len(answer)
    if list(answer) == list(reference[:n]) and (len(reference) == n
                                                or (finish == "length" and len(reference) - n <= 3)):
        return True
    if finish in GUARD_ENDED and n < len(reference):
        return False
    a, b = periodic_tail(answer), periodic_tail(reference)
    if a is None or b is None or a[1] != b[1] or abs(a[0] - b[0]) > loop_slack:
        return False
    p = a[1]
    pa, pb = list(answer[a[0]:a[0] + p]), list(reference[b[0]:b[0] + p])
    return any(pa[i:] + pa[:i] == pb for i in range(p))
