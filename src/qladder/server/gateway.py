"""The gateway between the HTTP routes and the engine client: requests in, answers out.

    prepared = gw.prepare_chat(body)          input defence, template, tokens, sampling (4xx errors)
    request, served = gw.admit(prepared)      route (quarantine, weights, breakers) -> engine Request
    async for line in gw.sse(request, served, chat=True): ...     the SSE stream of one answer
    answer = await gw.complete(request, served, chat=True)        the whole answer

It depends on the `EngineClient` protocol only. Its observer (`observe`, called by the engine on
its own threads with every event) feeds the metrics, the breakers (one outcome per finished
request, for the pool it started on) and the quarantine (a prompt whose INT4 hazard led to a
handoff). The tokenizer is the GGUF's vocabulary alone, under a lock of its own.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qladder.audit import DriftWatch
from qladder.classify import classify
from qladder.client import AsyncEvents, EngineClient, Request
from qladder.errors import Draining, EngineFailed, InputError, UnknownModel, Unsupported
from qladder.incidents import prompt_hash
from qladder.model import Message
from qladder.prepare import Preparer
from qladder.sampling import SamplingParams
from qladder.sanitize import SanitizeResult
from qladder.server import openai_format as fmt
from qladder.server.breaker import Breaker
from qladder.server.metrics import ServerMetrics
from qladder.server.protocol import ChatCompletionRequest, CompletionRequest
from qladder.server.quarantine import Quarantine
from qladder.server.router import Route, Router
from qladder.server.shared_state import StateSync
from qladder.testing import seam as fault_seam
from qladder.types import DEFAULT_MAX_TOKENS, Event, FinalEvent, FinishReason, GenerationResult, HazardEvent, TokenEvent

if TYPE_CHECKING:
    from qladder.testing.faults import Fault

ERROR_CHECKS = frozenset({"engine_error", "deadline"})  # the engine failed, not the numbers
NOT_THE_PROMPTS = ERROR_CHECKS | {"audit"}  # (and the audit's ejection: the endpoint's verdict) never quarantine


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    prompt_text: str | None
    reports: list[SanitizeResult]
    params: SamplingParams
    faults: tuple[Fault, ...]
    return_token_ids: bool = False  # the answer's ids and rungs in the "qladder" extension
    verified: bool = False  # verified decoding (the request's or the pool's precision)
    prompt_class: str | None = None  # qladder.classify's


class Gateway:
    def __init__(self, client: EngineClient, preparer: Preparer, token_bytes: Callable[[Sequence[int]], bytes],
                 n_vocab: int, model_name: str, router: Router, breakers: dict[str, Breaker], quarantine: Quarantine,
                 metrics: ServerMetrics, default_max_tokens: int = DEFAULT_MAX_TOKENS, allow_faults: bool = False,
                 standby_sessions: int = 0, control_ids: frozenset[int] = frozenset(),
                 precision: str = "fast", verifies: bool = False, drift: DriftWatch | None = None):
        """precision: the INT4 pool's default ("fast" or "verified"); verifies: whether the engine
        can serve verified requests (an in-process INT4 pool and standby); drift: the audit's
        per-class agreement (a class under its bound is served verified, unless a request asks
        for "fast")."""
        self.client = client
        self.preparer = preparer
        self.token_bytes = token_bytes
        self.n_vocab = n_vocab
        self.model_name = model_name
        self.router = router
        self.breakers = breakers
        self.quarantine = quarantine
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.allow_faults = allow_faults
        self.standby_sessions = standby_sessions
        self.control_ids = control_ids  # the template's tokens: a token-id prompt's defence keeps them
        self.precision = precision
        self.verifies = verifies
        self.drift = drift
        self.n_ctx = min(client.n_ctx)
        self.draining = False
        self.state: StateSync | None = None  # the shared state's sync ([state] backend = "redis")
        self._tok_lock = threading.Lock()  # the vocabulary's tables are built lazily: one user at a time
        self._routes: dict[str, tuple[Route, str, bool]] = {}  # request id -> (route, fingerprint, outcome sent)
        self._routes_lock = threading.Lock()
        client.add_observer(self.observe)
        client.add_observer(metrics.observe)

    # -- requests in -------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise UnknownModel(f"the model {name!r} does not exist here; this server serves {self.model_name!r}")

    def _faults(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[Fault, ...]:
        specs = body.qladder.faults if body.qladder is not None else []
        if not specs:
            return ()
        if not self.allow_faults:
            raise Unsupported("qladder.faults", "fault injection is disabled on this server "
                                                "(the operator starts it with --allow-faults)")
        return fault_seam.parse(specs)  # test machinery: loaded only for a faulted request

    def _verified(self, body: ChatCompletionRequest | CompletionRequest, prompt_class: str) -> bool:
        asked = body.qladder.precision if body.qladder is not None else None
        if asked is None and self.verifies and self.drift is not None and self.drift.verify(prompt_class):
            return True  # the audit finds INT4 drifting on this class: full precision's answers
        verified = (asked or self.precision) == "verified"
        if verified and not self.verifies:
            raise Unsupported("qladder.precision", "verified decoding needs an in-process INT4 pool and an "
                                                   "in-process full-precision standby; this server has none")
        return verified

    @staticmethod
    def _return_ids(body: ChatCompletionRequest | CompletionRequest) -> bool:
        return body.qladder is not None and body.qladder.return_token_ids

    def _params(self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                logprobs: int | None) -> SamplingParams:
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        return SamplingParams(max_tokens=max_tokens or self.default_max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                              seed=seed % (2**63), stop=body.stops(), logprobs=logprobs)

    def _fits(self, ids: Sequence[int], params: SamplingParams) -> None:
        if not ids:
            raise InputError("the prompt is empty (after the input defence)")
        if len(ids) + params.max_tokens > self.n_ctx:
            raise InputError(f"this model's context is {self.n_ctx} tokens; the request needs {len(ids)} "
                             f"for the prompt and max_tokens={params.max_tokens} for the answer")

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        body.check()
        self.check_model(body.model)
        faults = self._faults(body)
        params = self._params(body, body.limit(), (body.top_logprobs or 0) if body.logprobs else None)
        messages: list[Message] = [{"role": m.role, "content": m.text()} for m in body.messages]
        with self._tok_lock:
            ids, reports = self.preparer.encode_messages(messages, params.max_tokens)
        self._fits(ids, params)  # the incident store keeps the sanitized prompt (what the engine saw)
        user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
        cls = classify(user, any(r.changed for r in reports))
        return Prepared(ids, "\n".join(r.text for r in reports), reports, params, faults, self._return_ids(body),
                        self._verified(body, cls), cls)

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        body.check()
        self.check_model(body.model)
        faults = self._faults(body)
        params = self._params(body, body.max_tokens, body.logprobs)
        prompt = body.single_prompt()
        text: str | None
        if isinstance(prompt, str):
            with self._tok_lock:
                ids, rep = self.preparer.encode_text(prompt, params.max_tokens)
            text, reports = rep.text, [rep]
        else:  # token ids: checked against the vocabulary, then the defence on the text they spell
            n_vocab = self.n_vocab
            bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise InputError(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
            with self._tok_lock:
                ids, reports = self.preparer.defend_ids(prompt, self.token_bytes, self.control_ids)
            text = "\n".join(r.text for r in reports) if reports else None
        self._fits(ids, params)
        cls = classify(text, any(r.changed for r in reports))
        return Prepared(ids, text, reports, params, faults, self._return_ids(body), self._verified(body, cls), cls)

    def admit(self, p: Prepared, streamed: bool = True) -> tuple[Request, fmt.Served]:
        """Route and build the engine request (nothing is submitted yet; `streamed`: the client
        reads the answer as it is written, else whole at its end)."""
        if self.draining:
            raise Draining("the server is shutting down")
        fp = prompt_hash(p.prompt_ids)
        stats = self.client.stats()
        busy = int(stats.get("standby_active", 0)) + int(stats.get("standby_depth", 0))
        free = busy < self.standby_sessions
        down = frozenset() if stats.get("healthy", True) else frozenset({self.router.pools[0].name})
        route = self.router.route(fp, standby_free=free, down=down)
        rid = uuid.uuid4().hex[:24]
        req = self.client.request(p.prompt_ids, p.params, request_id=rid, faults=p.faults,
                                  prompt_text=p.prompt_text, start_rung=route.start_rung,
                                  flagged=any(r.changed for r in p.reports), verified=p.verified,
                                  prompt_class=p.prompt_class, streamed=streamed)
        with self._routes_lock:
            self._routes[rid] = (route, fp, False)
        self.metrics.routes.labels(route.pool, route.reason.split(":")[0]).inc()
        return req, fmt.Served(rid, int(time.time()), self.model_name, route.pool, route.reason, p.reports,
                               p.return_token_ids)

    def forget(self, request_id: str) -> None:
        """A request that was admitted but never submitted (its submit raised)."""
        with self._routes_lock:
            self._routes.pop(request_id, None)

    # -- the engine's observer (engine threads) -------------------------------------------------------
    def observe(self, ev: Event) -> None:
        """A request's outcome reaches its pool's breaker at its first hazard on that pool (not when
        the answer ends on the standby, seconds later), or as a clean one when it finishes."""
        if isinstance(ev, HazardEvent):
            if ev.hazard.check == "audit":  # the endpoint's verdict (it is ejected), not this prompt's
                return
            with self._routes_lock:
                entry = self._routes.get(ev.request_id)
                if entry is None or entry[2] or ev.hazard.rung not in self._pool_rungs(entry[0]):
                    return
                self._routes[ev.request_id] = (entry[0], entry[1], True)
            error = ev.hazard.check in ERROR_CHECKS
            self.breakers[entry[0].pool].record(hazard=not error, error=error)
            return
        if not isinstance(ev, FinalEvent):
            return
        with self._routes_lock:
            entry = self._routes.pop(ev.request_id, None)
        if entry is None:
            return
        route, fp, recorded = entry
        res = ev.result
        if not recorded:
            self.breakers[route.pool].record(error=res.finish_reason is FinishReason.ERROR)
        first = self.client.rungs[0]
        if res.handoffs and any(h.rung == first and h.check not in NOT_THE_PROMPTS for h in res.hazards):
            self.quarantine.add(fp)
            self.metrics.quarantine_added.inc()

    def _pool_rungs(self, route: Route) -> set[str]:
        rungs = self.client.rungs
        return {rungs[0]} if route.start_rung == 0 else set(rungs[1:])

    # -- answers out (the HTTP loop) ---------------------------------------------------------------------
    async def complete(self, served: fmt.Served, chat: bool, agen: AsyncEvents
                       ) -> tuple[dict[str, Any], dict[str, str]]:
        """The whole answer, as the response body and its headers."""
        result: GenerationResult | None = None
        try:
            async for ev in agen:
                if isinstance(ev, FinalEvent):
                    result = ev.result
        finally:
            await agen.aclose()
        assert result is not None
        if result.finish_reason is FinishReason.ERROR:
            raise EngineFailed(_error_detail(result))
        build = fmt.chat_response if chat else fmt.completion_response
        return build(served, result, self.token_bytes), fmt.headers(served, result)

    async def sse(self, served: fmt.Served, chat: bool, include_usage: bool, agen: AsyncEvents) -> AsyncIterator[str]:
        """Server-sent events of one answer. A handoff mid-answer continues in the same stream:
        the text released by the next rung follows the text already sent, with no gap."""
        sent = ""
        try:
            if chat:
                yield _data(fmt.chat_chunk(served, {"role": "assistant", "content": ""}))
            async for ev in agen:
                if isinstance(ev, TokenEvent):
                    lp = None
                    if ev.logprobs is not None:
                        lp = (fmt.chat_logprobs(ev.logprobs, self.token_bytes) if chat
                              else fmt.completion_logprobs(ev.logprobs, self.token_bytes, len(sent)))
                    if ev.text or lp is not None:
                        sent += ev.text
                        yield _data(fmt.chat_chunk(served, {"content": ev.text}, logprobs=lp) if chat
                                    else fmt.completion_chunk(served, ev.text, logprobs=lp))
                elif isinstance(ev, FinalEvent):
                    res = ev.result
                    if res.finish_reason is FinishReason.ERROR:
                        body = {"error": {"message": _error_detail(res), "type": "engine_error", "param": None,
                                          "code": "engine_failed"}}
                        yield _data(body)
                        break
                    rest = res.text[len(sent):] if res.text.startswith(sent) else ""
                    finish = fmt.OPENAI_FINISH[res.finish_reason]
                    ext = fmt.extension(served, res)
                    last = (fmt.chat_chunk(served, {"content": rest} if rest else {}, finish) if chat
                            else fmt.completion_chunk(served, rest, finish))
                    if include_usage:
                        yield _data(last)
                        last = fmt.usage_chunk(served, res, chat)
                    last["qladder"] = ext
                    yield _data(last)
            yield "data: [DONE]\n\n"
        finally:
            await agen.aclose()


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_detail(res: GenerationResult) -> str:
    h = res.hazards[-1] if res.hazards else None
    return f"the engine failed: {h.detail or h.check}" if h is not None else "the engine failed"

