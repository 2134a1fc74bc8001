"""Gateways sharing breakers and quarantine ([state], qladder.server.shared_state): one contract
run on both stores (in-process memory, and a real Redis server started here), Redis killed and
restarted under a gateway, and two gateways' HTTP apps over one Redis. Where a breaker decides,
the clock is a fake one that both gateways share; syncs are driven by `sync_now`."""

from __future__ import annotations

import dataclasses
import time

import pytest
from fastapi.testclient import TestClient

from qladder.peers.stores import RedisServer
from qladder.server.breaker import Breaker, BreakerConfig, BreakerMode
from qladder.server.metrics import ServerMetrics
from qladder.server.quarantine import Quarantine, QuarantineConfig
from qladder.server.serve import assemble
from qladder.server.shared_state import MemoryStateStore, StateSettings, StateSync, open_state_store
from qladder.server.topology import Topology
from tests.fakes import Clock, FakeClient

CONFIG = BreakerConfig(window_s=30, min_requests=4, max_hazard_rate=0.5, open_s=10, probes=1)
MODEL = "smollm2-135m-instruct"


class Gateway:
    """What one gateway shares: its breaker, its quarantine and its state sync."""

    def __init__(self, settings: StateSettings, clock: Clock, store=None):
        self.breaker = Breaker("int4", CONFIG, clock, shared=True)
        self.quarantine = Quarantine(QuarantineConfig(ttl_s=60), clock, shared=True)
        self.sync = StateSync(settings, {"int4": self.breaker}, self.quarantine,
                              store=(lambda: store) if store is not None else None).start()

    def close(self) -> None:
        self.sync.close()


@pytest.fixture(params=["memory", "redis"])
def two_gateways(request, redis_server):
    """Two gateways on one store: a MemoryStateStore both hold, or the Redis server (a prefix of
    this test's own). Their sync loops wait an hour: the test syncs them by hand."""
    clock = Clock()
    if request.param == "memory":
        settings, store = StateSettings(sync_s=3600), MemoryStateStore()
    else:
        prefix = f"t{time.monotonic_ns()}:"
        settings, store = StateSettings("redis", redis_server.url, prefix, sync_s=3600), None
    a, b = Gateway(settings, clock, store), Gateway(settings, clock, store)
    yield a, b, clock
    a.close()
    b.close()


def test_both_gateways_outcomes_feed_one_window_and_an_open_breaker_is_seen_by_both(two_gateways):
    a, b, clock = two_gateways
    a.breaker.record(hazard=True)
    a.breaker.record(hazard=True)
    b.breaker.record(hazard=True)
    b.breaker.record()
    assert a.breaker.mode is b.breaker.mode is BreakerMode.CLOSED  # neither has min_requests alone
    assert a.sync.sync_now() and b.sync.sync_now()
    assert b.breaker.mode is BreakerMode.OPEN  # 3 hazards of 4 outcomes, from both
    assert a.sync.sync_now() and a.breaker.mode is BreakerMode.OPEN and not a.breaker.allow()
    clock.t += CONFIG.open_s + 1
    assert a.breaker.allow()  # A's half-open probe
    assert a.sync.sync_now() and b.sync.sync_now()
    assert b.breaker.mode is BreakerMode.HALF_OPEN and not b.breaker.allow()  # the one probe is out, at A
    a.breaker.record()  # the probe came back clean
    assert a.breaker.mode is BreakerMode.CLOSED
    assert a.sync.sync_now() and b.sync.sync_now() and b.breaker.mode is BreakerMode.CLOSED
    assert b.breaker.allow() and a.sync.shared and b.sync.shared


def test_a_prompt_quarantined_by_one_gateway_is_quarantined_at_the_other_until_its_ttl(two_gateways):
    a, b, clock = two_gateways
    a.quarantine.add("fp-bad")
    assert not b.quarantine.contains("fp-bad")
    assert a.sync.sync_now() and b.sync.sync_now()
    assert b.quarantine.contains("fp-bad") and not b.quarantine.contains("fp-other")
    clock.t += 30
    b.quarantine.add("fp-later")
    assert b.sync.sync_now() and a.sync.sync_now() and a.quarantine.contains("fp-later")
    clock.t += 31  # fp-bad's 60 s are over, fp-later's are not
    assert not b.quarantine.contains("fp-bad") and a.quarantine.contains("fp-later")
    c_gateway = Gateway(a.sync.settings, clock, getattr(a.sync, "_store", None)
                        if a.sync.settings.backend == "memory" else None)
    try:  # a gateway that joins later pulls what is still in quarantine, and only that
        assert c_gateway.sync.sync_now()
        assert c_gateway.quarantine.contains("fp-later") and not c_gateway.quarantine.contains("fp-bad")
    finally:
        c_gateway.close()


