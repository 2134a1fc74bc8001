"""Endpoint health shared by gateways (engines/endpoint_board.py, `[state]`): a replica that one
gateway ejects is out at the other, through each gateway's real state sync and a real store (the
in-process one and a Redis server started here), on fake replicas (tests/test_replicas_policy.py's
FakeEndpoint: each gateway holds its own client of the same URL, as on real servers)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from qladder.engines.endpoint_board import EndpointBoard, EndpointNews
from qladder.engines.replicas import AUDIT_HOLD_S, NEWS_FRESH_S, OUTLIER_COOLDOWN_S, OUTLIER_FAILS, Replicas
from qladder.server.quarantine import Quarantine, QuarantineConfig
from qladder.server.shared_state import MemoryStateStore, StateSettings, StateSync, open_state_store

from .fakes import Clock
from .test_replicas_policy import FakeEndpoint, collect, tokens, unbroken


class Gateway:
    """One gateway's replicas of the URLs given (its own client of each), its board and its sync."""

    def __init__(self, settings: StateSettings, store: MemoryStateStore | None, urls: list[str],
                 clock: Clock | None = None, **endpoint: dict[str, object]):
        self.board = EndpointBoard()
        self.ends = [FakeEndpoint(u, **endpoint.get(u, {})) for u in urls]  # type: ignore[arg-type]
        kw = {"clock": clock, "wall": clock} if clock is not None else {}
        self.replicas = Replicas(self.ends, probe_every_s=0.01, board=self.board, **kw)  # type: ignore[arg-type]
        quarantine = Quarantine(QuarantineConfig(ttl_s=60), clock or time.time, shared=True)
        self.sync = StateSync(settings, {}, quarantine, store=(lambda: store) if store is not None else None,
                              endpoints=self.board).start()

    async def synced(self) -> None:
        assert await asyncio.to_thread(self.sync.sync_now)

    def close(self) -> None:
        self.sync.close()


@pytest.fixture(params=["memory", "redis"])
def fleet(request, redis_server):
    """Gateways on one store: a MemoryStateStore they all hold, or the Redis server under a prefix
    of this test's own. Their sync loops wait an hour: the test syncs them by hand."""
    made: list[Gateway] = []
    if request.param == "memory":
        settings, store = StateSettings(sync_s=3600), MemoryStateStore()
    else:
        settings, store = StateSettings("redis", redis_server.url, f"t{time.monotonic_ns()}:", sync_s=3600), None

    def gateway(urls: list[str], clock: Clock | None = None, **endpoint: dict[str, object]) -> Gateway:
        made.append(Gateway(settings, store, urls, clock, **endpoint))
        return made[-1]

    yield gateway
    for g in made:
        g.close()


def test_a_replica_one_gateway_ejects_is_out_at_the_other_until_its_own_probe_sees_it_back(fleet):
    """A's stream loses http://x (dropped, /health down): ejected at A. After a sync each, B sends
    nothing to x (B's least-in-flight pick would take x first), says it heard it, and brings it
    back by its own probe when x's /health answers again; A's and B's rejoins eject nobody."""
    a = fleet(["http://x", "http://y"], **{"http://x": {"fail_after": 2, "up": False}})
    b = fleet(["http://x", "http://y"], **{"http://x": {"up": False}})

    async def run() -> None:
        assert tokens(await collect(a.replicas, 8)) == unbroken(8)
        assert (a.replicas.healthy, a.replicas.ejections) == ([False, True], 1)
        await a.synced()
        await b.synced()
        assert tokens(await collect(b.replicas, 8)) == unbroken(8)
        assert b.ends[0].streams == 0 and b.ends[1].streams == 1
        assert (b.replicas.healthy, b.replicas.ejections, b.replicas.heard) == ([False, True], 1, 1)
        a.ends[0].up = b.ends[0].up = True
        for _ in range(200):
            await asyncio.sleep(0.01)
            if a.replicas.healthy == b.replicas.healthy == [True, True]:
                break
        assert a.replicas.healthy == b.replicas.healthy == [True, True]
        assert (a.replicas.rejoins, b.replicas.rejoins) == (1, 1)
        for g in (a, b, a, b):  # both rejoins reach the store and each gateway: nobody is ejected again
            await g.synced()
        await collect(a.replicas, 4)
        await collect(b.replicas, 4)
        assert (a.replicas.healthy, b.replicas.healthy, a.replicas.ejections, b.replicas.ejections) == \
            ([True, True], [True, True], 1, 1)
        assert a.replicas.heard == 0

    asyncio.run(run())


def test_an_outliers_cooldown_found_by_one_gateway_holds_at_the_other_to_the_same_end(fleet):
    """http://x fails every call 2 tokens in while its /health says 200. A blames it
    OUTLIER_FAILS times and ejects it for OUTLIER_COOLDOWN_S; B, told, keeps it out until the same
    (wall-clock) end though its probe finds /health up, then takes it back (B hears it half a
    cooldown after A's ejection: the rest of it, not a whole one)."""
    clock = Clock()
    urls = ["http://x", "http://y", "http://z"]
    a = fleet(urls, clock, **{"http://x": {"broken_after": 2}})
    b = fleet(urls, clock, **{"http://x": {"broken_after": 2}})

    async def run() -> None:
        for _ in range(OUTLIER_FAILS):
            assert tokens(await collect(a.replicas, 6)) == unbroken(6)
        assert a.replicas.healthy == [False, True, True]
        await a.synced()
        await b.synced()
        clock.t += OUTLIER_COOLDOWN_S / 2
        assert tokens(await collect(b.replicas, 6)) == unbroken(6)
        assert b.ends[0].streams == 0 and b.replicas.heard == 1
        await asyncio.sleep(0.1)  # ten of its probe's periods: /health would say 200, the cooldown is not over
        probe = b.replicas._probes.get(0)
        assert probe is not None and not probe.done() and b.ends[0].up
        assert b.replicas.healthy == [False, True, True]
        clock.t += OUTLIER_COOLDOWN_S / 2 + 0.01
        for _ in range(200):
            await asyncio.sleep(0.01)
            if b.replicas.healthy[0]:
                break
        assert b.replicas.healthy == [True, True, True]

    asyncio.run(run())


def replicas_told(news: list[EndpointNews], clock: Clock, n: int = 2, up: bool = True,
                  probe_every_s: float = 0.01) -> tuple[Replicas, list[FakeEndpoint]]:
    """Replicas whose board has just been delivered `news` (as a sync would); `up`: what the
    servers' /health answers this gateway."""
    board = EndpointBoard()
    ends = [FakeEndpoint(f"http://{c}", up=up) for c in "xyzw"[:n]]
    r = Replicas(ends, probe_every_s=probe_every_s, board=board, clock=clock, wall=clock)  # type: ignore[arg-type]
    board.delivered([], news)
    return r, ends


def test_what_a_gateway_does_not_act_on():
    """Old news of an outage (past NEWS_FRESH_S, no cooldown): a gateway that joins later finds it
    out itself. A peer's rejoin: only a gateway's own probe rejoins. News of a URL not in the pool.
    A peer's outlier past the at-most-half cap here. Each of these leaves every replica in rotation
    (or as the cap left it)."""
    clock = Clock()

    async def run() -> None:
        for news in ([EndpointNews("http://x", True, clock.t - NEWS_FRESH_S - 1)],
                     [EndpointNews("http://x", False, clock.t)],
                     [EndpointNews("http://elsewhere", True, clock.t)]):
            r, ends = replicas_told(news, clock)
            await collect(r, 4)
            assert (r.healthy, r.heard, ends[0].streams) == ([True, True], 0, 1), news
        fresh = [EndpointNews("http://x", True, clock.t - 1)]
        r, ends = replicas_told(fresh, clock, up=False)
        await collect(r, 4)
        assert (r.healthy, r.heard, ends[0].streams) == ([False, True], 1, 0)
        # four replicas: at most two out as outliers; a third outlier heard stays in rotation
        r, ends = replicas_told([EndpointNews(f"http://{c}", True, clock.t, OUTLIER_COOLDOWN_S) for c in "xyz"],
                                clock, n=4)
        await collect(r, 4)
        assert sum(r.healthy) == 2 and r.heard == 2 and r.healthy[3]

    asyncio.run(run())


