"""One remote rung served by several replicas of the same weights: a pool's `urls = [...]`.

    rung = Replicas([LlamaServerRung(info, u) for u in urls])     each tokenizer-probed at start
    async for item in rung.stream(client, ids, params, n)         one stream, whichever replica

Each replica (an endpoint) has its own health: a refused connection, a dropped stream or a 5xx
(`RemoteTransportError`) from a server whose `/health` then fails too (the server's fault, not
the model's) ejects it at once, and its `/health` is probed every `probe_every_s` until it
answers, when it rejoins. A server that fails a call and still answers `/health` failed that
request, not itself (a 5xx its input causes would fail every sibling alike): it stays in rotation
and the request's error reaches the pool, as from a single server. A new stream goes to
the healthy endpoint with the fewest streams in flight (past 8 endpoints, the better of two
picked at random: power of two choices).

A server that fails every request and still answers `/health` (a broken slot, a full disk, a
proxy in front of it answering 500) would otherwise stay in rotation forever: an outlier, as
Envoy's outlier detection calls it. An endpoint whose calls failed OUTLIER_FAILS times in a row
with its `/health` up, while a sibling answered a call since the first of them, is the server's
fault, not its requests': it is ejected for OUTLIER_COOLDOWN_S (doubled each time it is ejected
again before it answers one call, up to OUTLIER_COOLDOWN_MAX_S), then probed as any ejected
endpoint, and the call that ejected it goes on at a sibling. Requests that fail every replica
alike (their input) eject none: no sibling answered meanwhile.

An answer survives its server: when an endpoint fails mid-stream, the stream continues on a
healthy sibling from the ids it has already yielded (prompt + the answer so far, the budget
reduced by as many), so the caller (the remote pool, its guard and the client) sees one
uninterrupted stream (a `RemoteResumed` item tells the pool to wait for the sibling's first token
as for any first token: its queue and prefill, not one decode step). Every token yielded was one
the pool asked for after judging the one before, so the ids continued from are the answer's
accepted ids. A greedy answer continues
token-identical to its unbroken run (same weights, same kernels); a sampled one continues
validly, with other draws. Only when no sibling is healthy does the error reach the pool
(`EndpointsDownError`: the pool marks the rung down and probes it), which then climbs to the
next rung as for a single server; a stream migrates at most once per endpoint. Migration needs the whole state to be in
the token ids: a request with state outside them (grammar-constrained decoding, which qladder
does not send) could not be migrated. A malformed chunk or an error chunk is not a transport
failure (the answer may be what broke it): it reaches the pool as before.

Owned by the remote pool's loop thread: `stream`, the counters and the probes run only there
(the engine's `stats` reads the counters for metrics, as it reads the pool's).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import httpx

from qladder.engines.remote import RemoteEnd, RemoteItem, RemoteResumed
from qladder.engines.remote_llama import LlamaServerRung
from qladder.engines.remote_vllm import Verdict, VllmRung
from qladder.errors import ConfigError, EndpointsDownError, RemoteStreamError, RemoteTransportError
from qladder.health.remote import RemoteToken, Scored
from qladder.sampling import SamplingParams

TWO_CHOICES_PAST = 8
OUTLIER_FAILS = 3  # calls failed in a row, /health up, while a sibling answered: the endpoint is out
OUTLIER_COOLDOWN_S = 10.0  # for this long before its /health may bring it back; doubled each time it is
OUTLIER_COOLDOWN_MAX_S = 120.0  # ejected again before it answers a call, up to this
T = TypeVar("T")


class Replicas:
    """A RemoteRung over several endpoints of one kind (all llama-server, or all vLLM)."""

    def __init__(self, endpoints: Sequence[LlamaServerRung | VllmRung], probe_every_s: float = 1.0,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic):
        if not endpoints:
            raise ConfigError("a pool of replicas needs at least one url")
        first = endpoints[0]
        for e in endpoints[1:]:
            if type(e) is not type(first) or e.fingerprint != first.fingerprint:
                raise ConfigError(f"the replicas at {first.base_url} and {e.base_url} are not the same server "
                                  "and vocabulary")
        self.endpoints = list(endpoints)
        self.name, self.can_score, self.precision = first.name, first.can_score, first.precision
        self.base_url = ",".join(e.base_url for e in endpoints)  # (messages name the rung by it)
        self.n_ctx = min(e.n_ctx for e in endpoints)
        self.n_slots = sum(e.n_slots for e in endpoints)
        self.n_vocab, self.eos_ids = first.n_vocab, first.eos_ids
        self.probe_every_s = probe_every_s
        self.healthy = [True] * len(endpoints)
        self.inflight = [0] * len(endpoints)
        self.migrations = 0  # streams continued on a sibling after their endpoint failed
        self.ejections = 0  # endpoints taken out of rotation (each until its /health answers)
        self.rejoins = 0
        self._rng = rng or random.Random(0)
        self._probes: dict[int, asyncio.Future[None]] = {}
        self.clock = clock
        n = len(endpoints)
        self._streak = [0] * n  # calls failed in a row with /health up
        self._streak_since = [0.0] * n  # when the first of them failed
        self._last_ok = [float("-inf")] * n  # when the endpoint last answered a call
        self._times_out = [0] * n  # outlier ejections since it last answered a call
        self._out_until = [0.0] * n  # no rejoin before (an outlier's cooldown)

    # -- what the pool reads -------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.endpoints[0].fingerprint

    @property
    def lone_byte_ids(self) -> frozenset[int]:
        return self.endpoints[0].lone_byte_ids

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.endpoints[0].detokenize_bytes(token_ids)

    def tokenize(self, text: str, special: bool) -> list[int]:
        return self.endpoints[0].tokenize(text, special)

    def tokenize_bytes(self, data: bytes) -> list[int]:
        return self.endpoints[0].tokenize_bytes(data)

    def endpoint_stats(self) -> list[dict[str, object]]:
        return [{"url": e.base_url, "healthy": self.healthy[k], "in_flight": self.inflight[k]}
                for k, e in enumerate(self.endpoints)]

    # -- choosing an endpoint ------------------------------------------------------------------------
    def pick(self) -> int | None:
        """The healthy endpoint with the fewest streams in flight (None: none is healthy)."""
        up = [k for k, ok in enumerate(self.healthy) if ok]
        if not up:
            return None
        if len(up) > TWO_CHOICES_PAST:
            up = self._rng.sample(up, 2)
        return min(up, key=lambda k: (self.inflight[k], k))

    def eject(self, k: int) -> None:
        """Endpoint k failed a stream: out of rotation, probed until it answers (the loop thread;
        one probe per endpoint)."""
        if self.healthy[k]:
            self.healthy[k] = False
            self.ejections += 1
        probe = self._probes.get(k)
        if probe is None or probe.done():
            self._probes[k] = asyncio.ensure_future(self._probe(k))

    def _rejoin(self, k: int) -> None:
        if not self.healthy[k]:
            self.healthy[k] = True
            self.rejoins += 1

    def _may_rejoin(self, k: int) -> bool:
        return self.clock() >= self._out_until[k]

    async def _probe(self, k: int) -> None:
        async with httpx.AsyncClient() as client:
            while not self.healthy[k]:
                await asyncio.sleep(self.probe_every_s)
                if self._may_rejoin(k) and await self.endpoints[k].alive(client):
                    self._rejoin(k)
            # k is back (this probe saw it, or the pool's `alive` did): this probe is over before its
            # client closes, so an ejection meanwhile starts another
            if self._probes.get(k) is asyncio.current_task():
                del self._probes[k]

    async def alive(self, client: httpx.AsyncClient) -> bool:
        """Any endpoint answers (each that does rejoins)."""
        for k, e in enumerate(self.endpoints):
            if not self.healthy[k] and self._may_rejoin(k) and await e.alive(client):
                self._rejoin(k)
        return any(self.healthy)

    def _answered(self, k: int) -> None:
        """Endpoint k answered a call (a stream to its end, a score)."""
        self._streak[k] = self._times_out[k] = 0
        self._last_ok[k] = self.clock()

    def _outlier(self, k: int) -> bool:
        """Endpoint k failed a call with its /health up: whether that makes it an outlier (its
        OUTLIER_FAILS-th failure in a row, a sibling in rotation having answered since the first),
        and if so its cooldown."""
        now = self.clock()
        if self._streak[k] == 0:
            self._streak_since[k] = now
        self._streak[k] += 1
        if self._streak[k] < OUTLIER_FAILS or not any(
                self.healthy[j] and self._last_ok[j] >= self._streak_since[k] for j in range(len(self.endpoints))
                if j != k):
            return False
        self._streak[k] = 0
        self._times_out[k] += 1
        self._out_until[k] = now + min(OUTLIER_COOLDOWN_MAX_S, OUTLIER_COOLDOWN_S * 2 ** (self._times_out[k] - 1))
        return True

    async def _servers_fault(self, client: httpx.AsyncClient, k: int, exc: Exception) -> None:
        """Endpoint k failed a call (a refused or dropped connection, a 5xx, a stream cut short).
        Whose failure: a server whose `/health` still answers failed this request (a 5xx that its
        input causes would fail every sibling the same way), so it stays in rotation and the error
        reaches the pool as the request's (a RemoteStreamError: a hazard, as for one server),
        unless that makes it an outlier (`_outlier`). Otherwise the endpoint is ejected, and
        EndpointsDownError says when none is left; the caller goes on at a sibling."""
        if await self.endpoints[k].alive(client) and not self._outlier(k):
            raise RemoteStreamError(f"{self.endpoints[k].base_url} failed this request and answers its "
                                    f"/health: {exc}") from exc
        self.eject(k)
        if not any(self.healthy):
            raise EndpointsDownError(f"every {self.name} replica is down ({self.base_url}): {exc}") from exc

    def _next(self) -> int:
        k = self.pick()
        if k is None:
            raise EndpointsDownError(f"no healthy {self.name} replica ({self.base_url})")
        return k

    # -- streams -------------------------------------------------------------------------------------
    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n_remaining: int) -> AsyncGenerator[RemoteItem, None]:
        answered: list[int] = []  # the ids yielded so far (the pool accepted each before asking for more)
        for attempt in range(len(self.endpoints)):  # at most one migration per endpoint ejected
            k = self._next()
            if attempt:  # the pool waits for the sibling's first token as for any first token
                self.migrations += 1  # the same answer goes on at a sibling, from the ids it has
                yield RemoteResumed()
            self.inflight[k] += 1
            try:
                stream = self.endpoints[k].stream(client, ids + answered, params,
                                                 max(1, n_remaining - len(answered)))
                async with contextlib.aclosing(stream) as items:
                    async for item in items:
                        if isinstance(item, RemoteToken):
                            answered.append(item.token_id)
                        elif isinstance(item, RemoteEnd):  # (before the yield: the caller may close us there)
                            self._answered(k)
                        yield item
                        if isinstance(item, RemoteEnd):
                            return
                self._answered(k)
                return
            except (httpx.TransportError, RemoteTransportError) as exc:
                await self._servers_fault(client, k, exc)
            finally:
                self.inflight[k] -= 1
        raise self._lost("stream")

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        """Score on a healthy endpoint; a server's failure tries the next one."""
        return await self._call(client, lambda e: e.score(client, prompt, draft))

    async def verify(self, client: httpx.AsyncClient, context: list[int], draft: list[int]) -> Verdict:
        """Verified decoding's one call (vLLM replicas), on a healthy endpoint as `score`."""
        def one(e: LlamaServerRung | VllmRung) -> Awaitable[Verdict]:
            if not isinstance(e, VllmRung):
                raise TypeError(f"{e.server} cannot verify a draft")
            return e.verify(client, context, draft)

        return await self._call(client, one)

    async def _call(self, client: httpx.AsyncClient, call: Callable[[LlamaServerRung | VllmRung], Awaitable[T]]) -> T:
        for _ in range(len(self.endpoints)):
            k = self._next()
            self.inflight[k] += 1
            try:
                result = await call(self.endpoints[k])
                self._answered(k)
                return result
            except (httpx.TransportError, RemoteTransportError) as exc:
                await self._servers_fault(client, k, exc)
            finally:
                self.inflight[k] -= 1
        raise self._lost("call")

    def _lost(self, what: str) -> RemoteTransportError:
        """A stream or call that lost as many replicas in a row as the rung has, while one rejoined
        (none left in rotation: `_servers_fault` raised EndpointsDownError before): this request
        failed, not the rung."""
        return RemoteTransportError(f"a {self.name} {what} lost {len(self.endpoints)} replicas in a row "
                                    f"({self.base_url})")

    def close(self) -> None:  # (the probes are tasks of the pool's loop: its close cancels them)
        for e in self.endpoints:
            e.close()
