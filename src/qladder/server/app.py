"""The HTTP layer (FastAPI): thin routes over the `Gateway`, OpenAI-style errors, auth, body limits.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /healthz (alive)   GET /readyz (engines loaded, pools not all open)   GET /metrics (Prometheus)

Every error is an OpenAI error body with a 4xx (5xx only for an engine that failed with no rung
left, 502, or a bug, 500): malformed JSON and wrong types 400, unknown model 404, a body past
`max_body_bytes` 413, a full queue 429 with Retry-After, every breaker open or a drain 503.
A client that disconnects aborts its request (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qladder.errors import (
    AllPoolsOpen,
    ClientDisconnected,
    ConfigError,
    Draining,
    EngineDeadError,
    EngineFailed,
    InputError,
    QueueFullError,
    UnknownModel,
    Unsupported,
)
from qladder.server import openai_format as fmt
from qladder.server.breaker import BreakerMode
from qladder.server.gateway import Gateway
from qladder.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

_log = logging.getLogger("qladder.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body past `limit` bytes gets 413, whether it says so in
    Content-Length or streams it chunked (then reading stops at the limit)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:  # read the whole body here, bounded: a streamed body past the limit stops early
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = _error(413, f"the request body is larger than {self.limit} bytes", code="body_too_large")
        await resp(scope, receive, send)


ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


class CountRequests:
    """ASGI middleware: every API response counted by endpoint and status (whatever produced it:
    a route, a validation error, the body limit, auth); a client gone before any response is 499."""

    def __init__(self, app: ASGIApp, metrics: Any):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counted(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status.append(int(msg["status"]))
            await send(msg)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()


def create_app(gw: Gateway, api_keys: frozenset[str] = frozenset(), max_body_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="qladder", version="0.1.0",
                  description="An OpenAI-compatible gateway over a precision ladder of INT4 and full-precision pools.")

    # -- errors: every one an OpenAI error body --------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                          code="invalid_json")
        return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid')}" + (
            f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""), param=loc or None, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _bug(_r: Request, exc: Exception) -> JSONResponse:
        _log.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    def _refusal(exc: Exception) -> JSONResponse:
        if isinstance(exc, Unsupported):
            return _error(400, str(exc), param=exc.param, code="unsupported_parameter")
        if isinstance(exc, UnknownModel):
            return _error(404, str(exc), "not_found_error", "model", "model_not_found")
        if isinstance(exc, (InputError, ConfigError)):
            return _error(400, str(exc), code="invalid_value")
        if isinstance(exc, QueueFullError):
            gw.metrics.rejected.labels("queue_full").inc()
            return _error(429, f"{exc}; retry later", "rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
        if isinstance(exc, AllPoolsOpen):
            gw.metrics.rejected.labels("breakers_open").inc()
            return _error(503, str(exc), "server_error", code="pools_open", headers={"Retry-After": "5"})
        if isinstance(exc, Draining):
            return _error(503, str(exc), "server_error", code="draining", headers={"Connection": "close"})
        if isinstance(exc, EngineDeadError):
            return _error(503, f"the engine is down: {exc}", "server_error", code="engine_dead")
        if isinstance(exc, EngineFailed):
            return _error(502, str(exc), "server_error", code="engine_failed")
        raise exc

    # -- auth -------------------------------------------------------------------------------------------
    async def authorized(request: Request) -> None:
        if not api_keys:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys):
            raise StarletteHTTPException(401, "a valid API key is required (Authorization: Bearer <key>)",
                                         headers={"WWW-Authenticate": "Bearer"})

    # -- the OpenAI routes ------------------------------------------------------------------------------
    async def _serve(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        chat = isinstance(body, ChatCompletionRequest)
        try:
            prepared = gw.prepare_chat(body) if isinstance(body, ChatCompletionRequest) else gw.prepare_completion(body)
            req, served = gw.admit(prepared, streamed=bool(body.stream))
            try:
                agen = gw.client.generate(req)
            except BaseException:
                gw.forget(req.request_id)
                raise
        except Exception as exc:
            return _refusal(exc)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gw.sse(served, chat, include_usage, agen), media_type="text/event-stream",
                                     headers={**fmt.headers(served, None), "Cache-Control": "no-cache"})
        try:
            out, headers = await _until_disconnect(request, gw.complete(served, chat, agen))
        except ClientDisconnected:
            await agen.aclose()
            return Response(status_code=499)  # nobody reads it; counted as the client's disconnect
        except Exception as exc:
            return _refusal(exc)
        return JSONResponse(out, headers=headers)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(request, body)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(request, body)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": 0,
                                            "owned_by": "qladder", "max_model_len": gw.n_ctx}]}

    # -- operations -------------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        breakers = {name: str(b.mode) for name, b in gw.breakers.items()}
        all_open = all(m == BreakerMode.OPEN for m in breakers.values())
        ready = gw.client.ready and not all_open and not gw.draining
        state = gw.state.describe() if gw.state is not None else {"backend": "memory"}
        body = {"ready": ready, "engine_ready": gw.client.ready, "draining": gw.draining, "breakers": breakers,
                "state": state, "stats": gw.client.stats()}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(CountRequests, metrics=gw.metrics)  # (outermost: sees the 413s)
    return app


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected

