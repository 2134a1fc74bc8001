"""Breaker and quarantine state shared by gateways: `[state] backend = "memory" | "redis"`.

    store = open_state_store(StateSettings(backend="redis", url="redis://..."))   (in the sync thread)
    sync = StateSync(settings, breakers, quarantine).start()                       one per gateway

The request path reads only local objects (each pool's `Breaker`, the `Quarantine`), so a slow or
absent store never delays a request. One thread per gateway, "qladder-state", owns the store
(its asyncio loop is the store client's only user) and every `sync_s`:
- per pool, merges the events this gateway's breaker applied since the last sync (outcomes and
  admissions, time-stamped) into the shared breaker state (read, replay through the pure
  `transition`, write: one atomic step, WATCH/MULTI on Redis) and has the local breaker adopt it,
  with events that arrived meanwhile replayed on top: every gateway's outcomes feed one window,
  and a breaker opened on one gateway is open on all within a sync;
- pushes the fingerprints quarantined here (each with when), then pulls those any gateway added
  since its last pull (a sorted set scored by when; entries past the TTL are trimmed, and the set
  is kept to `max_entries`).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from qladder.errors import ConfigError
from qladder.server.breaker import BreakerConfig, BreakerMode, BreakerState, Stamped, transition
from qladder.server.quarantine import Quarantine

_log = logging.getLogger("qladder.state")
BACKENDS = ("memory", "redis")


@dataclass(frozen=True)
class StateSettings:
    backend: str = "memory"
    url: str = ""  # redis://host:port/db
    prefix: str = "qladder:"  # every key this gateway writes starts with it (several fleets, one Redis)
    sync_s: float = 0.2  # how often a gateway merges its breakers and quarantine with the store
    timeout_s: float = 0.5  # the bound on each store call; past it the gateway serves on its local view

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"state backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "redis" and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("state backend 'redis' needs url = \"redis://host:port/db\"")
        if self.sync_s <= 0 or self.timeout_s <= 0:
            raise ConfigError("state sync_s and timeout_s must be > 0")

    @property
    def shared(self) -> bool:
        return self.backend != "memory"


class StateStore(Protocol):
    """What gateways share. Async: called only from the state sync's own loop."""

    async def merge_breaker(self, pool: str, events: Sequence[Stamped], config: BreakerConfig) -> BreakerState:
        """Apply `events` to the pool's shared breaker state atomically; return the result."""
        ...

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        """Add (fingerprint, when) entries; drop those added before `expired_before`; keep the
        newest `max_entries`."""
        ...

    async def pull_quarantine(self, since: float) -> list[tuple[str, float]]:
        """The (fingerprint, when) entries added at or after `since`."""
        ...

    async def close(self) -> None: ...


def encode_state(state: BreakerState) -> str:
    return json.dumps({"mode": str(state.mode), "window": [list(w) for w in state.window],
                       "opened_at": state.opened_at, "probes_admitted": state.probes_admitted,
                       "probes_ok": state.probes_ok})


def decode_state(raw: str | bytes | None) -> BreakerState:
    if raw is None:
        return BreakerState()
    d = json.loads(raw)
    return BreakerState(BreakerMode(d["mode"]), tuple((float(t), bool(h), bool(e)) for t, h, e in d["window"]),
                        float(d["opened_at"]), int(d["probes_admitted"]), int(d["probes_ok"]))


def replay(state: BreakerState, events: Sequence[Stamped], config: BreakerConfig) -> BreakerState:
    for at, event in events:
        state = transition(state, event, at, config)
    return state


class MemoryStateStore:
    """The store in this process's memory (one lock): gateways in one process share one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._breakers: dict[str, str] = {}
        self._quarantine: dict[str, float] = {}

    async def merge_breaker(self, pool: str, events: Sequence[Stamped], config: BreakerConfig) -> BreakerState:
        with self._lock:
            state = replay(decode_state(self._breakers.get(pool)), events, config)
            self._breakers[pool] = encode_state(state)
            return state

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        with self._lock:
            for fp, at in entries:
                self._quarantine[fp] = max(at, self._quarantine.get(fp, at))
            kept = sorted(((at, fp) for fp, at in self._quarantine.items() if at >= expired_before), reverse=True)
            self._quarantine = {fp: at for at, fp in kept[:max_entries]}

    async def pull_quarantine(self, since: float) -> list[tuple[str, float]]:
        with self._lock:
            return sorted(((fp, at) for fp, at in self._quarantine.items() if at >= since), key=lambda e: e[1])

    async def close(self) -> None:
        pass


class RedisStateStore:
    """The store in a Redis server (redis-py's asyncio client). A breaker's state is one JSON
    value, merged under WATCH/MULTI (a peer's write in between retries the merge); the quarantine
    is one sorted set, fingerprint -> when it was added."""

    RETRIES = 16

    def __init__(self, url: str, prefix: str = "qladder:", timeout_s: float = 0.5):
        import redis.asyncio as aioredis

        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    async def merge_breaker(self, pool: str, events: Sequence[Stamped], config: BreakerConfig) -> BreakerState:
        from redis.exceptions import WatchError

        key = f"{self.prefix}breaker:{pool}"
        if not events:
            return decode_state(await self._redis.get(key))
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(self.RETRIES):
                try:
                    await pipe.watch(key)
                    state = replay(decode_state(await pipe.get(key)), events, config)
                    pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                    pipe.set(key, encode_state(state), ex=max(60, round(config.window_s + config.open_s) * 4))
                    await pipe.execute()
                    return state
                except WatchError:
                    continue
        raise TimeoutError(f"breaker {pool!r}: {self.RETRIES} merges lost to concurrent writers")

    async def push_quarantine(self, entries: Sequence[tuple[str, float]], expired_before: float,
                              max_entries: int) -> None:
        key = f"{self.prefix}quarantine"
        async with self._redis.pipeline(transaction=True) as pipe:
            if entries:
                pipe.zadd(key, {fp: at for fp, at in entries}, gt=True)  # a later add moves it forward only
            pipe.zremrangebyscore(key, "-inf", f"({expired_before}")
            pipe.zremrangebyrank(key, 0, -max_entries - 1)
            await pipe.execute()

    async def pull_quarantine(self, since: float) -> list[tuple[str, float]]:
        got = await self._redis.zrangebyscore(f"{self.prefix}quarantine", since, "+inf", withscores=True)
        pairs = cast(list[tuple[bytes | str, float]], got)  # withscores: (member, score), which redis-py's types
        return [(fp.decode() if isinstance(fp, bytes) else fp, float(at)) for fp, at in pairs]  # do not narrow

    async def close(self) -> None:
        await self._redis.aclose()


def open_state_store(settings: StateSettings) -> StateStore:
    if settings.backend == "redis":
        return RedisStateStore(settings.url, settings.prefix, settings.timeout_s)
    return MemoryStateStore()


class StateSync:
    """One gateway's state sync: a thread with its own asyncio loop, the store's only user.
    `store`: a factory called on that thread (a Redis client belongs to the loop it was made on).
    `on_status(shared)` is called on every change of `shared` (metrics)."""

    PULL_OVERLAP_S = 2.0  # pulls reach back this far past the last one: peers' clocks and slow writes

    def __init__(self, settings: StateSettings, breakers: dict[str, Any], quarantine: Quarantine,
                 store: Callable[[], StateStore] | None = None,
                 on_status: Callable[[bool], None] | None = None):
        self.settings = settings
        self.breakers = breakers
        self.quarantine = quarantine
        self._factory = store or (lambda: open_state_store(settings))
        self.on_status = on_status
        self.shared = False  # True while the last sync reached the store
        self.last_error: str | None = "not synced yet"
        self.syncs = 0
        self.failures = 0
        self._pulled_to = 0.0  # the newest quarantine entry pulled so far
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
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._store = self._factory()
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
        """Run one sync on the state thread and wait for it (tests, and a gateway's start)."""
        return asyncio.run_coroutine_threadsafe(self._sync(), self._loop).result(timeout_s)

    async def _sync(self) -> bool:
        assert self._store is not None
        try:
            async with self._one:  # the periodic sync and a sync_now never merge one journal twice
                await asyncio.wait_for(self._exchange(self._store), self.settings.timeout_s * 4)
        except Exception as exc:  # the store is away or slow: serve on the local view
            self.failures += 1
            self._status(False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return False
        self.syncs += 1
        self._status(True, None)
        return True

    async def _exchange(self, store: StateStore) -> None:
        for pool, breaker in self.breakers.items():
            events, mark = breaker.journal()
            shared = await asyncio.wait_for(store.merge_breaker(pool, events, breaker.config),
                                            self.settings.timeout_s)
            breaker.adopt(shared, mark)
        fresh, mark = self.quarantine.fresh()
        q = self.quarantine.config
        await asyncio.wait_for(store.push_quarantine(fresh, self.quarantine.clock() - q.ttl_s, q.max_entries),
                               self.settings.timeout_s)
        since = self._pulled_to - self.PULL_OVERLAP_S if self._pulled_to else float("-inf")
        entries = await asyncio.wait_for(store.pull_quarantine(since), self.settings.timeout_s)
        self.quarantine.merge(mark, entries)
        self._pulled_to = max([self._pulled_to, *(at for _, at in entries)])

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
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(self.settings.timeout_s * 8 + 5)