def test_a_restarted_store_keeps_an_open_breaker_open(two_gateways):
    """A store that lost its records (Redis restarted empty) takes each gateway's own state: a
    breaker open on both stays open (it does not close without its probes)."""
    a, b, clock = two_gateways
    for _ in range(4):
        a.breaker.record(hazard=True)
    assert a.sync.sync_now() and b.sync.sync_now() and b.breaker.mode is BreakerMode.OPEN
    store = a.sync._store
    if isinstance(store, MemoryStateStore):
        store._breakers.clear()
    else:
        import redis

        r = redis.Redis.from_url(a.sync.settings.url)
        r.delete(*r.keys(f"{a.sync.settings.prefix}*"))
        r.close()
    assert b.sync.sync_now() and a.sync.sync_now()
    assert a.breaker.mode is BreakerMode.OPEN and b.breaker.mode is BreakerMode.OPEN
    clock.t += 5
    assert not a.breaker.allow() and not b.breaker.allow()


def test_a_merge_applied_twice_counts_its_events_once_and_late_events_do_not_reopen_the_past(two_gateways):
    """The store applied a merge whose answer was lost (the gateway merges the same journal
    again): each event counts once. Then a gateway's old hazards arrive after a peer's newer
    outcomes: they are applied at the newest time, and those older than the window are dropped."""
    import asyncio

    from qladder.server.breaker import BreakerState, Outcome

    a, _b, clock = two_gateways
    store = a.sync._store
    config = BreakerConfig(window_s=30, min_requests=3, max_hazard_rate=0.5, open_s=10, probes=1)
    events = [(clock.t, Outcome(hazard=True)), (clock.t, Outcome())]

    async def merge(gw, evs, mark):
        return await store.merge_breaker("p", gw, BreakerState(), evs, mark, config)

    loop = a.sync._loop
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(10)  # noqa: E731  (the store's loop)
    run(merge("g0", [], 0))  # the record exists (a new store takes the first gateway's own state)
    run(merge("g1", events, 2))
    state = run(merge("g1", events, 2))  # the retry
    assert len(state.window) == 2 and state.mode is BreakerMode.CLOSED
    state = run(merge("g2", [(clock.t + 25, Outcome())], 1))  # a peer, later
    old = [(clock.t - 10, Outcome(hazard=True)), (clock.t + 1, Outcome(hazard=True))]
    state = run(merge("g1", events + old, 4))  # events 3 and 4: one past the window, one inside it
    # the first is dropped (counted, 3 hazards of 5 would open it); the second enters at the newest time
    assert state.mode is BreakerMode.CLOSED and len(state.window) == 4
    assert state.window[-1] == (clock.t + 25, True, False)
    state = run(merge("g2", [(clock.t + 26, Outcome(hazard=True))], 2))
    assert state.mode is BreakerMode.OPEN and state.opened_at == clock.t + 26  # now, not in the past


def test_a_quarantine_add_pushed_late_is_still_pulled_by_a_connected_peer(two_gateways):
    a, b, clock = two_gateways
    a.quarantine.add("fp-late")  # added now, pushed only after B's pulls moved on
    for _ in range(3):
        clock.t += 5
        b.quarantine.add(f"fp-b{clock.t}")
        assert b.sync.sync_now()
    assert a.sync.sync_now() and b.sync.sync_now()
    assert b.quarantine.contains("fp-late")


def test_a_redis_url_the_client_refuses_is_a_config_error():
    from qladder.errors import ConfigError

    with pytest.raises(ConfigError, match="state url"):
        StateSettings("redis", "redis://localhost:notaport/0")


def test_redis_down_the_gateway_serves_on_its_own_view_and_rejoins_with_what_it_saw():
    """Redis killed: syncs fail (bounded by timeout_s), the breaker still opens on this gateway's
    own outcomes, nothing raises; Redis back (empty, as after a crash): the first sync rejoins and
    carries the outcomes seen while it was away, so a second gateway sees the breaker open."""
    redis = RedisServer().start()
    clock = Clock()
    settings = StateSettings("redis", redis.url, sync_s=3600, timeout_s=0.3)
    a = Gateway(settings, clock)
    statuses: list[bool] = []
    a.sync.on_status = statuses.append
    try:
        assert a.sync.sync_now() and a.sync.shared
        redis.stop()
        t0 = time.monotonic()
        assert not a.sync.sync_now()
        assert time.monotonic() - t0 < 10, "a failed sync is bounded by timeout_s"
        assert not a.sync.shared and a.sync.describe()["error"]
        for _ in range(4):
            a.breaker.record(hazard=True)
        assert a.breaker.mode is BreakerMode.OPEN and not a.breaker.allow()  # its own view still works
        a.quarantine.add("fp-while-away")
        assert not a.sync.sync_now()
        redis.start()
        assert a.sync.sync_now() and a.sync.shared and statuses[-2:] == [False, True]
        assert a.breaker.mode is BreakerMode.OPEN
        b = Gateway(settings, clock)
        try:
            assert b.sync.sync_now()
            assert b.breaker.mode is BreakerMode.OPEN and b.quarantine.contains("fp-while-away")
        finally:
            b.close()
    finally:
        a.close()
        redis.close()


