"""Responses and stream chunks in the OpenAI API's shape, plus qladder's extension object.

`finish_reason` keeps to OpenAI's values (`stop`, `length`) so that clients do not break; how the
answer was really served (qladder's own finish reason, such as `repetition` or `degraded`, tokens
per rung, hazards, handoffs, input changes) is in `"qladder"`: in the response body, in the last
chunk of a stream, and summed up in `x-qladder-*` response headers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qladder.sanitize import SanitizeResult
from qladder.types import FinishReason, GenerationResult, TokenLogprob

OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.REPETITION: "stop",
                 FinishReason.DEGRADED: "stop", FinishReason.ABORT: "stop", FinishReason.ERROR: "stop"}

TokenBytes = Callable[[Sequence[int]], bytes]


@dataclass
class Served:
    """What the gateway knows of a request besides its result: where it started and why, and
    what the input defence changed."""

    request_id: str
    created: int
    model: str
    pool: str
    route: str
    reports: list[SanitizeResult] = field(default_factory=list)
    return_token_ids: bool = False

    def input_changes(self) -> list[dict[str, Any]]:
        return [asdict(c) for r in self.reports for c in r.changes]


def extension(s: Served, res: GenerationResult | None) -> dict[str, Any]:
    ext: dict[str, Any] = {"request_id": s.request_id, "pool": s.pool, "route": s.route,
                           "input_changes": s.input_changes()}
    if res is not None:
        ext.update({"finish_reason": str(res.finish_reason), "degraded": res.degraded, "fallback": res.fallback,
                    "tokens_per_rung": dict(Counter(res.token_rungs)),
                    "hazards": [h.to_dict() for h in res.hazards],
                    "handoffs": [h.to_dict() for h in res.handoffs],
                    "timings": {k: round(v, 3) for k, v in res.timings.items()}})
        if s.return_token_ids:
            ext.update({"token_ids": list(res.token_ids), "token_rungs": list(res.token_rungs)})
    return ext


def headers(s: Served, res: GenerationResult | None) -> dict[str, str]:
    h = {"x-qladder-request-id": s.request_id, "x-qladder-pool": s.pool, "x-qladder-route": s.route,
         "x-qladder-input-changes": str(len(s.input_changes()))}
    if res is not None:
        per_rung = Counter(res.token_rungs)
        h.update({"x-qladder-finish-reason": str(res.finish_reason),
                  "x-qladder-tokens-per-rung": ",".join(f"{r}={n}" for r, n in per_rung.items()),
                  "x-qladder-hazards": str(len(res.hazards)), "x-qladder-handoffs": str(len(res.handoffs))})
    return h


def usage(res: GenerationResult) -> dict[str, int]:
    n = len(res.token_ids)
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n}


# -- logprobs ------------------------------------------------------------------------------------


def _piece(token_bytes: TokenBytes, token: int) -> tuple[str, list[int]]:
    b = token_bytes([token])
    return b.decode("utf-8", "replace"), list(b)


def chat_logprobs(lps: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    content = []
    for lp in lps:
        tok, b = _piece(token_bytes, lp.token_id)
        top = []
        for tid, v in lp.top:
            t, tb = _piece(token_bytes, tid)
            top.append({"token": t, "logprob": v, "bytes": tb})
        content.append({"token": tok, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(lps: Sequence[TokenLogprob], token_bytes: TokenBytes, offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok, _ = _piece(token_bytes, lp.token_id)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({_piece(token_bytes, tid)[0]: v for tid, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# -- whole responses -----------------------------------------------------------------------------


def chat_response(s: Served, res: GenerationResult, token_bytes: TokenBytes) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": res.text},
                              "logprobs": None, "finish_reason": OPENAI_FINISH[res.finish_reason]}
    if res.logprobs is not None:
        choice["logprobs"] = chat_logprobs(res.logprobs, token_bytes)
    return {"id": f"chatcmpl-{s.request_id}", "object": "chat.completion", "created": s.created, "model": s.model,
            "choices": [choice], "usage": usage(res), "qladder": extension(s, res)}


def completion_response(s: Served, res: GenerationResult, token_bytes: TokenBytes) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": res.text, "logprobs": None,
                              "finish_reason": OPENAI_FINISH[res.finish_reason]}
    if res.logprobs is not None:
        choice["logprobs"] = completion_logprobs(res.logprobs, token_bytes, 0)
    return {"id": f"cmpl-{s.request_id}", "object": "text_completion", "created": s.created, "model": s.model,
            "choices": [choice], "usage": usage(res), "qladder": extension(s, res)}


# -- stream chunks ---------------------------------------------------------------------------------


def chat_chunk(s: Served, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": f"chatcmpl-{s.request_id}", "object": "chat.completion.chunk", "created": s.created,
            "model": s.model, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def completion_chunk(s: Served, text: str, finish: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": f"cmpl-{s.request_id}", "object": "text_completion", "created": s.created, "model": s.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(s: Served, res: GenerationResult, chat: bool) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{s.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": s.created,
            "model": s.model, "choices": [], "usage": usage(res)}
