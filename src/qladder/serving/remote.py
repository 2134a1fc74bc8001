"""The remote pool: the ladder's rungs that live on serving engines over HTTP (llama-server as
rung 0, vLLM as the standby, or both), each streamed token judged before it is released.

One thread runs an asyncio loop that owns the HTTP client and every request while it is on a
remote rung (a `RequestMachine` is handed to the loop by `submit`, and away from it by
`forward`: one owner at a time). Per request, on remote rung j:

    stream = rungs[j].stream(context ids, params, tokens left)       (engines/remote*.py)
    each token: visit.judge(token, logprob, top-k, bytes, gap) -> hazard?  (remote_visit.py:
                the visit's top-1 window and drawn logprobs; a faulted request's TokenFaults first)
       ok     -> m.accept_token (released to the client; stop strings, EOS, length as in-process)
       hazard -> the stream is closed (the server stops decoding it), the bad token never
                 released, and the context (prompt + accepted ids) moves to the next rung: on
                 this pool if it is remote too, else `forward`ed (the in-process standby)
    a dropped connection, a 5xx, a malformed chunk or a gap past the deadline is a hazard too
    Verify(j) (a loop seen on an in-process rung): one greedy token from rung j decides
    a flagged input's first tokens, where the rung above can score (vLLM): held, then scored
       there in one prefill before any is released (`check_draft`); a refused token moves the
       answer to that rung from the tokens before it, as speculative decoding rejects a draft.
       Any other answer streams as its tokens pass the guard: fast mode spends no full-precision
       work on the path (the audit, off it, measures INT4's answers)

As rung 0 the pool has the INT4 scheduler's interface (submit, resubmit, healthy, stats), so
ServingEngine drives either. While a rung's server is unreachable the rung is unhealthy (for
rung 0: new requests go straight to the standby) and its /health is probed every `probe_every_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass

import httpx

from qladder.actions import Confirm, Done, Drafted, Leave, Move, MoveTo, Verify
from qladder.engines.remote import RemoteAt, RemoteEnd, RemoteResumed, RemoteRung, next_item
from qladder.errors import (
    ConfigError,
    EndpointsDownError,
    EngineDeadError,
    EngineError,
    QueueFullError,
    RemoteStreamError,
    StreamSilentError,
    server_down,
)
from qladder.health.remote import RemoteToken, check_draft
from qladder.machine import RequestMachine
from qladder.sampling import SamplingParams
from qladder.serving.aborts import AbortRegistry
from qladder.serving.prefills import PrefillLedger
from qladder.serving.remote_verified import run_verified
from qladder.serving.remote_visit import RemoteVisit
from qladder.testing import seam as fault_seam
from qladder.types import FinishReason, Hazard, TokenLogprob

_log = logging.getLogger("qladder.remote")

Forward = Callable[[RequestMachine, Leave], None]


@dataclass(frozen=True)
class RemoteConfig:
    max_inflight: int = 64  # requests streaming from (or queued at) the servers; more: QueueFullError
    connect_timeout_s: float = 5.0
    probe_every_s: float = 1.0
    # The wait for a stream's first token covers the server's queue and the prefill, not one
    # decode step: the guard's step deadline applies from the second token on.
    first_token_timeout_s: float = 30.0
    # The standby's check of a suspect draft waits as long as a first token may (the standby may be
    # busy with handoffs: a suspect draft released unchecked is the failure the check is for);
    # past it, or on the standby's error, the draft is released unchecked (counted in `unchecked`).
    check_timeout_s: float = 30.0
    # The inter-token deadline owes a server's silence to the other prompts it was prefilling
    # meanwhile, at its own measured rate (serving/prefills.py); False: the fixed gap alone.
    prefill_allowance: bool = True


class RemotePool:
    def __init__(self, rungs: Mapping[int, RemoteRung], aborts: AbortRegistry, config: RemoteConfig | None = None,
                 forward: Forward | None = None, clock: Callable[[], float] = time.perf_counter):
        """rungs: ladder index -> remote rung. forward: where a request goes for a rung not here
        (raises QueueFullError when that pool is full); None: such a request gets the fallback."""
        self.rungs = dict(rungs)
        self.aborts = aborts
        self.config = config or RemoteConfig()
        self.forward = forward
        self.clock = clock
        self.health = dict.fromkeys(self.rungs, True)
        self.steps = 0  # tokens judged
        self.stalls = 0  # deadline hazards
        # per rung: the prompts its server is prefilling, what a stream's silence owes them (loop thread)
        self.prefills = {j: PrefillLedger(clock, self.config.first_token_timeout_s) for j in self.rungs}
        self.prefix_hits = 0
        # answers' first tokens the standby scored (passed, refused, could not say), streamed unscored
        # (an unflagged input's draft that stayed sure to its end), or not held (a prompt over
        # `verify_max_context`); written by the loop thread
        self.checks = {"passed": 0, "refused": 0, "unchecked": 0, "skipped": 0}
        self.verified = {"windows": 0, "drafted": 0, "stood": 0}  # verified decoding (remote_verified.py)
        self.bugs: list[BaseException] = []
        # set by the serving engine: whether the audit's test ejected rung 0's endpoint (a replica's
        # URL; None: the rung's only one), read on the loop's thread before each of its tokens
        self.ejected: Callable[[str | None], bool] | None = None
        self.withdrawn = 0  # answers taken off an endpoint the audit ejected mid-answer
        self._n = 0
        self._on: dict[int, int] = dict.fromkeys(self.rungs, 0)  # requests streaming per rung (loop thread)
        self._lock = threading.Lock()  # guards _n (submitting threads, the loop)
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._probers: dict[int, asyncio.Future[None]] = {}
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="qladder-remote", daemon=True)
        self._thread.start()
        self._started.wait(10)

    # -- any thread ---------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Rung 0's server answers (True when rung 0 is not remote)."""
        return self.health.get(0, True)

    @property
    def verifies(self) -> bool:
        """Whether verified greedy requests draft here: rung 0 and a rung 1 that scores."""
        above = self.rungs.get(1)
        return 0 in self.rungs and above is not None and above.can_score

    @property
    def check_timeout_s(self) -> float:
        return self.config.check_timeout_s

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None  # made by the loop's thread before any request runs
        return self._client

    @property
    def slots_in_use(self) -> int:
        return self._on.get(0, 0)

    @property
    def depth(self) -> int:
        r0 = self.rungs.get(0)
        return max(0, self._on.get(0, 0) - r0.n_slots) if r0 is not None else 0  # queued at the server

    @property
    def standby_active(self) -> int:
        return sum(n for j, n in self._on.items() if j > 0)

    def submit(self, m: RequestMachine, action: Leave | None = None) -> None:
        """Take over a request: a new one on rung m.rung (action None), or one moving here
        (MoveTo/Verify of a rung of this pool). Raises QueueFullError when full."""
        if not self._thread.is_alive():
            raise EngineDeadError("the remote pool's thread is gone")
        if isinstance(action, Drafted):  # the serving engine refuses verified requests with a remote verifier
            raise ConfigError("verified decoding needs an in-process verifying rung")
        with self._lock:
            if self._n >= self.config.max_inflight:
                raise QueueFullError(f"{self._n} requests are in flight on the remote rungs", retry_after_s=1.0)
            self._n += 1
        asyncio.run_coroutine_threadsafe(self._serve(m, action), self._loop)

    def resubmit(self, m: RequestMachine) -> None:
        """A request the standby hands back to rung 0 (policy `return_after`)."""
        self.submit(m, MoveTo(0, poisoned=False))

    def wake(self) -> None:
        """Aborts are seen at the request's next token; nothing to wake."""

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the loop's thread (what a rung owns is changed there only)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def spawn(self, work: Callable[[httpx.AsyncClient], Coroutine[object, object, None]]) -> None:
        """Run `work(client)` on the loop, beside the requests (an ejected replica's probe); a bug
        in it is kept, as a request's."""
        async def run() -> None:
            try:
                await work(self.client)
            except Exception as exc:  # (a bug: close() reports it)
                self.bugs.append(exc)
                _log.exception("background work on the remote pool failed")

        asyncio.run_coroutine_threadsafe(run(), self._loop)

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
        # No keep-alive: llama-server closes kept-alive connections after a few requests, and a
        # request sent on a closed one fails without an answer.
        limits = httpx.Limits(max_connections=self.config.max_inflight, max_keepalive_connections=0)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, m: RequestMachine, action: Move | None) -> None:
        try:
            await self._drive(m, action)
        except asyncio.CancelledError:
            m.finish(FinishReason.ABORT)  # the pool closes
        except Exception as exc:  # a bug of our own: the request still ends, close() raises it
            _log.exception("remote pool failed on request %s", m.request_id)
            self.bugs.append(exc)
            m.finish(FinishReason.DEGRADED, fallback=True)
        finally:
            with self._lock:
                self._n -= 1

    async def _drive(self, m: RequestMachine, action: Move | None) -> None:
        """Run the request on this pool's rungs until it ends or leaves for a rung not here."""
        if action is None and m.req.verified and m.rung == 0 and self.verifies:
            self._on[0] += 1
            try:
                action = await run_verified(self, m)
            finally:
                self._on[0] -= 1
            if action is None:
                return
        while True:
            if isinstance(action, Done):
                return
            if isinstance(action, Verify):
                if action.rung not in self.rungs:
                    return self._leave(m, action)
                action = m.on_verify(await self._greedy_token(m, action.rung))
                continue
            j = m.rung if action is None else action.rung
            if j not in self.rungs:
                assert action is not None  # a new request starts on a rung of this pool
                return self._leave(m, action)
            if m.rung != j:
                m.moved(j, len(m.context), warm=False)
            action = await self._stream(m, j)
            if action is None:
                return

    def _leave(self, m: RequestMachine, action: Leave) -> None:
        if self.forward is None:
            m.finish(FinishReason.DEGRADED, fallback=True)
            return
        try:
            self.forward(m, action)
        except QueueFullError:  # nothing is lost: the request ends with the explicit fallback
            m.finish(FinishReason.DEGRADED, fallback=True)

    async def _stream(self, m: RequestMachine, j: int) -> Move | None:
        """Stream the request on remote rung j; None when it ended (done or aborted), else where
        it goes next (a hazard's move, or a policy move)."""
        assert self._client is not None
        rung = self.rungs[j]
        self._on[j] += 1
        visit = RemoteVisit(m)
        try:
            hazard = await self._tokens(m, rung, j, visit)
        except EndpointsDownError as exc:  # every replica of the rung is out: down until one answers
            self._set_healthy(j, False)
            hazard = self._error(m, str(exc))
        except RemoteStreamError as exc:
            hazard = self._error(m, str(exc))
        except httpx.HTTPError as exc:
            self._set_healthy(j, False)
            hazard = self._error(m, f"{rung.name} connection failed: {exc!r}")
        finally:
            self._on[j] -= 1
        if isinstance(hazard, Hazard):
            return m.on_hazard(hazard, None)
        return hazard

    def _error(self, m: RequestMachine, detail: str) -> Hazard:
        return Hazard("engine_error", m.rungs[m.rung], m.step, detail=detail)

    async def _tokens(self, m: RequestMachine, rung: RemoteRung, j: int, visit: RemoteVisit
                      ) -> Hazard | MoveTo | Verify | None:
        """Judge and release the streamed tokens. None: the request ended (done or aborted); a
        Hazard (the stream is closed on return: the server stops this request); or a policy move."""
        assert self._client is not None  # made by the loop's thread before any request runs
        deadline = m.config.guard.step_deadline_s
        faults = fault_seam.token_faults(m.req.faults) if j == 0 else None  # step faults hit the rung under test only
        if visit.ended():  # what the visit released (the last rung's held tokens) ended it
            return None
        n_check = self._hold_window(visit, j)
        prompt = self.prefills[j].sent(len(m.context))
        watched = j == 0 and self.ejected is not None and not m.req.probe
        endpoint: str | None = None  # the replica writing what follows (RemoteAt)
        stream = rung.stream(self._client, m.context, m.params, max(1, m.params.max_tokens - m.step))
        try:
            async with contextlib.aclosing(stream) as items:
                last = self.clock()
                while True:
                    if self.aborts.is_aborted(m.request_id):
                        m.finish(FinishReason.ABORT)
                        return None
                    # With no rung above, a slow token has nowhere better to go: only a hung server
                    # (first_token_timeout_s of silence) ends the answer there.
                    patient = prompt.waiting or j + 1 >= len(m.rungs)
                    try:  # the inter-token deadline, while the server is silent
                        item = await next_item(items, functools.partial(self.gap_limit, j, patient, deadline, last))
                    except StreamSilentError as exc:
                        self.stalls += 1
                        limit = exc.limit
                        owed = "" if patient else f" ({max(0.0, limit - deadline):.1f} s owed to prompts prefilled)"
                        return Hazard("deadline", m.rungs[m.rung], m.step, self.clock() - last, limit,
                                      detail=f"{rung.name} sent no token within {limit:.1f} s{owed}")
                    except StopAsyncIteration:
                        raise RemoteStreamError(f"{rung.name}'s stream ended without an end") from None
                    if isinstance(item, RemoteAt):  # which replica writes what follows (the audit's endpoint)
                        if j == 0:
                            m.served_by(item.endpoint)
                            endpoint = item.endpoint
                        continue
                    if isinstance(item, RemoteResumed):  # a replica died: its sibling prefills the context
                        m.rec.migrated()
                        prompt.resent(len(m.context))
                        last = self.clock()
                        continue
                    if watched and self.ejected is not None and self.ejected(endpoint):
                        # the audit ejected the endpoint writing it: the rest is the standby's (an
                        # answer its client reads whole starts again there: machine.on_hazard)
                        self.withdrawn += 1
                        return Hazard("audit", m.rungs[m.rung], m.step,
                                      detail=f"the audit ejected {endpoint or rung.name}")
                    was_first = patient
                    if prompt.answered():
                        self._set_healthy(j, True)
                    if isinstance(item, RemoteEnd):
                        if m.unchecked and (refused := await self._check_draft(visit, j)) is not None:
                            return refused
                        m.finish(FinishReason.LENGTH if item.length else FinishReason.STOP)
                        return None
                    limit = self.gap_limit(j, was_first, deadline, last)  # what this gap was allowed
                    now = self.clock()
                    took, last = (0.0 if was_first else now - last), now  # the TTFT, or the last rung's gap
                    self.steps += 1
                    t = item.token_id
                    expected = rung.detokenize_bytes([t]) if 0 <= t < rung.n_vocab else None
                    judged = item
                    if faults is not None:  # test machinery: the token as the request's faults make it
                        try:  # (judged so; an accepted one still reports the server's own logprob)
                            judged, took = faults.token(item, took, m.step, rung.n_vocab)
                        except EngineError as exc:
                            return self._error(m, str(exc))
                    hazard = visit.judge(judged, took, rung.n_vocab, expected, limit)
                    if hazard is not None:
                        if hazard.check == "deadline":
                            self.stalls += 1
                        return hazard
                    if visit.ended():  # what the visit released completed a stop string
                        return None
                    lp = _logprob(item, m.params.logprobs) if m.params.logprobs is not None else None
                    action = m.accept_token(t, lp, item.top if j == 0 else None)  # (the top-k: the audit's)
                    if isinstance(action, Done):  # a stop string in what was released (before any held window)
                        return None
                    if m.unchecked and (isinstance(action, Confirm | MoveTo | Verify) or m.step >= n_check):
                        if (refused := await self._check_draft(visit, j)) is not None:
                            return refused
                        if m.done is not None:  # the released window completed a stop string
                            return None
                        last = self.clock()  # the server kept decoding meanwhile: the gap restarts here
                    if isinstance(action, Confirm):
                        m.finish(action.reason)
                        return None
                    if isinstance(action, Done):
                        return None
                    if isinstance(action, (MoveTo, Verify)):  # a policy move (not a hazard)
                        return action
        finally:  # (a prompt answered or not, its stream is over)
            prompt.close()

    def gap_limit(self, j: int, patient: bool, deadline: float, since: float) -> float:
        """How long rung j's stream may be silent since `since`: a first token's wait (or any
        token's on the last rung), else the step deadline plus what the silence owes to the
        prompts the server was prefilling meanwhile (serving/prefills.py)."""
        if patient:
            return max(deadline, self.config.first_token_timeout_s)
        if not self.config.prefill_allowance:
            return deadline
        return deadline + self.prefills[j].owed(since)

    def _hold_window(self, visit: RemoteVisit, j: int) -> int:
        """Hold a flagged input's answer's first `verify_tokens` on rung j (the draft) for the rung
        above to score before any is released. The step at which it is checked (0: none, and the
        answer streams as its tokens pass the guard: no full-precision work on the path)."""
        m, g = visit.m, visit.m.config.guard
        d = g.draft
        above = self.rungs.get(j + 1)
        if (m.step != 0 or not g.check_logits or d.verify_tokens <= 0 or above is None
                or not above.can_score or not self.health[j + 1] or not self._flagged(m, j)):
            return 0
        if len(m.context) > d.verify_max_context:
            self.checks["skipped"] += 1
            return 0
        visit.await_draft_check(d.verify_tokens)
        return d.verify_tokens

    async def _check_draft(self, visit: RemoteVisit, j: int) -> Hazard | None:
        """Score the held draft on rung j + 1 (one prefill); the refusal, or None (released)."""
        assert self._client is not None
        m = visit.m
        above, g = self.rungs[j + 1], m.config.guard
        start = visit.held_from
        draft = m.accepted[start:]
        own = visit.drawn[start - visit.start:start - visit.start + len(draft)]
        if not draft:  # an answer that ended at once: nothing to score or release
            visit.draft_checked()
            return None
        try:
            scored = await asyncio.wait_for(above.score(self._client, m.context[:len(m.prompt) + start], draft),
                                            self.config.check_timeout_s)
        except (RemoteStreamError, httpx.HTTPError, TimeoutError) as exc:
            _log.warning("request %s: %s could not check its draft (%r); released unchecked",
                         m.request_id, above.name, exc)
            if server_down(exc):  # no more checks until it answers
                self.unhealthy(j + 1)
            self.checks["unchecked"] += 1
            visit.draft_checked()
            return None
        refused = check_draft(draft, own, [s.logprob for s in scored], m.rungs[m.rung], above.name,
                              g.draft.verify_gap, start)
        self.checks["refused" if refused else "passed"] += 1
        if refused is None:
            visit.draft_checked()
        return refused

    def _flagged(self, m: RequestMachine, j: int) -> bool:
        """Whether the request's input is already flagged: the input defence changed it (or the
        router sent it as suspect), or its prompt holds a lone byte's id."""
        if m.req.flagged:
            return True
        lone = self.rungs[j].lone_byte_ids
        return any(t in lone for t in m.prompt)

    async def _greedy_token(self, m: RequestMachine, j: int) -> int | None:
        """Rung j's greedy next token on the request's context (None: it could not say)."""
        assert self._client is not None
        rung = self.rungs[j]
        try:
            async with contextlib.aclosing(rung.stream(self._client, m.context, SamplingParams(max_tokens=1), 1)) as s:
                async for item in s:
                    if isinstance(item, RemoteToken):
                        return item.token_id
        except (RemoteStreamError, httpx.HTTPError):
            pass
        return None

    def unhealthy(self, j: int) -> None:
        """Rung j's server failed a request (the loop thread): probe it until it answers."""
        self._set_healthy(j, False)

    def _set_healthy(self, j: int, ok: bool) -> None:
        if ok:
            self.health[j] = True
        elif self.health[j]:
            self.health[j] = False
            self._probers[j] = asyncio.ensure_future(self._probe(j))

    async def _probe(self, j: int) -> None:
        assert self._client is not None
        while not self.health[j]:
            await asyncio.sleep(self.config.probe_every_s)
            if await self.rungs[j].alive(self._client):
                self.health[j] = True


def _logprob(tok: RemoteToken, k: int | None) -> TokenLogprob:
    top = tuple((i, float(v)) for i, v in tok.top[: k or 0] if v is not None)
    return TokenLogprob(tok.token_id, float(tok.logprob) if tok.logprob is not None else float("nan"), top)
