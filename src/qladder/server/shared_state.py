"""Breaker, quarantine and endpoint health shared by gateways: `[state] backend = "memory" | "redis"`.

    store = open_state_store(StateSettings(backend="redis", url="redis://..."))   (in the sync thread)
    sync = StateSync(settings, breakers, quarantine, endpoints=board).start()      one per gateway

The request path reads only local objects (each pool's `Breaker`, the `Quarantine`), so a slow or
absent store never delays a request. One thread per gateway, "qladder-state", owns the store
(its asyncio loop is the store client's only user) and every `sync_s`:
- per pool, merges the events this gateway's breaker applied since the last sync (outcomes and
  admissions, time-stamped and numbered) into the shared breaker record (read, replay through the
  pure `transition`, write: one atomic step, WATCH/MULTI on Redis; `merged` says how events out
  of time order and a merge retried after a lost answer are applied, each once) and has the local
  breaker adopt the result, with events that arrived meanwhile replayed on top: every gateway's
  outcomes feed one window, and a breaker opened on one gateway is open on all within a sync. A
  store with no record (new, or restarted empty) takes the gateway's own state: a restart of
  Redis does not close an open breaker;
- pushes the fingerprints quarantined here (each with when it was added), then pulls those with a
  sequence number past its last pull (the store numbers each add as it lands, so an add pushed
  late, after an outage, is still pulled by every gateway; past the TTL trimmed, `max_entries`
  kept);
- pushes the ejections and rejoins of this gateway's replicas (the `EndpointBoard` the remote
  rungs post to: engines/endpoint_board.py) and hands the board the newest news per endpoint
  the store holds (last writer by time wins): a replica ejected by one gateway is ejected by the
  others at their next pick after a sync (within the rules of replicas.py's `_listen`).

Every store call is bounded (`timeout_s`). When one fails, the gateway goes on with its local
view: the unsent events stay queued (bounded; see Breaker.JOURNAL_MAX), `shared` turns False
(/readyz's "state", the `qladder_state_shared` gauge), and the first sync that succeeds rejoins.
A shared breaker's times are wall-clock times (`time.time`): gateways on other machines compare
them, so their clocks must agree to well under a breaker's window (NTP's milliseconds do).

"memory" is the embedded default: one gateway, no sync thread, nothing else to run. A
`MemoryStateStore` shared by several gateways in one process (tests) keeps the same contract as
Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from qladder.config import knob
from qladder.engines.endpoint_board import NEWS_SKEW_S, EndpointBoard, EndpointNews, newest
from qladder.errors import ConfigError
from qladder.server.breaker import BreakerConfig, BreakerMode, BreakerState, Outcome, Stamped, transition
from qladder.server.quarantine import Quarantine

_log = logging.getLogger("qladder.state")
BACKENDS = ("memory", "redis")


@dataclass(frozen=True)
class StateSettings:
    """What gateways share (breakers, quarantine, replicas' health)."""

    backend: str = knob("memory", "\"memory\": this gateway alone (nothing else to run); \"redis\": shared by "
                                  "every gateway on `url`")
    url: str = knob("", "redis://host:port/db")
    prefix: str = knob("qladder:", "every key this gateway writes starts with it (several fleets, one Redis)")
    sync_s: float = knob(0.2, "how often a gateway merges its breakers and quarantine with the store")
    timeout_s: float = knob(0.5, "the bound on each store call; past it the gateway serves on its own view")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"state backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "redis":
            if not self.url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError("state backend 'redis' needs url = \"redis://host:port/db\"")
            from redis.connection import parse_url

            try:
                parse_url(self.url)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            except ValueError as exc:
                raise ConfigError(f"state url {self.url!r}: {exc}") from exc
        if self.sync_s <= 0 or self.timeout_s <= 0:
            raise ConfigError("state sync_s and timeout_s must be > 0")

    @property
    def shared(self) -> bool:
        return self.backend != "memory"


class StateStore(Protocol):
    """What gateways share. Async: called only from the state sync's own loop."""

    async def merge_breaker(self, pool: str, gateway: str, local: BreakerState, events: Sequence[Stamped],
                            mark: int, config: BreakerConfig) -> BreakerState:
        """Merge gateway `gateway`'s journal (`events`, the last one numbered `mark`) into the
        pool's shared breaker state atomically, each event once (a retried merge skips what the
        store already holds); no shared state yet (a new or restarted store): `local`, which
        holds the events already. Returns the merged state."""
        ...

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        """Add (fingerprint, when) entries; drop those added before `expired_before`; keep the
        newest `max_entries`. Each add that changes an entry takes the store's next sequence number."""
        ...

    async def pull_quarantine(self, after: int) -> tuple[list[tuple[str, float]], int]:
        """The (fingerprint, when) entries whose sequence number is past `after` (all of them when
        the store's numbers restarted below it), and the last number."""
        ...

    async def exchange_endpoints(self, news: Sequence[EndpointNews]) -> list[EndpointNews]:
        """Keep each piece of news newer than the one held for its endpoint URL; return the newest
        held per URL."""
        ...

    async def close(self) -> None: ...


def encode_state(state: BreakerState) -> dict[str, Any]:
    return {"mode": str(state.mode), "window": [list(w) for w in state.window], "opened_at": state.opened_at,
            "probes_admitted": state.probes_admitted, "probes_ok": state.probes_ok}


def decode_state(d: dict[str, Any]) -> BreakerState:
    return BreakerState(BreakerMode(d["mode"]), tuple((float(t), bool(h), bool(e)) for t, h, e in d["window"]),
                        float(d["opened_at"]), int(d["probes_admitted"]), int(d["probes_ok"]))


APPLIED_TTL_S = 3600.0  # a gateway's last merged mark is kept this long past its last merge


def merged(raw: str | bytes | None, gateway: str, local: BreakerState, events: Sequence[Stamped], mark: int,
           config: BreakerConfig) -> tuple[str, BreakerState]:
    """The shared record after a merge (JSON) and its state; pure, so both stores merge alike.

    The record keeps, besides the state, `latest` (the newest event time merged) and per gateway
    the mark of its last merged event. Events at or below that mark are skipped (a merge the store
    applied but whose answer was lost is not counted twice). Gateways' events arrive out of time
    order, while `transition` assumes time moves forward: each is applied at max(its time,
    latest), and an outcome older than latest - window_s (it has left the window) is dropped."""
    d = json.loads(raw) if raw is not None else None
    first = mark - len(events) + 1  # the first event's number
    if d is None:
        state, latest, applied = local, max((at for at, _ in events), default=0.0), {}
        todo: Sequence[Stamped] = ()  # `local` holds them
    else:
        state, latest, applied = decode_state(d["state"]), float(d["latest"]), dict(d["applied"])
        todo = events[max(0, int(applied.get(gateway, [0, 0.0])[0]) - first + 1):]
    for at, event in todo:
        if isinstance(event, Outcome) and at < latest - config.window_s:
            continue
        now = max(at, latest)
        state, latest = transition(state, event, now, config), now
    applied[gateway] = [mark, latest]
    applied = {g: v for g, v in applied.items() if v[1] >= latest - APPLIED_TTL_S}
    return json.dumps({"state": encode_state(state), "latest": latest, "applied": applied}), state


class MemoryStateStore:
    """The store in this process's memory (one lock): gateways in one process share one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._breakers: dict[str, str] = {}
        self._quarantine: dict[str, tuple[float, int]] = {}  # fingerprint -> (when, sequence number)
        self._seq = 0
        self._endpoints: dict[str, EndpointNews] = {}

    async def merge_breaker(self, pool: str, gateway: str, local: BreakerState, events: Sequence[Stamped],
                            mark: int, config: BreakerConfig) -> BreakerState:
        with self._lock:
            self._breakers[pool], state = merged(self._breakers.get(pool), gateway, local, events, mark, config)
            return state

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        with self._lock:
            for fp, at in entries:
                if fp not in self._quarantine or self._quarantine[fp][0] < at:
                    self._seq += 1
                    self._quarantine[fp] = (at, self._seq)
            kept = sorted(((v, fp) for fp, v in self._quarantine.items() if v[0] >= expired_before), reverse=True)
            self._quarantine = {fp: v for v, fp in kept[:max_entries]}

    async def pull_quarantine(self, after: int) -> tuple[list[tuple[str, float]], int]:
        with self._lock:
            after = after if after <= self._seq else 0
            return sorted(((fp, at) for fp, (at, n) in self._quarantine.items() if n > after),
                          key=lambda e: e[1]), self._seq

    async def exchange_endpoints(self, news: Sequence[EndpointNews]) -> list[EndpointNews]:
        with self._lock:
            self._endpoints = newest(self._endpoints, news, time.time() + NEWS_SKEW_S)
            return list(self._endpoints.values())

    async def close(self) -> None:
        pass


# KEYS: the times set (fingerprint -> when), the numbers set (fingerprint -> sequence number), the
# counter. ARGV: expired_before, max_entries, then fingerprint, when pairs.
_PUSH = """
for i = 3, #ARGV, 2 do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not old or tonumber(old) < tonumber(ARGV[i + 1]) then
    redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[i])
  end
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
local over = redis.call('ZCARD', KEYS[1]) - #gone - tonumber(ARGV[2])
for _, fp in ipairs(gone) do redis.call('ZREM', KEYS[1], fp); redis.call('ZREM', KEYS[2], fp) end
if over > 0 then
  for _, fp in ipairs(redis.call('ZRANGE', KEYS[1], 0, over - 1)) do
    redis.call('ZREM', KEYS[1], fp); redis.call('ZREM', KEYS[2], fp)
  end
