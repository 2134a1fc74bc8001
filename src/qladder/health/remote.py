"""The step guard for a remote rung: what a serving engine's stream tells about each token.

A remote engine (llama.cpp's server, vLLM) samples the token itself and streams it with its
log-probability and the top-k alternatives; the logits row never leaves the server. So the checks
are those the stream allows, before the token is forwarded:

- nonfinite: the token's logprob (or any top-k logprob) is missing, NaN or infinite, or -9999.0
  (vLLM's OpenAI layer clamps -inf there). llama-server on a NaN row streams `logprob: null` and
  top-k ids 0, 1, 2 (vLLM samples token 0).
- flat: the most likely token's probability is under `exp(flat_gap) / V`, the bound the in-process
  guard puts on a row (a collapsed, uniform distribution).
- mismatch: the server's text for the token is not what the shared vocabulary says (a tokenizer
  or transport fault, or ids the stream left out: the text would not be the ids).
- diffuse: the top-1 log-probability, averaged over the last `diffuse_window` tokens, is under
  `diffuse_logprob` (the distribution has diffused: a corrupted weight's finite garbage, which the
  checks above pass); before the first full window, the mean of the answer's first 2.. tokens
  under `diffuse_first_logprob`. Only where a higher rung exists to take over: a soft signal
  (bench/calibrate_diffuse.py).
- repetition: the accepted ids loop (the in-process guard's own rule, `StepGuard.check_repetition`).
- verify (`check_draft`): a flagged input's answer (the input defence changed it, or its prompt
  holds a lone byte's id) has its first `verify_tokens` scored by the rung above (the
  full-precision standby, in one prefill) before any is released; the first token the standby
  finds more than e^`verify_gap` times less likely than the rung that drew it is refused, and the
  answer continues from the tokens before it on the standby. The way speculative decoding checks
  a draft, with a tolerance: an INT4 rung's clean answers differ from fp32's, a corrupted one's
  are tokens fp32 would not say (bench/calibrate_verify.py).
The driver adds `deadline` (an inter-token gap past `step_deadline_s`) and `engine_error` (a
dropped connection, a 5xx, a malformed chunk).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from qladder.health.guard import StepGuard
from qladder.types import Hazard


@dataclass(frozen=True)
class RemoteToken:
    """One streamed token: its id, the server's logprob for it, the text the server sent with it (its
    bytes, when the server says), and the top-k (id, logprob)."""

    token_id: int
    logprob: float | None
    token_bytes: bytes | None
    top: tuple[tuple[int, float | None], ...] = ()


class Scored(NamedTuple):
    """A draft token as the rung above scored it: its logprob there, its rank (1: that rung's own
    argmax on the same context), and that argmax (`best`, where the scorer says)."""

    logprob: float
    rank: int
    best: int | None = None


CLAMPED = -9999.0  # vLLM's JSON stand-in for a -inf logprob


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > CLAMPED


def check_remote(guard: StepGuard, tok: RemoteToken, generated: Sequence[int], rung: str, n_vocab: int,
                 expected_bytes: bytes | None, top1: Sequence[float] = (), can_climb: bool = False) -> Hazard | None:
    """top1: this rung's top-1 logprobs of the tokens before this one (for `diffuse`); can_climb: a
    higher rung exists."""
    c = guard.config
    step = len(generated)
    if c.check_logits:
        bad = [lp for lp in (tok.logprob, *(v for _, v in tok.top)) if not _finite(lp)]
        if bad:
            return Hazard("nonfinite", rung, step, float("nan"), None,
                          detail=f"the server streamed a {'null' if bad[0] is None else bad[0]} logprob "
                                 f"for token {tok.token_id}")
        best = max(v for v in (tok.logprob, *(v for _, v in tok.top)) if v is not None)
        bound = c.flat_gap - math.log(n_vocab)
        if best < bound:
            return Hazard("flat", rung, step, best, bound, detail="the top probability is under the flat bound")
        if expected_bytes is not None and tok.token_bytes is not None and tok.token_bytes != expected_bytes:
            return Hazard("mismatch", rung, step, detail=f"token {tok.token_id}: the server sent "
                                                         f"{tok.token_bytes!r}, the vocabulary says {expected_bytes!r}")
        r = c.remote
        w = r.diffuse_window
        if can_climb and r.diffuse_logprob is not None and len(top1) >= 1:
            recent = [*top1[max(0, len(top1) - (w - 1)):], best]
            bound = r.diffuse_logprob if len(recent) >= w else r.diffuse_first_logprob  # a prefix
            mean = sum(recent) / len(recent)
            if mean < bound:
                return Hazard("diffuse", rung, step, mean, bound,
                              detail=f"the top-1 logprob averaged {mean:.2f} over the last {len(recent)} tokens")
    return guard.check_repetition(generated, rung)  # as in-process: the loop in the ids accepted so far


def check_draft(draft: Sequence[int], own: Sequence[float], standby: Sequence[float], rung: str, by: str,
                gap: float, start: int = 0) -> Hazard | None:
    """The first draft token (the answer's tokens from index `start`) whose logprob under the
    standby (`by`) is more than `gap` nats under its logprob on the rung that drew it (`own`);
    None when every one passes. A NaN from the standby says nothing (passes); its -inf (or
    vLLM's -9999.0 clamp) refuses."""
    for i, (t, lq, lp) in enumerate(zip(draft, own, standby, strict=True)):
        if math.isnan(lp) or not math.isfinite(lq):
            continue
        if lq - lp > gap:
            return Hazard("verify", rung, start + i, lq - lp, gap,
                          detail=f"{by} gives token {t} a logprob of {lp:.2f}, against {lq:.2f} on {rung}")
    return None
