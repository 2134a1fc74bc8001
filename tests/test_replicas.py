"""A pool of replicas for real (engines/replicas.py): two llama-servers on the embedded GGUF as
rung 0, one killed with SIGKILL mid-stream. Its answers go on at the sibling by token ids (no
hazard, no handoff, no climb), equal to the unbroken greedy answers; the dead replica is ejected
at once and rejoins when it is back."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest

from qladder.engines.replicas import Replicas
from qladder.errors import ConfigError
from qladder.health.guard import GUARD_PRESETS
from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.server.topology import parse_topology
from qladder.serving import ServingConfig, ServingEngine

from .conftest import get_engine

pytestmark = pytest.mark.slow
PROMPT = "Write a long story about a dragon who learns to bake bread."


def _wait(cond, what: str, timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.01)
    return time.monotonic() - t0


def _two_streams_then(se: ServingEngine, rung: Replicas, ids: list[int], params: SamplingParams, after: int,
                      kill: Callable[[], None], join_s: float) -> list:
    """Two requests of `ids` at once, one streaming on each replica; `after` tokens later `kill`
    runs (mid-stream). Their results, once both threads are done."""
    results: list = [None, None]

    def run(k: int) -> None:
        results[k] = se.generate_sync(se.request(ids, params))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    _wait(lambda: rung.inflight == [1, 1], "one stream on each replica")
    steps = se.scheduler.steps
    _wait(lambda: se.scheduler.steps >= steps + after, f"{after} more tokens")
    kill()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), f"a request still running {join_s:.0f} s after the kill"
    return results


def test_a_replica_killed_mid_stream_its_answers_go_on_at_the_sibling_token_identical(model_info):
    servers = [LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024).start() for _ in range(2)]
    se = ServingEngine(ServingConfig(remote_url=tuple(s.base_url for s in servers)),
                       standby_engines=[get_engine("fp32")])
    try:
        rung = se.int4
        assert isinstance(rung, Replicas) and rung.n_slots == 4
        ids = user_prompt_ids(se.info.chat_template, PROMPT, rung.tokenize)
        params = SamplingParams(max_tokens=64)
        unbroken = se.generate_sync(se.request(ids, params))  # the reference: no server dies
        assert unbroken.hazards == [] and len(unbroken.token_ids) == 64
        results = _two_streams_then(se, rung, ids, params, 16, servers[0].proc.kill, 180)  # SIGKILL, mid-stream
        assert rung.healthy == [False, True] and rung.migrations == 1 and rung.ejections == 1
        assert sorted(r.timings.get("migrations", 0) for r in results) == [0, 1]  # the answer says it moved
        for r in results:
            assert r is not None and r.hazards == [] and r.handoffs == [] and not r.fallback
            assert set(r.token_rungs) == {"llama-server"}
            assert r.token_ids == unbroken.token_ids  # the answer survived its server, token for token
        assert se.scheduler.healthy  # the rung stays up: a sibling is
        st = se.stats()
        assert (st["int4_endpoints"], st["int4_endpoints_healthy"], st["int4_migrations"]) == (2, 1, 1)
        port = servers[0].port
        servers[0].stop()  # (reaps the killed process)
        servers[0] = LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024, port=port).start()
        took = _wait(lambda: rung.healthy == [True, True], "the restarted replica to rejoin", 30)
        print(f"rejoined {took:.2f} s after its /health answered")
        again = se.generate_sync(se.request(ids, SamplingParams(max_tokens=8)))
        assert again.hazards == [] and again.token_ids == unbroken.token_ids[:8]
    finally:
        se.close()
        for s in servers:
            s.stop()


def test_a_migrated_stream_waits_for_a_busy_sibling_as_for_a_first_token(model_info):
    """The sibling is busy (one slot, a long answer in it): the migrated stream's next token comes
    only after that answer and the prefill, seconds past the step deadline (2 s). That wait is
    a first token's (`RemoteResumed`), not a stall: no deadline hazard, no climb, the same answer."""
    servers = [LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024).start() for _ in range(2)]
    se = ServingEngine(ServingConfig(remote_url=tuple(s.base_url for s in servers)),
                       standby_engines=[get_engine("fp32")])
    try:
        rung = se.int4
        assert isinstance(rung, Replicas)
        ids = user_prompt_ids(se.info.chat_template, "Name three colors.", rung.tokenize)
        long_ids = user_prompt_ids(se.info.chat_template, PROMPT, rung.tokenize)
        unbroken = se.generate_sync(se.request(ids, SamplingParams(max_tokens=32, ignore_eos=True)))
        results: dict[str, object] = {}

        def run(name: str, prompt: list[int], n: int) -> None:
            results[name] = se.generate_sync(se.request(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))

        short = threading.Thread(target=run, args=("short", ids, 32))
        short.start()
        _wait(lambda: rung.inflight == [1, 0], "the short answer on replica 0")
        long = threading.Thread(target=run, args=("long", long_ids, 300))
        long.start()
        _wait(lambda: rung.inflight == [1, 1], "the long answer on replica 1")
        steps = se.scheduler.steps
        _wait(lambda: se.scheduler.steps >= steps + 8, "8 more tokens")
        servers[0].proc.kill()
        short.join(180)
        long.join(180)
        r = results["short"]
        assert r.hazards == [] and r.handoffs == [] and r.token_ids == unbroken.token_ids, r.hazards
        assert rung.migrations == 1 and results["long"].hazards == []
    finally:
        se.close()
        for s in servers:
            s.stop()