def test_a_gateways_own_ejection_coming_back_after_its_rejoin_is_not_applied():
    """This gateway ejected x and posted it; its probe took x back (and posted that) before the
    store's copy of the ejection came back (a sync whose push of the rejoin failed): its own older
    news leaves x in rotation."""
    clock = Clock()

    async def run() -> None:
        board = EndpointBoard()
        ends = [FakeEndpoint("http://x", up=False), FakeEndpoint("http://y")]
        r = Replicas(ends, probe_every_s=0.01, board=board, clock=clock, wall=clock)  # type: ignore[arg-type]
        r.eject(0)
        down = board.outbox()
        assert [(n.url, n.down) for n in down] == [("http://x", True)]
        board.delivered(down, down)  # in the store
        ends[0].up = True
        for _ in range(500):  # its probe (every 0.01 s): /health up, back
            await asyncio.sleep(0.01)
            if r.healthy[0]:
                break
        up = board.outbox()
        assert r.healthy == [True, True] and [(n.url, n.down) for n in up] == [("http://x", False)]
        assert up[0].at > down[0].at  # stamped after the ejection, at the same wall-clock reading
        board.delivered([], down)  # the push of the rejoin failed: the store still says down
        await collect(r, 4)
        assert (r.healthy, r.heard, ends[0].streams, board.outbox()) == ([True, True], 0, 1, up)

    asyncio.run(run())


def test_a_peers_word_never_takes_the_last_healthy_replica():
    """A peer cut off from the servers ejects both: this gateway, which reaches them, keeps one
    (the other, ejected on its word, is asked at once and is back within a probe)."""
    clock = Clock()

    async def run() -> None:
        # probes a minute apart: x is back within the wait below only if its probe asks at once
        r, ends = replicas_told([EndpointNews("http://x", True, clock.t - 1),
                                 EndpointNews("http://y", True, clock.t - 1)], clock, probe_every_s=60)
        assert tokens(await collect(r, 4)) == unbroken(4)
        assert (r.heard, r.ejections, ends[0].streams, ends[1].streams) == (1, 1, 0, 1)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all(r.healthy):
                break
        assert r.healthy == [True, True] and r.rejoins == 1

    asyncio.run(run())


def test_a_heard_cooldown_runs_from_the_news_time_and_no_longer_than_the_longest():
    """News 4 s old of a 10 s cooldown: 6 s left here. News of a cooldown far past the longest
    (a peer's broken clock or a future version): OUTLIER_COOLDOWN_MAX_S at most."""
    from qladder.engines.replicas import OUTLIER_COOLDOWN_MAX_S

    clock = Clock()

    async def run() -> None:
        r, _ = replicas_told([EndpointNews("http://x", True, clock.t - 4, OUTLIER_COOLDOWN_S)], clock, n=3)
        await collect(r, 4)
        assert r.healthy == [False, True, True] and r._out_until[0] == pytest.approx(clock.t + OUTLIER_COOLDOWN_S - 4)
        r, _ = replicas_told([EndpointNews("http://x", True, clock.t, 1e9)], clock, n=3)
        await collect(r, 4)
        assert r.healthy == [False, True, True] and r._out_until[0] == pytest.approx(clock.t + OUTLIER_COOLDOWN_MAX_S)

    asyncio.run(run())


