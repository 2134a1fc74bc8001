"""One remote rung served by several replicas of the same weights: a pool's `urls = [...]`.

    rung = Replicas([LlamaServerRung(info, u) for u in urls])     each tokenizer-probed at start
    async for item in rung.stream(client, ids, params, n)         one stream, whichever replica

Each replica (an endpoint) has its own health: a refused connection, a dropped stream or a 5xx
(`RemoteTransportError`: the server's fault, not the model's) ejects it at once, and its
`/health` is probed every `probe_every_s` until it answers, when it rejoins. A new stream goes to
the healthy endpoint with the fewest streams in flight (past 8 endpoints, the better of two
picked at random: power of two choices).

An answer survives its server: when an endpoint fails mid-stream, the stream continues on a
healthy sibling from the ids it has already yielded (prompt + the answer so far, the budget
reduced by as many), so the caller (the remote pool, its guard and the client) sees one
uninterrupted stream (a `RemoteResumed` item tells the pool to wait for the sibling's first token
as for any first token: its queue and prefill, not one decode step). Every token yielded was one
the pool asked for after judging the one before, so the ids continued from are the answer's
accepted ids. A greedy answer continues
token-identical to its unbroken run (same weights, same kernels); a sampled one continues
validly, with other draws. Only when no sibling is healthy does the error reach the pool, which
then climbs to the next rung as for a single server. Migration needs the whole state to be in
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
from collections.abc import AsyncGenerator, Sequence

import httpx

from qladder.engines.remote import RemoteEnd, RemoteItem, RemoteResumed
from qladder.engines.remote_llama import LlamaServerRung
from qladder.engines.remote_vllm import VllmRung
from qladder.errors import ConfigError, RemoteTransportError
from qladder.health.remote import RemoteToken, Scored
from qladder.sampling import SamplingParams

TWO_CHOICES_PAST = 8


class Replicas:
    """A RemoteRung over several endpoints of one kind (all llama-server, or all vLLM)."""

    def __init__(self, endpoints: Sequence[LlamaServerRung | VllmRung], probe_every_s: float = 1.0,
                 rng: random.Random | None = None):
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
        """Endpoint k failed a stream: out of rotation, probed until it answers (the loop thread)."""
        if self.healthy[k]:
            self.healthy[k] = False
            self.ejections += 1
            self._probes[k] = asyncio.ensure_future(self._probe(k))

    async def _probe(self, k: int) -> None:
        async with httpx.AsyncClient() as client:
            while not self.healthy[k]:
                await asyncio.sleep(self.probe_every_s)
                if await self.endpoints[k].alive(client):
                    self.healthy[k] = True
                    self.rejoins += 1

    async def alive(self, client: httpx.AsyncClient) -> bool:
        """Any endpoint answers (each that does rejoins)."""
        for k, e in enumerate(self.endpoints):
            if not self.healthy[k] and await e.alive(client):
                self.healthy[k] = True
                self.rejoins += 1
        return any(self.healthy)

    # -- streams -------------------------------------------------------------------------------------
    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n_remaining: int) -> AsyncGenerator[RemoteItem, None]:
        answered: list[int] = []  # the ids yielded so far (the pool accepted each before asking for more)
        resumed = False
        while True:
            if resumed:  # the pool waits for the sibling's first token as for any first token
                yield RemoteResumed()
            k = self.pick()
            if k is None:
                raise RemoteTransportError(f"no healthy {self.name} replica ({self.base_url})")
            self.inflight[k] += 1
            try:
                stream = self.endpoints[k].stream(client, ids + answered, params,
                                                 max(1, n_remaining - len(answered)))
                async with contextlib.aclosing(stream) as items:
                    async for item in items:
                        if isinstance(item, RemoteToken):
                            answered.append(item.token_id)
                        yield item
                        if isinstance(item, RemoteEnd):
                            return
                return
            except (httpx.TransportError, RemoteTransportError):
                self.eject(k)
                if not any(self.healthy):
                    raise
                self.migrations += 1  # the same answer goes on at a sibling, from the ids it has
                resumed = True
            finally:
                self.inflight[k] -= 1

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        """Score on a healthy endpoint; a transport failure tries the next one."""
        while True:
            k = self.pick()
            if k is None:
                raise RemoteTransportError(f"no healthy {self.name} replica to score on ({self.base_url})")
            self.inflight[k] += 1
            try:
                return await self.endpoints[k].score(client, prompt, draft)
            except (httpx.TransportError, RemoteTransportError):
                self.eject(k)
                if not any(self.healthy):
                    raise
            finally:
                self.inflight[k] -= 1

    def close(self) -> None:  # (the probes are tasks of the pool's loop: its close cancels them)
        for e in self.endpoints:
            e.close()