def test_the_sync_loop_shows_a_peer_its_open_breaker_within_a_second(redis_server):
    """The real loop (sync_s = 0.2, wall clock): a breaker opened on A is open on B after A's and
    B's next syncs. The wait is bounded at 10 s and the time it took is printed; the 1 s target
    is the fleet benchmark's to judge on a quiet machine, not a unit test's."""
    settings = StateSettings("redis", redis_server.url, f"loop{time.monotonic_ns()}:", sync_s=0.2)
    a_breaker = Breaker("int4", CONFIG, time.time, shared=True)
    b_breaker = Breaker("int4", CONFIG, time.time, shared=True)
    a = StateSync(settings, {"int4": a_breaker}, Quarantine(clock=time.time, shared=True)).start()
    b = StateSync(settings, {"int4": b_breaker}, Quarantine(clock=time.time, shared=True)).start()
    try:
        for _ in range(4):
            a_breaker.record(hazard=True)
        t0 = time.monotonic()
        while b_breaker.mode is not BreakerMode.OPEN and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        seen = time.monotonic() - t0
        print(f"B saw A's open breaker after {seen:.2f} s")
        assert b_breaker.mode is BreakerMode.OPEN, "B never saw the breaker A opened"
    finally:
        a.close()
        b.close()


def test_open_state_store_gives_the_configured_backend(redis_server):
    from qladder.server.shared_state import RedisStateStore

    assert isinstance(open_state_store(StateSettings()), MemoryStateStore)
    assert isinstance(open_state_store(StateSettings("redis", redis_server.url)), RedisStateStore)
    from qladder.errors import ConfigError
    from qladder.server.topology import parse_topology

    with pytest.raises(ConfigError, match="needs url"):
        parse_topology({"state": {"backend": "redis"}})
    with pytest.raises(ConfigError, match="state backend must be one of"):
        parse_topology({"state": {"backend": "etcd"}})
    t = parse_topology({"state": {"backend": "redis", "url": redis_server.url, "sync_s": 0.5}})
    assert t.state.shared and t.state.sync_s == 0.5 and not Topology().state.shared


# -- two gateways' HTTP apps over one Redis ------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(model_info):
    from qladder.engines.llamacpp import LlamaVocab

    v = LlamaVocab(model_info)
    yield v
    v.close()


def _chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def _gateway(vocab, model_info, redis_url: str, prefix: str, clock: Clock):
    t = Topology()
    t = dataclasses.replace(t, server=dataclasses.replace(t.server, allow_faults=True),
                            breaker=BreakerConfig(min_requests=3, open_s=60),
                            state=StateSettings("redis", redis_url, prefix, sync_s=3600))
    fake = FakeClient()
    gw, app = assemble(fake, model_info, vocab, t, ServerMetrics(), (), clock)
    return fake, gw, app


def test_a_faulted_burst_on_gateway_a_sends_gateway_b_to_the_standby(vocab, model_info, redis_server):
    """Through the HTTP apps: three faulted requests at A open A's INT4 breaker and quarantine
    their prompts; after one sync each, B routes a new prompt to the standby (breaker:int4) and a
    quarantined one there too (B never saw it fail); /readyz and /metrics say the state is shared."""
    clock, prefix = Clock(), f"http{time.monotonic_ns()}:"
    _fake_a, gw_a, app_a = _gateway(vocab, model_info, redis_server.url, prefix, clock)
    fake_b, gw_b, app_b = _gateway(vocab, model_info, redis_server.url, prefix, clock)
    faulted = {"model": MODEL, "max_tokens": 4, "qladder": {"faults": ["nan@step=1"]}}
    try:
        with TestClient(app_a) as a, TestClient(app_b) as b:
            for k in range(3):
                a.post("/v1/chat/completions", json={**faulted, "messages": [{"role": "user", "content": f"p{k}"}]})
            assert gw_a.breakers["int4"].mode is BreakerMode.OPEN
            assert gw_b.breakers["int4"].mode is BreakerMode.CLOSED
            assert gw_a.state is not None and gw_b.state is not None
            assert gw_a.state.sync_now() and gw_b.state.sync_now()
            new = b.post("/v1/chat/completions", json=_chat("new"))
            assert new.json()["qladder"]["route"] == "breaker:int4" and fake_b.submitted[-1].start_rung == 1
            seen = b.post("/v1/chat/completions", json=_chat("p0"))
            assert seen.json()["qladder"]["route"] == "quarantine" and fake_b.submitted[-1].start_rung == 1
            ready = b.get("/readyz").json()
            metrics = b.get("/metrics").text
        assert ready["state"]["backend"] == "redis" and ready["state"]["shared"] and ready["breakers"]["int4"] == "open"
        assert "qladder_state_shared 1.0" in metrics and 'qladder_state_syncs{result="ok"}' in metrics
        assert 'qladder_breaker_transitions_total{pool="int4",to="open"} 1.0' in metrics  # B's own view changed
    finally:
        for gw in (gw_a, gw_b):
            if gw.state is not None:
                gw.state.close()