def test_news_from_a_broken_clock_is_not_believed_and_does_not_spread():
    """News stamped over NEWS_SKEW_S ahead of this gateway's clock is not acted on; news this
    gateway heard from a fast clock does not move the stamps of its own posts; a non-finite or
    negative field does not read as news."""
    from qladder.engines.endpoint_board import NEWS_SKEW_S

    clock = Clock()

    async def run() -> None:
        r, ends = replicas_told([EndpointNews("http://x", True, clock.t + NEWS_SKEW_S + 5)], clock)
        await collect(r, 4)
        assert (r.healthy, r.heard) == ([True, True], 0)
        ahead = clock.t + NEWS_SKEW_S / 2  # within the bound: believed
        r, ends = replicas_told([EndpointNews("http://x", True, ahead)], clock, up=False)
        await collect(r, 4)
        assert (r.healthy, r.heard) == ([False, True], 1)
        ends[0].up = True
        for _ in range(500):
            await asyncio.sleep(0.01)
            if r.healthy[0]:
                break
        assert r.healthy[0] and r.board is not None
        assert [n.at for n in r.board.outbox()] == [clock.t]  # its rejoin, on its own clock

    asyncio.run(run())
    for raw in ('{"url": "http://x", "down": true, "at": NaN, "cooldown_s": 0}',
                '{"url": "http://x", "down": true, "at": 5, "cooldown_s": Infinity}',
                '{"url": "http://x", "down": true, "at": 5, "cooldown_s": -1}', '[1]'):
        assert EndpointNews.decode(raw) is None, raw


def test_a_heard_cooldown_on_an_endpoint_out_already_keeps_the_later_end():
    """x is out here as an outlier for 100 s more; a peer's news of a 20 s cooldown does not
    shorten it; news of a longer one lengthens it."""
    clock = Clock()

    async def run() -> None:
        board = EndpointBoard()
        ends = [FakeEndpoint(f"http://{c}") for c in "xyz"]
        r = Replicas(ends, probe_every_s=0.01, board=board, clock=clock, wall=clock)  # type: ignore[arg-type]
        r._outlier[0], r._out_until[0] = True, clock.t + 100
        r.eject(0)
        board.delivered([], [EndpointNews("http://x", True, clock.t + 1, 20.0)])
        await collect(r, 4)
        assert r._out_until[0] == clock.t + 100
        board.delivered([], [EndpointNews("http://x", True, clock.t + 2, 119.0)])
        await collect(r, 4)
        assert r._out_until[0] == pytest.approx(clock.t + 119.0) and not r.healthy[0]

    asyncio.run(run())


def test_a_record_this_version_cannot_read_is_skipped_and_replaced(redis_server):
    """A value in the endpoints hash that is not news (a hand edit, another version's): the
    exchange skips it, and news sent for that URL replaces it. A record stamped an hour ahead (a
    gateway with a broken clock) is replaced by honest news, and such news is not kept."""
    import redis

    prefix = f"t{time.monotonic_ns()}:"
    future = json.dumps({"url": "http://z", "down": True, "at": time.time() + 3600, "cooldown_s": 0})
    redis.Redis.from_url(redis_server.url).hset(f"{prefix}endpoints", mapping={
        "http://x": "not json", "http://y": '{"url": 1}', "http://z": future})

    async def run() -> None:
        store = open_state_store(StateSettings("redis", redis_server.url, prefix))
        held = await store.exchange_endpoints([])
        assert [n.url for n in held] == ["http://z"]  # (x and y do not read as news)
        x, z = EndpointNews("http://x", True, 5.0), EndpointNews("http://z", False, time.time())
        ahead = EndpointNews("http://w", True, time.time() + 3600)  # a broken clock's: not kept
        assert sorted(await store.exchange_endpoints([x, z, ahead]), key=lambda n: n.url) == [x, z]
        await store.close()

    asyncio.run(run())


