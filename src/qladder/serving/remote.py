"""Rung 0 on a remote serving engine (llama.cpp's `llama-server`): each request streams from it,
and every streamed token is judged before it is released.

One thread runs an asyncio loop that owns the HTTP client and every request while it is on the
remote rung (a `RequestMachine` is handed over to the loop by `submit`, and on a hazard to the
standby's queue: one owner at a time). Per request:

    POST /completion {prompt: context ids, stream, n_probs, return_tokens}
    each token: m.judge_remote(token, logprob, top-k, bytes, gap) -> hazard?
       ok     -> m.accept_token (released to the client; stop strings, EOS, length as in-process)
       hazard -> the stream is closed (llama-server stops decoding it), the bad token never
                 released, and the context (prompt + accepted ids) moves to the standby
    a dropped connection, a 5xx, a malformed chunk or a gap past the deadline is a hazard too

The pool's interface is the INT4 scheduler's (submit, resubmit, healthy, stats), so ServingEngine
drives either. While the server is unreachable the pool is unhealthy (new requests go straight to
the standby) and probes its /health every `probe_every_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from qladder.engines.remote_llama import LlamaServerRung
from qladder.errors import EngineDeadError, QueueFullError
from qladder.health.remote import RemoteToken
from qladder.machine import Done, MoveTo, RequestMachine
from qladder.sampling import TokenLogprob
from qladder.serving.aborts import AbortRegistry
from qladder.serving.standby import StandbyPool
from qladder.types import FinishReason, Hazard

_log = logging.getLogger("qladder.remote")


@dataclass(frozen=True)
class RemoteConfig:
    max_inflight: int = 64  # requests streaming from (or queued at) the server; more: QueueFullError
    connect_timeout_s: float = 5.0
    probe_every_s: float = 1.0


class RemotePool:
    def __init__(self, rung: LlamaServerRung, standby: StandbyPool | None, aborts: AbortRegistry,
                 config: RemoteConfig | None = None, clock: Callable[[], float] = time.perf_counter):
        self.rung = rung
        self.standby = standby
        self.aborts = aborts
        self.config = config or RemoteConfig()
        self.clock = clock
        self.healthy = True
        self.steps = 0  # tokens judged
        self.stalls = 0  # deadline hazards
        self.prefix_hits = 0
        self.bugs: list[BaseException] = []
        self._n = 0
        self._lock = threading.Lock()  # guards _n (submitting threads, the loop)
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._prober: asyncio.Future[None] | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="qladder-remote", daemon=True)
        self._thread.start()
        self._started.wait(10)

    # -- any thread ---------------------------------------------------------------------------------
    @property
    def slots_in_use(self) -> int:
        return self._n

    @property
    def depth(self) -> int:
        return max(0, self._n - self.rung.n_slots)  # queued at the server, beyond its slots

    def submit(self, m: RequestMachine) -> None:
        self._take(m, None)

    def resubmit(self, m: RequestMachine, started: float) -> None:
        self._take(m, started)

    def _take(self, m: RequestMachine, started: float | None) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("the remote pool's thread is gone")
        with self._lock:
            if self._n >= self.config.max_inflight:
                raise QueueFullError(f"{self._n} requests are in flight on {self.rung.base_url}", retry_after_s=1.0)
            self._n += 1
        asyncio.run_coroutine_threadsafe(self._serve(m, started), self._loop)

    def wake(self) -> None:
        """Aborts are seen at the request's next token; nothing to wake."""

    def close(self) -> None:
        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        if self.bugs:
            raise EngineDeadError(f"the remote pool hit {len(self.bugs)} bug(s): {self.bugs[0]!r}") from self.bugs[0]

    # -- the loop thread ----------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        timeout = httpx.Timeout(None, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=self.config.max_inflight, max_keepalive_connections=0)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, m: RequestMachine, started: float | None) -> None:
        try:
            await self._stream(m, started)
        except asyncio.CancelledError:
            m.finish(FinishReason.ABORT)  # the pool closes
        except Exception as exc:  # a bug of our own: the request still ends, close() raises it
            _log.exception("remote pool failed on request %s", m.request_id)
            self.bugs.append(exc)
            m.finish(FinishReason.DEGRADED, fallback=True)
        finally:
            with self._lock:
                self._n -= 1

    async def _stream(self, m: RequestMachine, started: float | None) -> None:
        assert self._client is not None
        rung = self.rung
        body = rung.body(m.context, m.params, max(1, m.params.max_tokens - m.step))
        deadline = m.config.guard.step_deadline_s
        hazard: Hazard | None = None
        if started is not None:
            m.moved(0, started, len(m.context), warm=False)  # a policy return to rung 0
        try:
            async with self._client.stream("POST", f"{rung.base_url}/completion", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:200]
                    hazard = self._error(m, f"llama-server answered HTTP {r.status_code}: {text}")
                else:
                    self._set_healthy(True)
                    hazard = await self._tokens(m, r, deadline)
        except httpx.HTTPError as exc:
            self._set_healthy(False)
            hazard = self._error(m, f"llama-server connection failed: {exc!r}")
        if hazard is None:
            return
        action = m.on_hazard(hazard, None)
        if isinstance(action, Done):
            return
        assert isinstance(action, MoveTo)
        if self.standby is None:
            m.finish(FinishReason.DEGRADED, fallback=True)
        else:
            self.standby.submit(m, action, self.clock())

    def _error(self, m: RequestMachine, detail: str) -> Hazard:
        return Hazard("engine_error", m.rungs[m.rung], m.step, detail=detail)

    async def _tokens(self, m: RequestMachine, r: httpx.Response, deadline: float) -> Hazard | None:
        """Judge and release the streamed tokens; None when the request ended (done or aborted)."""
        lines = r.aiter_lines()
        last = self.clock()
        while True:
            if self.aborts.is_aborted(m.request_id):
                m.finish(FinishReason.ABORT)
                return None
            try:  # the inter-token deadline, while the server is silent
                line = await asyncio.wait_for(anext(lines), timeout=deadline + 0.05) if deadline < 1e9 \
                    else await anext(lines)
            except TimeoutError:
                self.stalls += 1
                return Hazard("deadline", m.rungs[m.rung], m.step, self.clock() - last, deadline,
                              detail="llama-server sent no token within the deadline")
            except StopAsyncIteration:
                return self._error(m, "llama-server's stream ended before its last chunk")
            if not line.startswith("data: "):
                continue
            try:
                chunk = json.loads(line[6:])
                toks = [int(t) for t in chunk.get("tokens") or []]
            except (ValueError, TypeError) as exc:
                return self._error(m, f"a malformed chunk from llama-server: {exc}")
            if "error" in chunk:
                return self._error(m, f"llama-server: {str(chunk['error'])[:200]}")
            probs = chunk.get("completion_probabilities") or []
            for i, t in enumerate(toks):
                now = self.clock()
                took, last = now - last, now
                tok = _remote_token(t, probs[i] if i < len(probs) else {})
                self.steps += 1
                expected = None if t in self.rung.eos_ids else self.rung.detokenize_bytes([t])
                hazard = m.judge_remote(tok, took, self.rung.n_vocab, expected)
                if hazard is not None:
                    if hazard.check == "deadline":
                        self.stalls += 1
                    return hazard  # the stream is closed on return: the server stops this request
                lp = _logprob(tok, m.params.logprobs) if m.logprobs is not None else None
                action = m.accept_token(t, lp)
                if isinstance(action, Done):
                    return None
                if isinstance(action, MoveTo):  # a policy move (not a hazard)
                    assert self.standby is not None
                    self.standby.submit(m, action, self.clock())
                    return None
            if chunk.get("stop"):
                reason = FinishReason.LENGTH if chunk.get("stop_type") == "limit" else FinishReason.STOP
                m.finish(reason)
                return None

    def _set_healthy(self, ok: bool) -> None:
        if ok:
            self.healthy = True
        elif self.healthy:
            self.healthy = False
            self._prober = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        assert self._client is not None
        while not self.healthy:
            await asyncio.sleep(self.config.probe_every_s)
            with contextlib.suppress(httpx.HTTPError):
                if (await self._client.get(f"{self.rung.base_url}/health", timeout=2.0)).status_code == 200:
                    self.healthy = True


def _remote_token(t: int, p: dict[str, Any]) -> RemoteToken:
    raw = p.get("bytes")
    top = tuple((int(x.get("id", -1)), x.get("logprob")) for x in p.get("top_logprobs") or [])
    return RemoteToken(t, p.get("logprob"), bytes(raw) if isinstance(raw, list) else None, top)


def _logprob(tok: RemoteToken, k: int | None) -> TokenLogprob:
    top = tuple((i, float(v)) for i, v in tok.top[: k or 0] if v is not None)
    return TokenLogprob(tok.token_id, float(tok.logprob) if tok.logprob is not None else float("nan"), top)