def test_every_replica_down_climbs_to_the_standby(model_info):
    servers = [LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024).start() for _ in range(2)]
    se = ServingEngine(ServingConfig(remote_url=tuple(s.base_url for s in servers)),
                       standby_engines=[get_engine("fp32")])
    try:
        for s in servers:
            s.stop()
        ids = user_prompt_ids(se.info.chat_template, "Name three colors.", se.int4.tokenize)
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=8)))
        assert r.hazards and r.hazards[0].check == "engine_error" and r.token_rungs[-1] == "fp32"
        assert not r.fallback and not se.scheduler.healthy
    finally:
        se.close()


def test_every_replica_killed_mid_stream_the_answers_climb_and_the_rung_is_down_until_one_is_back(model_info):
    """Both replicas die under two streams (cut short, then refused at the sibling): each answer
    climbs to the standby (no fallback, no 5xx), and the pool marks the rung down
    (EndpointsDownError), so the next request starts above it, until a replica answers again."""
    servers = [LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024).start() for _ in range(2)]
    # not about deadlines: a busy test machine's slow fp32 step must not end an answer on the last rung
    guard = dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=60.0)
    se = ServingEngine(ServingConfig(remote_url=tuple(s.base_url for s in servers), ladder=LadderConfig(guard=guard)),
                       standby_engines=[get_engine("fp32")])
    try:
        rung = se.int4
        assert isinstance(rung, Replicas)
        ids = user_prompt_ids(se.info.chat_template, PROMPT, rung.tokenize)
        def kill_both() -> None:
            for s in servers:
                s.proc.kill()

        results = _two_streams_then(se, rung, ids, SamplingParams(max_tokens=48, ignore_eos=True), 8, kill_both, 300)
        for r in results:
            assert r is not None and not r.fallback and len(r.token_ids) == 48, (r.hazards, r.handoffs)
            assert r.hazards[0].check == "engine_error" and r.token_rungs[-1] == "fp32"
        assert rung.healthy == [False, False] and not se.scheduler.healthy  # the rung is down
        after = se.generate_sync(se.request(ids, SamplingParams(max_tokens=4)))
        assert after.hazards == [] and set(after.token_rungs) == {"fp32"}  # started above it
        port = servers[1].port
        servers[1].stop()
        servers[1] = LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024, port=port).start()
        _wait(lambda: se.scheduler.healthy and rung.healthy[1], "the pool's probe to find replica 1 back", 30)
        back = se.generate_sync(se.request(ids, SamplingParams(max_tokens=4)))
        assert back.hazards == [] and set(back.token_rungs) == {"llama-server"}
    finally:
        se.close()
        for s in servers:
            s.stop()