def test_the_stores_keep_the_newest_news_per_endpoint(redis_server):
    """The contract of exchange_endpoints on both stores: the newest per URL wins, whoever sent
    it; older news is dropped; every URL's newest comes back."""
    async def check(store) -> None:
        x1, y1 = EndpointNews("http://x", True, 10.0, 20.0), EndpointNews("http://y", False, 11.0)
        assert sorted(await store.exchange_endpoints([x1, y1]), key=lambda n: n.url) == [x1, y1]
        x0, x2 = EndpointNews("http://x", False, 9.5), EndpointNews("http://x", False, 12.25)
        assert sorted(await store.exchange_endpoints([x0]), key=lambda n: n.url) == [x1, y1]
        assert sorted(await store.exchange_endpoints([x2]), key=lambda n: n.url) == [x2, y1]
        assert sorted(await store.exchange_endpoints([]), key=lambda n: n.url) == [x2, y1]
        ahead = EndpointNews("http://y", True, time.time() + 3600)  # a broken clock's: not kept
        assert sorted(await store.exchange_endpoints([ahead]), key=lambda n: n.url) == [x2, y1]
        await store.close()

    asyncio.run(check(MemoryStateStore()))

    async def on_redis() -> None:
        await check(open_state_store(StateSettings("redis", redis_server.url, f"t{time.monotonic_ns()}:")))

    asyncio.run(on_redis())


def test_a_replica_the_audit_condemns_at_one_gateway_is_out_at_the_other_until_its_probes_pass(fleet):
    """A's audit condemns http://x (its /health answers at both gateways): after a sync each, B
    sends x nothing either and no /health probe of B's brings it back; A absolves it (its probes
    passed): the news reaches B, whose own probe takes x back."""
    a = fleet(["http://x", "http://y"])
    b = fleet(["http://x", "http://y"])

    async def run() -> None:
        a.replicas.condemn("http://x")
        await a.synced()
        await b.synced()
        for _ in range(3):
            assert tokens(await collect(b.replicas, 6)) == unbroken(6)
        await asyncio.sleep(0.1)  # ten probe periods of B's, x's /health says 200
        assert (b.ends[0].streams, b.replicas.healthy, b.replicas.heard, b.replicas.condemned) == \
            (0, [False, True], 1, 1)
        a.replicas.absolve("http://x")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if a.replicas.healthy[0]:
                break
        assert a.replicas.healthy == [True, True]
        await a.synced()
        await b.synced()
        await collect(b.replicas, 2)  # (its next pick hears the news)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if b.replicas.healthy[0]:
                break
        assert b.replicas.healthy == [True, True]

    asyncio.run(run())


def test_a_peers_condemnation_holds_no_longer_than_audit_hold_s():
    """Heard, a condemnation lasts AUDIT_HOLD_S from its news's time (its gateway gone, nobody
    would lift it): then this gateway's /health probe brings the replica back, and its own audit
    would find it again."""
    clock = Clock()

    async def run() -> None:
        r, ends = replicas_told([EndpointNews("http://x", True, clock.t - 1, 0.0, audit=True)], clock)
        await collect(r, 4)
        assert (r.healthy, ends[0].streams, r.condemned) == ([False, True], 0, 1)
        await asyncio.sleep(0.05)
        assert r.healthy == [False, True]
        clock.t += AUDIT_HOLD_S
        for _ in range(200):
            await asyncio.sleep(0.01)
            if r.healthy[0]:
                break
        assert r.healthy == [True, True]
        old, _ = replicas_told([EndpointNews("http://x", True, clock.t - AUDIT_HOLD_S - 1, 0.0, audit=True)], clock)
        await collect(old, 4)
        assert old.healthy == [True, True]  # too old to act on

    asyncio.run(run())


def test_audit_news_round_trips_and_older_records_read_as_not_audit():
    n = EndpointNews("http://x", True, 5.0, 0.0, audit=True)
    assert EndpointNews.decode(n.encode()) == n
    assert EndpointNews.decode(json.dumps({"url": "http://x", "down": True, "at": 5.0, "cooldown_s": 0.0})) == \
        EndpointNews("http://x", True, 5.0)
