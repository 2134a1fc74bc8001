"""The records a generation produces: hazards, handoffs, the result, and finish reasons."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

# The one default answer length: the library's SamplingParams, `qladder generate`, and the server's
# `default_max_tokens` (a request that names none). A legacy completion without max_tokens keeps
# OpenAI's own default (server/protocol.py), as OpenAI-compatible clients expect.
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the rung that produced it (the raw logits row,
    before temperature and top-p), and the `k` most likely alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context was reached
    REPETITION = "repetition"  # the model's own loop, confirmed by the reference rung
    DEGRADED = "degraded"  # a hazard with no rung left: the safe fallback answer
    ABORT = "abort"  # the client went away (or aborted): decoding stopped, the slot freed
    ERROR = "error"  # an engine failure with no defence (a bare configuration): a 5xx


@dataclass(frozen=True)
class Hazard:
    """One failed health check. `step` is the index of the token that was about to be produced."""

    check: str  # nonfinite | flat | magnitude | repetition | activation | outlier | engine_error | deadline
    #             remote rungs also: mismatch (the stream's text is not its ids') | diffuse
    #             and audit: an endpoint the audit's test ejected (health/detector.py; step 0, value
    #             the CUSUM statistic, threshold its bound)
    rung: str
    step: int
    value: float | None = None
    threshold: float | None = None
    layer: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: a non-finite value is written as text ("nan", "inf")."""
        d = asdict(self)
        for key in ("value", "threshold"):
            v = d[key]
            if v is not None and not math.isfinite(v):
                d[key] = str(v)
        return d


@dataclass(frozen=True)
class Handoff:
    """The context moved from one rung to another, as token ids."""

    from_rung: str
    to_rung: str
    step: int
    latency_ms: float  # hazard detected -> first healthy logits on the next rung
    caught_up_tokens: int  # ids the next rung had to evaluate at handoff time
    warm: bool  # whether a warm shadow had prefilled ahead of time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FALLBACK_TEXT = "I'm sorry, I could not complete this answer reliably. Please try again."


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    token_rungs: list[str]
    finish_reason: FinishReason
    prompt_tokens: int
    hazards: list[Hazard] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    fallback: bool = False  # the text is (or ends in) the safe fallback answer
    timings: dict[str, float] = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)  # per emitted token after the first
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    endpoints: list[str] = field(default_factory=list)  # the replicas that wrote its INT4 tokens (a pool of them)

    @property
    def degraded(self) -> bool:
        """Served at least partly off the first rung, or by the fallback answer."""
        return bool(self.handoffs) or self.fallback

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "token_rungs": self.token_rungs,
            "rung": self.token_rungs[-1] if self.token_rungs else None,
            "finish_reason": str(self.finish_reason),
            "degraded": self.degraded,
            "fallback": self.fallback,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "hazards": [h.to_dict() for h in self.hazards],
            "handoffs": [h.to_dict() for h in self.handoffs],
            "timings": self.timings,
            "endpoints": self.endpoints,
        }


# -- the events of one request, as a client receives them (qladder.serving) ---------------------------


@dataclass(frozen=True)
class TokenEvent:
    """Tokens released to the client: ids, the rung that produced each, and their text (whole
    characters only; see qladder.stream)."""

    request_id: str
    token_ids: list[int]
    rungs: list[str]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass(frozen=True)
class HazardEvent:
    request_id: str
    hazard: Hazard


@dataclass(frozen=True)
class HandoffEvent:
    request_id: str
    handoff: Handoff


@dataclass(frozen=True)
class FinalEvent:
    """The last event of every request: its result (text == the released text, token ids agree)."""

    request_id: str
    result: GenerationResult


Event = TokenEvent | HazardEvent | HandoffEvent | FinalEvent