def test_a_replica_one_gateway_ejects_is_out_at_its_peer_through_redis(model_info, settings, redis_server, tmp_path):
    """Two gateways (`qladder serve`'s build, [state] on a real Redis) over two real llama-servers;
    replica 0 is killed. A request at A finds it dead (refused, /health down): ejected, the answer
    goes on at replica 1. After a sync each, B's request never tries replica 0 (no migration: B's
    least-in-flight pick would take it first) and B's /metrics says it heard the ejection; both
    gateways' own probes bring it back after its restart."""
    from fastapi.testclient import TestClient

    from qladder.server.serve import build_server

    servers = [LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024).start() for _ in range(2)]
    t = parse_topology({"server": {"incidents": str(tmp_path / "incidents.sqlite3")},
                        "pools": [{"name": "edge", "rungs": ["llama-server"], "urls": [s.base_url for s in servers],
                                   "slots": 2, "weight": 1.0}],
                        "state": {"backend": "redis", "url": redis_server.url, "prefix": f"e{time.monotonic_ns()}:",
                                  "sync_s": 3600}})
    gateways = []
    try:
        gateways = [build_server(t, settings) for _ in range(2)]
        a, b = gateways
        servers[0].proc.kill()
        ask = {"model": "smollm2-135m-instruct", "max_tokens": 6, "temperature": 0,
               "messages": [{"role": "user", "content": "Name three colors."}]}
        with TestClient(a.app) as http_a, TestClient(b.app) as http_b:
            first = http_a.post("/v1/chat/completions", json=ask)
            assert first.status_code == 200 and first.json()["qladder"]["hazards"] == []
            rung_a, rung_b = a.engine.int4, b.engine.int4
            assert isinstance(rung_a, Replicas) and isinstance(rung_b, Replicas)
            assert (rung_a.healthy, rung_a.migrations, rung_a.heard) == ([False, True], 1, 0)
            assert a.gateway.state is not None and b.gateway.state is not None
            assert a.gateway.state.sync_now() and b.gateway.state.sync_now()
            second = http_b.post("/v1/chat/completions", json=ask)
            assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == \
                first.json()["choices"][0]["message"]["content"]
            assert (rung_b.healthy, rung_b.migrations, rung_b.heard) == ([False, True], 0, 1)
            assert 'qladder_endpoint_events{pool="edge",what="heard"} 1.0' in http_b.get("/metrics").text
            port = servers[0].port
            servers[0].stop()
            servers[0] = LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024, port=port).start()
            _wait(lambda: rung_a.healthy == rung_b.healthy == [True, True], "both gateways to take it back", 10)
    finally:
        for g in gateways:
            g.close()
        for s in servers:
            s.stop()


def test_a_pool_takes_url_or_urls_not_both():
    base = {"name": "edge", "rungs": ["llama-server"], "weight": 1.0, "handoff_to": "gpu"}
    gpu = {"name": "gpu", "rungs": ["fp32"]}
    t = parse_topology({"pools": [{**base, "urls": ["http://a:1", "http://b:2"]}, gpu]})
    assert t.int4.endpoints == ("http://a:1", "http://b:2")
    assert parse_topology({"pools": [{**base, "url": "http://a:1"}, gpu]}).int4.endpoints == "http://a:1"
    for bad, why in (({"url": "http://a:1", "urls": ["http://b:2"]}, "not both"),
                     ({"urls": ["http://a:1", "http://a:1"]}, "twice"),
                     ({"urls": ["ftp://a:1"]}, "needs url")):
        with pytest.raises(ConfigError, match=why):
            parse_topology({"pools": [{**base, **bad}, gpu]})
