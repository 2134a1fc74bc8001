"""One remote rung served by several replicas of the same weights: a pool's `urls = [...]`.

    rung = Replicas([LlamaServerRung(info, u) for u in urls])     each tokenizer-probed at start
    async for item in rung.stream(client, ids, params, n)         one stream, whichever replica

Each replica (an endpoint) has its own health: a refused connection, a dropped stream or a 5xx
(`RemoteTransportError`) from a server whose `/health` then fails too (the server's fault, not
the model's) ejects it at once, and its `/health` is probed every `probe_every_s` until it
answers, when it rejoins. A new stream goes to the healthy endpoint with the fewest streams in
flight (past 8 endpoints, the better of two picked at random: power of two choices).

A server that fails a call and still answers `/health` is either broken behind a `/health` that
says 200 (a broken slot, a full disk, a proxy answering 500: an outlier, as Envoy's outlier
detection calls it) or was failed by the request (its input would fail every sibling alike).
The call says which: it goes on at a sibling that has not failed it, as long as at most
`max_suspects` (n // 2 + 1) replicas have (two broken replicas of three still leave the third
to answer; more broken than that behind a 200 /health looks like a request that fails every
replica, and each request fails as its own, blaming none: a known limit). If every replica it
tried fails it, the failure is the request's: its error
reaches the pool (a RemoteStreamError: a hazard, as from a single server) and no replica is
blamed. If a sibling answers, each replica that failed the call is blamed; blamed
OUTLIER_FAILS times in a row (an answer of its own clears them), one is ejected for
OUTLIER_COOLDOWN_S, doubled each time it is ejected again before it answers a call (up to
OUTLIER_COOLDOWN_MAX_S), and no `/health` brings it back sooner unless no replica is left. At
most half the replicas are out as outliers at once. A stream the caller closes after a
replica's tokens counts as answered (the caller had what it asked for): a replica that fails
only past the tokens callers read is not found out by this.

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

Gateways that share state (`[state] backend = "redis"`) share endpoint health too, through an
`EndpointBoard` (engines/endpoint_board.py): each ejection and rejoin here is posted to it, and
an ejection a peer gateway posted (newer than what this gateway knew of the endpoint) ejects it
here as well at the next pick: an outlier's for the rest of its cooldown (within the
at-most-half cap), a plain outage's only while fresh (NEWS_FRESH_S), and never the last healthy
replica (a peer cut off from the servers does not empty every gateway's pool). This gateway's
own probe brings it back (for a plain outage, asking at once).

The audit's test (serving/endpoint_watch.py) may condemn an endpoint: its answers were scored
broken, whatever its `/health` says. `condemn(url)` takes it out of rotation with no cap (a
test's decision on many answers, not one failed call; with every replica condemned the pool is
down and its requests go to the standby) until `absolve(url)` (its audited probes passed), and
posts it (`audit`): a peer condemns it too, for AUDIT_HOLD_S at most, and any later news of it
coming back (a rejoin anywhere happens only after an absolution) lifts that.

Owned by the remote pool's loop thread: `stream`, the counters and the probes run only there
(the engine's `stats` reads the counters for metrics, as it reads the pool's).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import httpx

from qladder.audit import TopRow
from qladder.engines.endpoint_board import NEWS_SKEW_S, EndpointBoard, EndpointNews
from qladder.engines.remote import RemoteAt, RemoteEnd, RemoteItem, RemoteResumed
from qladder.engines.remote_llama import LlamaServerRung
from qladder.engines.remote_vllm import Verdict, VllmRung
from qladder.errors import ConfigError, EndpointsDownError, RemoteStreamError, RemoteTransportError
from qladder.health.remote import RemoteToken, Scored
from qladder.sampling import SamplingParams

TWO_CHOICES_PAST = 8
OUTLIER_FAILS = 3  # calls failed in a row, /health up, each answered by a sibling: the endpoint is out
OUTLIER_COOLDOWN_S = 10.0  # for this long before its /health may bring it back; doubled each time it is
OUTLIER_COOLDOWN_MAX_S = 120.0  # ejected again before it answers a call, up to this
NEWS_FRESH_S = 10.0  # a peer's ejection (not an outlier's cooldown) older than this is not acted on
AUDIT_HOLD_S = 600.0  # a peer's audit ejection holds here this long unless news of its return comes first
T = TypeVar("T")


class Replicas:
    """A RemoteRung over several endpoints of one kind (all llama-server, or all vLLM)."""

    def __init__(self, endpoints: Sequence[LlamaServerRung | VllmRung], probe_every_s: float = 1.0,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 board: EndpointBoard | None = None, wall: Callable[[], float] = time.time):
        """board: the gateway's shared endpoint news (None: this gateway alone); wall: the
        wall clock the news is stamped with (gateways compare it)."""
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
        self.heard = 0  # ejections on a peer gateway's word (counted in `ejections` too)
        self.condemned = 0  # endpoints condemned by the audit (here or, heard, by a peer)
        self._rng = rng or random.Random(0)
        self._probes: dict[int, asyncio.Future[None]] = {}
        self.clock = clock
        n = len(endpoints)
        self._streak = [0] * n  # calls failed in a row with /health up that a sibling then answered
        self._times_out = [0] * n  # outlier ejections since it last answered a call
        self._out_until = [0.0] * n  # no rejoin before (an outlier's cooldown)
        self._outlier = [False] * n  # out as an outlier (not as down), until it rejoins
        self._condemned_until = [0.0] * n  # condemned by the audit until then (inf: until absolved here)
        self.max_suspects = n // 2 + 1  # replicas that may fail one call, /health up, and it still goes on
        self.board, self.wall = board, wall
        self._index = {e.base_url: k for k, e in enumerate(endpoints)}
        self._known_at = [0.0] * n  # the wall time of the newest event known for each (own or a peer's)
        self._posted_at = [0.0] * n  # the wall time of this gateway's last post for each
        self._board_version = 0

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
        return [{"url": e.base_url, "healthy": self.healthy[k], "in_flight": self.inflight[k],
                 "condemned": self._condemned(k)} for k, e in enumerate(self.endpoints)]

    def endpoint(self, url: str) -> LlamaServerRung | VllmRung:
        """The replica at `url` (a probe goes to it alone)."""
        return self.endpoints[self._index[url]]

    # -- the audit's decisions -----------------------------------------------------------------------
    def _condemned(self, k: int) -> bool:
        return self.clock() < self._condemned_until[k]

    def condemn(self, url: str, post: bool = True, hold_s: float = math.inf) -> None:
        """The audit's test found the answers of the replica at `url` broken: out of rotation until
        `absolve` (or `hold_s`: a peer's word), whatever its /health says, with no cap. post: tell
        the peer gateways (not for news heard from them)."""
        k = self._index.get(url)
        if k is None:
            return
        self._condemned_until[k] = max(self._condemned_until[k], self.clock() + hold_s)
        self.condemned += 1
        if post:
            self._post(k, down=True, audit=True)
        self.eject(k, post=False)  # out, and probed: its /health brings it back once absolved (or the hold ends)

    def absolve(self, url: str, post: bool = True) -> None:
        """Its audited probes passed: no longer condemned; its /health brings it back, asked at once."""
        k = self._index.get(url)
        if k is None or self._condemned_until[k] == 0.0:
            return
        self._condemned_until[k] = 0.0
        if post:
            self._post(k, down=False, audit=True)
        self.eject(k, post=False, ask_now=True)  # (out already: this starts its /health probe)

    # -- choosing an endpoint ------------------------------------------------------------------------
    def pick(self, exclude: Sequence[int] = ()) -> int | None:
        """The healthy endpoint with the fewest streams in flight, but those in `exclude` (None:
        none is left)."""
        up = [k for k, ok in enumerate(self.healthy) if ok and k not in exclude]
        if not up:
            return None
        if len(up) > TWO_CHOICES_PAST:
            up = self._rng.sample(up, 2)
        return min(up, key=lambda k: (self.inflight[k], k))

    def eject(self, k: int, post: bool = True, ask_now: bool = False) -> None:
        """Endpoint k failed a stream: out of rotation, probed until it answers (the loop thread;
        one probe per endpoint). post: tell the peer gateways (not for news heard from them);
        ask_now: the probe's first question without waiting (a peer's word, not our own)."""
        if self.healthy[k]:
            self.healthy[k] = False
            self.ejections += 1
            if post:
                self._post(k, down=True)
        probe = self._probes.get(k)
        if probe is None or probe.done():
            self._probes[k] = asyncio.ensure_future(self._probe(k, ask_now))

    def _rejoin(self, k: int) -> None:
        if not self.healthy[k]:
            self.healthy[k] = True
            self.rejoins += 1
            self._streak[k] = 0
            self._post(k, down=False)
        self._outlier[k], self._out_until[k] = False, 0.0

    def _post(self, k: int, down: bool, audit: bool = False) -> None:
        if self.board is None:
            return
        at = self._posted_at[k] = max(self.wall(), math.nextafter(self._posted_at[k], math.inf))  # (each newer)
        self._known_at[k] = max(self._known_at[k], at)
        left = max(0.0, self._out_until[k] - self.clock()) if down and self._outlier[k] else 0.0
        self.board.post(EndpointNews(self.endpoints[k].base_url, down, at, left, audit))

    def _listen(self) -> None:
        """Apply what peer gateways posted since the last look. An ejection newer than what this
        gateway knew of the endpoint ejects it here: an outlier's for the rest of its cooldown
        (from the news's time, at most OUTLIER_COOLDOWN_MAX_S; an endpoint out already here keeps
        the later end), unless half the replicas are out as outliers here already; a plain
        outage's while fresh. Never the last healthy replica."""
        if self.board is None:
            return
        version, news = self.board.heard_since(self._board_version)
        self._board_version = version
        for n in news:
            k = self._index.get(n.url)
            if k is None or n.at <= self._known_at[k] or n.at > self.wall() + NEWS_SKEW_S:
                continue
            self._known_at[k] = n.at  # (news skipped below, by the caps, is not applied later either)
            age = max(0.0, self.wall() - n.at)
            if n.audit and n.down:  # a peer's audit condemned it: here too, for AUDIT_HOLD_S at most
                if age < AUDIT_HOLD_S:
                    self.heard += self.healthy[k]
                    self.condemn(n.url, post=False, hold_s=AUDIT_HOLD_S - age)
                continue
            if not n.down and self._condemned(k) and self._condemned_until[k] != math.inf:
                self._condemned_until[k] = 0.0  # back somewhere after a peer's condemnation: probed here
                self.eject(k, post=False, ask_now=True)
                continue
            left = min(n.cooldown_s, OUTLIER_COOLDOWN_MAX_S) - age
            if not n.down or (left <= 0 and (age > NEWS_FRESH_S or not self.healthy[k])):
                continue  # (an old outage: a gateway that joins later finds it out on its own)
            if self.healthy[k] and sum(self.healthy) <= 1:
                continue
            if left > 0:
                if not self._outlier[k] and sum(self._outlier) + 1 > len(self.endpoints) // 2:
                    continue
                self._outlier[k], self._out_until[k] = True, max(self._out_until[k], self.clock() + left)
            if self.healthy[k]:
                self.heard += 1
                self.eject(k, post=False, ask_now=left <= 0)

    def _may_rejoin(self, k: int) -> bool:
        """Not condemned, and an outlier's cooldown is over or no replica is left (better a suspect
        than none; never one the audit condemned: the standby answers then)."""
        return not self._condemned(k) and (self.clock() >= self._out_until[k] or not any(self.healthy))

    async def _probe(self, k: int, ask_now: bool = False) -> None:
        async with httpx.AsyncClient() as client:
            while not self.healthy[k]:
                if not ask_now:
                    await asyncio.sleep(self.probe_every_s)
                ask_now = False
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

    def _served(self, k: int, suspects: Sequence[int]) -> None:
        """Endpoint k answered a call (a stream to its end or to the caller's close after a token,
        a score): its blame is cleared, and each suspect (a replica that failed this same call
        with its /health up) is blamed."""
        self._streak[k] = self._times_out[k] = 0
        for j in suspects:
            self._blame(j)

    def _blame(self, k: int) -> None:
        """Endpoint k failed a call that a sibling then answered: its OUTLIER_FAILS-th time in a
        row ejects it for its cooldown (unless half the replicas are out as outliers already)."""
        if not self.healthy[k]:  # out already (a call in flight when it was ejected): no second count
            return
        self._streak[k] += 1
        if self._streak[k] < OUTLIER_FAILS or sum(self._outlier) + 1 > len(self.endpoints) // 2:
            return
        self._streak[k] = 0
        self._times_out[k] += 1
        cooldown = min(OUTLIER_COOLDOWN_MAX_S, OUTLIER_COOLDOWN_S * 2 ** (self._times_out[k] - 1))
        self._out_until[k], self._outlier[k] = self.clock() + cooldown, True
        self.eject(k)

    async def _servers_fault(self, client: httpx.AsyncClient, k: int, exc: Exception, suspects: list[int]) -> None:
        """Endpoint k failed a call (a refused or dropped connection, a 5xx, a stream cut short).
        Whose failure: a server whose `/health` fails too is down (ejected; EndpointsDownError
        when none is left). One that still answers it is a suspect, and the caller goes on at a
        healthy sibling that has not failed this call; a sibling that answers blames every
        suspect (`_served`). When more than `max_suspects` replicas have failed it with their
        /health up, or no untried one is left, the call's input failed them: its error reaches the pool as
        the request's (a RemoteStreamError, a hazard, as for one server) and nobody is blamed."""
        if await self.endpoints[k].alive(client):
            if len(suspects) + 1 > self.max_suspects or self.pick([*suspects, k]) is None:
                also = (" (as did " + ", ".join(self.endpoints[j].base_url for j in suspects) + ")"
                        if suspects else "")
                raise RemoteStreamError(f"{self.endpoints[k].base_url} failed this request and answers its "
                                        f"/health{also}: {exc}") from exc
            suspects.append(k)
            return
        self.eject(k)
        if not any(self.healthy):
            raise EndpointsDownError(f"every {self.name} replica is down ({self.base_url}): {exc}") from exc

    def _next(self, suspects: Sequence[int]) -> int:
        """Where the call goes (on): a healthy replica that has not failed it."""
        self._listen()
        k = self.pick(suspects)
        if k is None:
            if any(self.healthy):  # (only replicas that failed this call are left: the request's failure)
                raise RemoteStreamError(f"every healthy {self.name} replica failed this request ({self.base_url})")
            raise EndpointsDownError(f"no healthy {self.name} replica ({self.base_url})")
        return k

    # -- streams -------------------------------------------------------------------------------------
    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n_remaining: int) -> AsyncGenerator[RemoteItem, None]:
        answered: list[int] = []  # the ids yielded so far (the pool accepted each before asking for more)
        suspects: list[int] = []  # replicas that failed this stream with their /health up
        for attempt in range(len(self.endpoints)):  # at most one migration per endpoint out or suspect
            k = self._next(suspects)
            if attempt:  # the pool waits for the sibling's first token as for any first token
                self.migrations += 1  # the same answer goes on at a sibling, from the ids it has
                yield RemoteResumed()
            self.inflight[k] += 1
            tokens = 0  # from k, not yet counted as served
            try:
                yield RemoteAt(self.endpoints[k].base_url)  # (whose tokens follow: the audit's endpoint)
                stream = self.endpoints[k].stream(client, ids + answered, params,
                                                 max(1, n_remaining - len(answered)))
                async with contextlib.aclosing(stream) as items:
                    async for item in items:
                        if isinstance(item, RemoteToken):
                            answered.append(item.token_id)
                            tokens += 1
                        elif isinstance(item, RemoteEnd):  # (before the yield: the caller may close us there)
                            self._served(k, suspects)
                            tokens = 0
                        yield item
                        if isinstance(item, RemoteEnd):
                            return
                self._served(k, suspects)
                return
            except GeneratorExit:  # the caller closed the stream after k's tokens: k served them
                if tokens:
                    self._served(k, suspects)
                raise
            except (httpx.TransportError, RemoteTransportError) as exc:
                await self._servers_fault(client, k, exc, suspects)
            finally:
                self.inflight[k] -= 1
        raise self._lost("stream")

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        """Score on a healthy endpoint; a server's failure tries the next one."""
        return await self._call(client, lambda e: e.score(client, prompt, draft))

    async def score_top(self, client: httpx.AsyncClient, prompt: list[int], answer: list[int],
                        k: int = 20) -> list[TopRow]:
        """The audit's call (vLLM replicas), on a healthy endpoint as `score`."""
        def one(e: LlamaServerRung | VllmRung) -> Awaitable[list[TopRow]]:
            if not isinstance(e, VllmRung):
                raise TypeError(f"{e.server} cannot score an answer's top rows")
            return e.score_top(client, prompt, answer, k)

        return await self._call(client, one)

    async def verify(self, client: httpx.AsyncClient, context: list[int], draft: list[int]) -> Verdict:
        """Verified decoding's one call (vLLM replicas), on a healthy endpoint as `score`."""
        def one(e: LlamaServerRung | VllmRung) -> Awaitable[Verdict]:
            if not isinstance(e, VllmRung):
                raise TypeError(f"{e.server} cannot verify a draft")
            return e.verify(client, context, draft)

        return await self._call(client, one)

    async def _call(self, client: httpx.AsyncClient, call: Callable[[LlamaServerRung | VllmRung], Awaitable[T]]) -> T:
        suspects: list[int] = []
        for _ in range(len(self.endpoints)):
            k = self._next(suspects)
            self.inflight[k] += 1
            try:
                result = await call(self.endpoints[k])
                self._served(k, suspects)
                return result
            except (httpx.TransportError, RemoteTransportError) as exc:
                await self._servers_fault(client, k, exc, suspects)
            finally:
                self.inflight[k] -= 1
        raise self._lost("call")

    def _lost(self, what: str) -> RemoteTransportError:
        """A stream or call that tried as many replicas as the rung has and lost each (ejected as
        down or suspected) while one rejoined meanwhile (none left in rotation: `_servers_fault`
        raised EndpointsDownError before): this request failed, not the rung."""
        return RemoteTransportError(f"a {self.name} {what} lost {len(self.endpoints)} replicas in a row "
                                    f"({self.base_url})")

    def close(self) -> None:  # (the probes are tasks of the pool's loop: its close cancels them)
        for e in self.endpoints:
            e.close()