end
return 0
"""

# KEYS: the endpoints hash (URL -> news JSON). ARGV: the skew bound (s), then URL, wall time, news
# JSON triples. A held value whose time does not read as a number, or lies past the server's clock
# by more than the bound (a gateway with a broken clock), is replaced by the news sent; news stamped
# that far ahead is not kept.
_ENDPOINTS = """
local limit = tonumber(redis.call('TIME')[1]) + tonumber(ARGV[1])
for i = 2, #ARGV, 3 do
  local at = tonumber(ARGV[i + 1])
  local newer = at ~= nil and at == at and at <= limit
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if newer and old then
    local ok, d = pcall(cjson.decode, old)
    local held = ok and type(d) == 'table' and tonumber(d['at'])
    if held and held == held and held <= limit then
      newer = held < at
    end
  end
  if newer then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  end
end
return redis.call('HVALS', KEYS[1])
"""


class RedisStateStore:
    """The store in a Redis server (redis-py's asyncio client). A breaker's record is one JSON
    value, merged under WATCH/MULTI (a peer's write in between retries the merge); the quarantine
    is two sorted sets (fingerprint -> when, fingerprint -> sequence number) and a counter,
    written by one Lua script; endpoint news is one hash (URL -> the newest news), compared and
    written by another. Nothing expires on its own: the records are small and bounded."""

    RETRIES = 16

    def __init__(self, url: str, prefix: str = "qladder:", timeout_s: float = 0.5):
        import redis.asyncio as aioredis

        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._push = self._redis.register_script(_PUSH)
        self._endpoints = self._redis.register_script(_ENDPOINTS)

    async def merge_breaker(self, pool: str, gateway: str, local: BreakerState, events: Sequence[Stamped],
                            mark: int, config: BreakerConfig) -> BreakerState:
        from redis.exceptions import WatchError

        key = f"{self.prefix}breaker:{pool}"
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(self.RETRIES):
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is not None and not events:
                        return decode_state(json.loads(raw)["state"])  # nothing to add: read only
                    record, state = merged(raw, gateway, local, events, mark, config)
                    pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                    pipe.set(key, record)
                    await pipe.execute()
                    return state
                except WatchError:
                    continue
        raise TimeoutError(f"breaker {pool!r}: {self.RETRIES} merges lost to concurrent writers")

    def _keys(self) -> list[str]:
        return [f"{self.prefix}quarantine:at", f"{self.prefix}quarantine:seq", f"{self.prefix}quarantine:n"]

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        await self._push(keys=self._keys(), args=[repr(expired_before), max_entries,
                                                  *(x for fp, at in entries for x in (fp, repr(at)))])

    async def pull_quarantine(self, after: int) -> tuple[list[tuple[str, float]], int]:
        at_key, seq_key, n_key = self._keys()
        last = int(await self._redis.get(n_key) or 0)
        if last < after:  # the store restarted: its numbers began again
            after = 0
        got = cast(list[tuple[bytes, float]], await self._redis.zrangebyscore(seq_key, f"({after}", "+inf",
                                                                               withscores=True))
        fps = [fp for fp, _ in got]
        whens = await self._redis.zmscore(at_key, fps) if fps else []  # type: ignore[arg-type]
        entries = [(fp.decode(), float(w)) for fp, w in zip(fps, whens, strict=True) if w is not None]
        return entries, max([last, *(int(n) for _, n in got)])

    async def exchange_endpoints(self, news: Sequence[EndpointNews]) -> list[EndpointNews]:
        sent = [x for n in news for x in (n.url, repr(n.at), n.encode())]
        held = await self._endpoints(keys=[f"{self.prefix}endpoints"], args=[repr(NEWS_SKEW_S), *sent])
        return [n for raw in cast(list[bytes], held) if (n := EndpointNews.decode(raw)) is not None]

    async def close(self) -> None:
        await self._redis.aclose()


def open_state_store(settings: StateSettings) -> StateStore:
    if settings.backend == "redis":
        return RedisStateStore(settings.url, settings.prefix, settings.timeout_s)
    return MemoryStateStore()


class StateSync:
    """One gateway's state sync: a thread with its own asyncio loop, the store's only user.
    `store`: a factory called on that thread (a Redis client belongs to the loop it was made on).
    `on_status(shared)` is called on every change of `shared` (metrics). `gateway`: this
    gateway's name in the shared records (a new one per process unless given). `endpoints`: the
    board this gateway's replicas post their ejections to (None: nothing to share)."""

    def __init__(self, settings: StateSettings, breakers: dict[str, Any], quarantine: Quarantine,
                 store: Callable[[], StateStore] | None = None,
                 on_status: Callable[[bool], None] | None = None, gateway: str | None = None,
                 endpoints: EndpointBoard | None = None):
        self.settings = settings
        self.endpoints = endpoints
        self.gateway = gateway or uuid.uuid4().hex[:12]
        self.breakers = breakers
        self.quarantine = quarantine
        self._factory = store or (lambda: open_state_store(settings))
        self.on_status = on_status
        self.shared = False  # True while the last sync reached the store
        self.last_error: str | None = "not synced yet"
        self.syncs = 0
        self.failures = 0
        self._pulled = 0  # the sequence number of the last quarantine entry pulled
        self._error: BaseException | None = None  # the store could not be made (start() raises it)
        self._loop = asyncio.new_event_loop()
        self._one = asyncio.Lock()
        self._store: StateStore | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qladder-state", daemon=True)
        self._ready = threading.Event()
        self._wake: asyncio.Event | None = None  # set by close(): the sync loop stops waiting

    def start(self) -> StateSync:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            self._thread.join(5)
            raise ConfigError(f"the shared state's store cannot be used: {self._error}") from self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._store = self._factory()
        except Exception as exc:  # a URL the client refuses: start() says so
            self._error = exc
            self._ready.set()
            self._loop.close()
            return
        self._loop.run_until_complete(self._every())
        self._loop.run_until_complete(self._store.close())
        self._loop.close()

    async def _every(self) -> None:
        self._wake = asyncio.Event()
        self._ready.set()
        while not self._stop.is_set():
            await self._sync()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.sync_s)

    def sync_now(self, timeout_s: float = 10.0) -> bool:
        """Run one sync on the state thread and wait for it (tests, and a gateway's start);
        False once the sync has stopped."""
        if self._stop.is_set() or not self._thread.is_alive():
            return False
        return asyncio.run_coroutine_threadsafe(self._sync(), self._loop).result(timeout_s)

    async def _sync(self) -> bool:
        assert self._store is not None
        try:
            async with self._one:  # the periodic sync and a sync_now never merge one journal twice
                # each store call is bounded by timeout_s: the whole exchange by the sum
                await asyncio.wait_for(self._exchange(self._store), self.settings.timeout_s * (len(self.breakers) + 4))
        except Exception as exc:  # the store is away or slow: serve on the local view
            self.failures += 1
            self._status(False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return False
        self.syncs += 1
        self._status(True, None)
        return True

    async def _exchange(self, store: StateStore) -> None:
        for pool, breaker in self.breakers.items():
            local, events, mark = breaker.journal()
            shared = await asyncio.wait_for(store.merge_breaker(pool, self.gateway, local, events, mark,
                                                                breaker.config), self.settings.timeout_s)
            breaker.adopt(shared, mark)
        fresh, mark = self.quarantine.fresh()
        q = self.quarantine.config
        await asyncio.wait_for(store.push_quarantine(fresh, self.quarantine.clock() - q.ttl_s, q.max_entries),
                               self.settings.timeout_s)
        entries, self._pulled = await asyncio.wait_for(store.pull_quarantine(self._pulled), self.settings.timeout_s)
        self.quarantine.merge(mark, entries)
        if self.endpoints is not None:
            sent = self.endpoints.outbox()
            held = await asyncio.wait_for(store.exchange_endpoints(sent), self.settings.timeout_s)
            self.endpoints.delivered(sent, held)

    def _status(self, shared: bool, error: str | None) -> None:
        changed = shared != self.shared
        self.shared, self.last_error = shared, error
        if changed:
            (_log.info if shared else _log.warning)(
                "shared state %s", "joined" if shared else f"unreachable, serving on the local view ({error})")
            if self.on_status is not None:
                self.on_status(shared)

    def describe(self) -> dict[str, Any]:
        """What /readyz says of the shared state."""
        return {"backend": self.settings.backend, "shared": self.shared, "syncs": self.syncs,
                "failures": self.failures, **({"error": self.last_error} if not self.shared else {})}

    def close(self) -> None:
        self._stop.set()
        if self._wake is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._wake.set)
        if self._thread.is_alive():
            self._thread.join(self.settings.timeout_s * (len(self.breakers) + 4) + 5)

