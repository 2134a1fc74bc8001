"""The server's pure parts (breaker, quarantine, router, topology, incident writer) and its HTTP
layer over a fake engine client (fast): every bad request a 4xx with an OpenAI error body."""

from __future__ import annotations

import dataclasses
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from qladder.errors import AllPoolsOpen, ConfigError
from qladder.incidents import Incident, IncidentStore, IncidentWriter
from qladder.server.breaker import Admit, Breaker, BreakerConfig, BreakerMode, BreakerState, Outcome, transition
from qladder.server.metrics import ServerMetrics
from qladder.server.quarantine import Quarantine, QuarantineConfig
from qladder.server.router import Router
from qladder.server.serve import assemble
from qladder.server.topology import PoolConfig, Topology, load_topology, parse_topology
from qladder.types import Hazard

from .fakes import Clock, FakeClient

MODEL = "smollm2-135m-instruct"



# -- breaker ---------------------------------------------------------------------------------------------

def test_breaker_opens_on_a_burst_of_hazards_and_closes_after_clean_probes():
    cfg = BreakerConfig(window_s=30, min_requests=4, max_hazard_rate=0.5, open_s=10, probes=2)
    clock = Clock()
    changes: list[tuple[str, str]] = []
    b = Breaker("int4", cfg, clock, on_change=lambda _p, old, new: changes.append((str(old), str(new))))
    for _ in range(4):
        assert b.allow()
        b.record()
    for _ in range(4):  # a burst: 4 of 8 hazards is 0.5, not above the bound
        b.record(hazard=True)
    assert b.mode is BreakerMode.CLOSED
    b.record(hazard=True)  # 5 of 9
    assert b.mode is BreakerMode.OPEN and not b.allow()
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.2
    assert b.allow() and b.mode is BreakerMode.HALF_OPEN  # the first probe
    assert b.allow() and not b.allow()  # probes=2: a third request is refused while they run
    b.record()
    b.record()
    assert b.mode is BreakerMode.CLOSED and b.allow()
    assert changes == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_a_failed_probe_opens_the_breaker_again_and_old_outcomes_leave_the_window():
    cfg = BreakerConfig(window_s=5, min_requests=2, max_error_rate=0.4, open_s=1, probes=1)
    s = BreakerState()
    s = transition(s, Outcome(error=True), 0.0, cfg)
    s = transition(s, Outcome(), 10.0, cfg)  # the error is 10 s old: out of the window, 1 outcome
    assert s.mode is BreakerMode.CLOSED and len(s.window) == 1
    s = transition(s, Outcome(error=True), 10.5, cfg)  # 1 of 2 errors = 0.5 > 0.4
    assert s.mode is BreakerMode.OPEN
    s = transition(s, Admit(), 11.6, cfg)
    assert s.mode is BreakerMode.HALF_OPEN and s.admitted
    s = transition(s, Outcome(hazard=True), 11.7, cfg)
    assert s.mode is BreakerMode.OPEN and s.opened_at == 11.7


def test_breaker_config_rejects_nonsense():
    with pytest.raises(ConfigError):
        BreakerConfig(max_hazard_rate=0.0)
    with pytest.raises(ConfigError):
        BreakerConfig(probes=0)


# -- quarantine and router ------------------------------------------------------------------------------

def test_quarantine_expires_after_its_ttl_and_evicts_the_least_recently_used():
    clock = Clock()
    q = Quarantine(QuarantineConfig(ttl_s=60, max_entries=2), clock)
    q.add("a")
    q.add("b")
    assert q.contains("a")  # a is now the most recently used
    q.add("c")  # evicts b
    assert not q.contains("b") and q.contains("a") and q.contains("c") and q.evicted == 1
    clock.t += 61
    assert not q.contains("a") and len(q) == 0


def _router(weights=(1.0, 0.0), clock=None):
    clock = clock or Clock()
    pools = (PoolConfig("int4", ("int4",), weight=weights[0], handoff_to="standby"),
             PoolConfig("standby", ("fp32",), weight=weights[1]))
    breakers = {p.name: Breaker(p.name, BreakerConfig(min_requests=2, open_s=5), clock) for p in pools}
    q = Quarantine(clock=clock)
    return Router(pools, breakers, q), breakers, q


def test_router_weights_split_new_requests_and_keep_the_standby_reserve():
    r, _, _ = _router((0.8, 0.2))
    starts = [r.route(f"p{k}", standby_free=True).pool for k in range(100)]
    assert starts.count("standby") == 20  # smooth weighted round-robin: exactly the weights' share
    assert all(r.route(f"q{k}", standby_free=False).pool == "int4" for k in range(20))


def test_router_sends_quarantined_prompts_and_open_breakers_to_the_standby():
    r, breakers, q = _router()
    q.add("bad")
    assert r.route("bad", standby_free=False).reason == "quarantine"
    assert r.route("good", standby_free=True).pool == "int4"
    breakers["int4"].record(hazard=True)
    breakers["int4"].record(hazard=True)
    route = r.route("good", standby_free=True)
    assert (route.pool, route.start_rung, route.reason) == ("standby", 1, "breaker:int4")
    breakers["standby"].record(error=True)
    breakers["standby"].record(error=True)
    with pytest.raises(AllPoolsOpen):
        r.route("good", standby_free=True)


def test_router_passes_over_a_pool_the_engine_reports_down_without_spending_a_probe():
    clock = Clock()
    r, breakers, _ = _router(clock=clock)
    breakers["int4"].record(error=True)
    breakers["int4"].record(error=True)
    clock.t += 100.0  # past open_s: the next admission would be a half-open probe
    down = r.route("good", standby_free=True, down=frozenset({"int4"}))
    assert (down.pool, down.reason) == ("standby", "down:int4")
    assert str(breakers["int4"].mode) == "open"  # no probe was spent while the server is away
    assert r.route("good", standby_free=True).pool == "int4" and str(breakers["int4"].mode) == "half_open"


# -- topology ----------------------------------------------------------------------------------------------

def test_topology_defaults_serve_int4_with_an_fp32_standby():
    t = Topology()
    assert (t.int4.name, t.int4.slots, t.int4.threads, t.int4.handoff_to) == ("int4", 8, 1, "standby")
    assert t.standby is not None and t.standby.rungs == ("fp32",) and t.standby.weight == 0.0


def test_topology_file_round_trip(tmp_path):
    f = tmp_path / "q.toml"
    f.write_text('[server]\nallow_faults = true\n[breaker]\nmin_requests = 4\n'
                 '[[pools]]\nname = "fast"\nrungs = ["int4"]\nslots = 4\nweight = 1\nhandoff_to = "safe"\n'
                 '[[pools]]\nname = "safe"\nrungs = ["fp32"]\nsessions = 2\n')
    t = load_topology(f)
    assert t.server.allow_faults and t.breaker.min_requests == 4 and t.int4.slots == 4 and t.int4.weight == 1.0
    assert t.standby is not None and t.standby.name == "safe" and t.standby.sessions == 2


def test_topology_reports_every_mistake_one_line_each(tmp_path):
    data = {"server": {"guard": "nope", "colour": 1}, "bogus": {},
            "pools": [{"name": "a", "rungs": ["int4", "fp32"], "handoff_to": "zz"},
                      {"name": "b", "rungs": ["fp64"], "slots": "8"}]}
    with pytest.raises(ConfigError) as e:
        parse_topology(data, "q.toml")
    msg = str(e.value)
    for part in ("unknown section [bogus]", "unknown key 'colour'", "pools[1].slots: expected int",
                 "an INT4 pool has one rung", "handoff_to names no pool"):
        assert part in msg, (part, msg)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_topology(bad)
    with pytest.raises(ConfigError, match="guard: unknown preset"):
        parse_topology({"server": {"guard": "nope"}})
    for key in ("draft_check", "drift_window", "drift_bound"):  # retired: refused with what replaced them
        with pytest.raises(ConfigError, match=f"server: '{key}' was retired .*precision = \"verified\""):
            parse_topology({"server": {key: 0}})


def test_the_default_decode_mode_is_fast():
    from qladder.config import Settings
    from qladder.server.serve import serving_config

    t = parse_topology({})
    assert t.int4.precision == "fast"
    c = serving_config(t, Settings.from_env())
    assert c.ladder.guard.draft.verify_tokens == 8  # a flagged input's first tokens, where a rung above can score


def test_the_audit_and_its_test_are_on_by_default_where_an_in_process_standby_can_score():
    from qladder.config import Settings
    from qladder.health.detector import committed, committed_drift_bound
    from qladder.server.serve import serving_config
    from qladder.server.topology import AUDIT_FLOOR

    s = Settings.from_env()
    c = serving_config(parse_topology({}), s)
    assert c.audit_rate == AUDIT_FLOOR == 0.05 and c.audit_spare_rate == 0.5 and c.detector == committed()
    assert c.audit_budget == 0.1
    # and DriftWatch, its bound the committed calibration's (unset verify_below; 0 turns it off)
    assert parse_topology({}).server.verify_below is None and 0.9 < committed_drift_bound() < 1.0
    assert parse_topology({"server": {"verify_below": 0}}).server.verify_below == 0.0
    off = serving_config(parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0,
                                                    "handoff_to": "s", "audit_rate": 0},
                                                   {"name": "s", "rungs": ["fp32"]}]}), s)
    assert off.audit_rate == 0.0 and off.audit_spare_rate == 0.0 and off.detector is None
    undetected = serving_config(parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0,
                                                           "handoff_to": "s", "detect": False},
                                                          {"name": "s", "rungs": ["fp32"]}]}), s)
    assert undetected.audit_rate == 0.05 and undetected.detector is None
    remote = parse_topology({"pools": [{"name": "edge", "rungs": ["llama-server"], "url": "http://a:1", "weight": 1.0,
                                        "handoff_to": "gpu"}, {"name": "gpu", "rungs": ["vllm"], "url": "http://b:2"}]})
    # a vLLM standby audits too (its prompt logprobs: serving/remote_auditor.py)
    assert serving_config(remote, s).audit_rate == AUDIT_FLOOR and serving_config(remote, s).detector == committed()
    # llama-server replicas beside an in-process standby: audited (each replica judged apart)
    replicas = serving_config(parse_topology({"pools": [
        {"name": "edge", "rungs": ["llama-server"], "urls": ["http://a:1", "http://a:2"], "weight": 1.0,
         "handoff_to": "s"}, {"name": "s", "rungs": ["fp32"]}]}), s)
    assert replicas.audit_rate == AUDIT_FLOOR and replicas.detector == committed()
    with pytest.raises(ConfigError, match="audit_rate needs a standby"):
        parse_topology({"pools": [{"name": "edge", "rungs": ["llama-server"], "url": "http://a:1", "weight": 1.0,
                                   "audit_rate": 0.1}]})
    with pytest.raises(ConfigError, match="audit_budget must be in"):
        parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s",
                                   "audit_budget": 1.5}, {"name": "s", "rungs": ["fp32"]}]})
    with pytest.raises(ConfigError, match="audit_spare_rate must be in"):
        parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s",
                                   "audit_spare_rate": 2}, {"name": "s", "rungs": ["fp32"]}]})
    # the prompt cache's budget reaches the scheduler; a negative one is refused
    cached = parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s",
                                        "prompt_cache_mb": 3}, {"name": "s", "rungs": ["fp32"]}]})
    assert serving_config(cached, s).scheduler.prompt_cache_bytes == 3 << 20
    with pytest.raises(ConfigError, match="prompt_cache_mb must be >= 0"):
        parse_topology({"pools": [{"name": "int4", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s",
                                   "prompt_cache_mb": -1}, {"name": "s", "rungs": ["fp32"]}]})


def test_a_remote_pool_needs_its_url_and_only_a_remote_rung_takes_one():
    ok = parse_topology({"pools": [{"name": "edge", "rungs": ["llama-server"], "url": "http://10.0.0.5:8080",
                                    "weight": 1.0, "handoff_to": "safe"},
                                   {"name": "safe", "rungs": ["fp32"]}]})
    assert ok.int4.url == "http://10.0.0.5:8080" and ok.int4.kind == "int4"
    with pytest.raises(ConfigError) as e:
        parse_topology({"pools": [{"name": "edge", "rungs": ["llama-server"], "weight": 1.0, "handoff_to": "s"},
                                  {"name": "s", "rungs": ["fp32"], "url": "http://x"}]})
    assert "needs url" in str(e.value) and "url and urls are for a remote rung" in str(e.value)
    both = parse_topology({"pools": [{"name": "edge", "rungs": ["llama-server"], "url": "http://a:1", "weight": 1.0,
                                      "handoff_to": "gpu"}, {"name": "gpu", "rungs": ["vllm"], "url": "http://b:2"}]})
    assert both.standby is not None and both.standby.url == "http://b:2" and both.standby.kind == "standby"
    with pytest.raises(ConfigError, match="a vllm rung needs url"):
        parse_topology({"pools": [{"name": "i", "rungs": ["int4"], "weight": 1.0, "handoff_to": "gpu"},
                                  {"name": "gpu", "rungs": ["vllm"]}]})


def test_a_pool_may_verify_only_with_a_rung_to_draft_and_one_above_it_to_decide():
    pools = [{"name": "i", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s", "precision": "verified"},
             {"name": "s", "rungs": ["fp32"]}]
    assert parse_topology({"pools": pools}).int4.precision == "verified"
    assert Topology().int4.precision == "fast"
    with pytest.raises(ConfigError, match="precision must be one of fast, verified"):
        parse_topology({"pools": [{**pools[0], "precision": "exact"}, pools[1]]})
    with pytest.raises(ConfigError, match="needs a standby pool to hand off to whose first rung verifies"):
        parse_topology({"pools": [pools[0], {"name": "s", "rungs": ["vllm"], "url": "http://b:2"}]})
    remote = [{**pools[0], "rungs": ["llama-server"], "url": "http://a:1"}, {"name": "s", "rungs": ["vllm"],
                                                                            "url": "http://b:2"}]
    assert parse_topology({"pools": remote}).int4.precision == "verified"  # llama-server drafts, vLLM decides
    with pytest.raises(ConfigError, match="needs a standby pool to hand off to whose first rung verifies"):
        parse_topology({"pools": [remote[0], pools[1]]})
    with pytest.raises(ConfigError, match="is an INT4 pool's"):
        parse_topology({"pools": [{**pools[0], "precision": "fast"}, {**pools[1], "precision": "verified"}]})


# -- incident writer ---------------------------------------------------------------------------------------

def _incident(k: int) -> Incident:
    return Incident(f"r{k}", "fp", [1, 2, 3], "hello", Hazard("nonfinite", "int4", k, float("nan")),
                    "handoff:fp32", 3.0, ["nan@step=1"], time.time())


def test_incident_writer_commits_off_the_caller_thread_and_redacts(tmp_path):
    store = IncidentStore(tmp_path / "i.sqlite3", redact=True)
    commits: list[int] = []
    w = IncidentWriter(store, on_commit=commits.append)
    for k in range(50):
        w(_incident(k))
    w.close()
    assert store.count() == 50 and sum(commits) == 50 and w.dropped == 0
    row = store.rows(1)[0]
    assert row["prompt_text"] is None and row["prompt_ids"] == "null" and row["prompt_hash"] == "fp"
    assert row["value"] == "nan" and store.get(row["id"])["request_id"] == "r49"
    store.close()
    db = sqlite3.connect(tmp_path / "i.sqlite3")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- the HTTP layer over a fake client ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(model_info):
    from qladder.engines.llamacpp import LlamaVocab

    v = LlamaVocab(model_info)
    yield v
    v.close()


def test_a_closed_vocabulary_raises_instead_of_calling_into_freed_llama_cpp(model_info):
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.errors import EngineError

    v = LlamaVocab(model_info)
    assert v.tokenize("hi", False)
    v.close()
    with pytest.raises(EngineError, match="was closed"):
        v.tokenize("hi", False)
    with pytest.raises(EngineError, match="was closed"):
        v.detokenize([1, 2])


def _app(vocab, model_info, client=None, api_keys=(), **server):
    t = Topology()
    t = dataclasses.replace(t, server=dataclasses.replace(t.server, **server),
                            breaker=BreakerConfig(min_requests=3, open_s=60))
    client = client or FakeClient()
    gw, app = assemble(client, model_info, vocab, t, ServerMetrics(), api_keys)
    return client, gw, app


BAD = [
    ("chat", b"{bad json", 400, "invalid_json"),
    ("chat", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ("chat", {"model": MODEL, "messages": []}, 400, "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, 400, "unsupported_parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400,
     "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400,
     "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "unsupported_parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "unsupported_parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400,
     "invalid_value"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
     400, "unsupported_parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "qladder": {"faults": ["nan@step=1"]}},
     400, "unsupported_parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "qladder": {"x": 1}}, 400,
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "invalid_value"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "LONG_CLEAN_IDS"}, 400, "invalid_value"),  # over the context
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "invalid_value"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "code"), BAD)
def test_bad_requests_get_a_4xx_with_an_openai_error_body(vocab, model_info, endpoint, body, status, code):
    _, _, app = _app(vocab, model_info)
    if isinstance(body, dict) and body.get("prompt") == "LONG_CLEAN_IDS":  # ids the input defence keeps as they are
        body = {**body, "prompt": vocab.tokenize(" ".join(f"Item {i} is number {i * 7 % 1000}." for i in range(400)),
                                                 False)}
        assert len(body["prompt"]) > 2048
    with TestClient(app) as c:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = c.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]


def test_oversized_bodies_get_413_declared_or_streamed(vocab, model_info):
    _, _, app = _app(vocab, model_info, max_body_bytes=4096)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 9000}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks():
            for _ in range(10):
                yield b" " * 1000

        r = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        text = c.get("/metrics").text
    assert 'qladder_requests_total{endpoint="chat",status="413"} 2.0' in text


def test_a_full_queue_answers_429_with_retry_after(vocab, model_info):
    fake = FakeClient(max_live=0)
    _, _, app = _app(vocab, model_info, client=fake)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "queue_full"


def test_api_keys_are_required_when_configured(vocab, model_info):
    _, _, app = _app(vocab, model_info, api_keys=("s3cret",))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 401
        assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/healthz").status_code == 200  # probes need no key


def test_a_request_says_whether_its_client_reads_the_answer_as_it_is_written(vocab, model_info):
    """`stream` in the body becomes Request.streamed: an answer read whole (the openai client's
    default) may be withdrawn entirely from an endpoint the audit ejects; a streamed one may not."""
    fake, _, app = _app(vocab, model_info)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert [r.streamed for r in fake.submitted] == [False, True]


def test_faults_are_injected_only_where_the_operator_allowed_them(vocab, model_info):
    fake, _, app = _app(vocab, model_info, allow_faults=True)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
            "qladder": {"faults": ["nan@step=1"]}}
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=body)
        bad = c.post("/v1/chat/completions", json={**body, "qladder": {"faults": ["nan@step=x"]}})
    assert r.status_code == 200 and r.json()["qladder"]["handoffs"][0]["to_rung"] == "fp32"
    assert r.headers["x-qladder-tokens-per-rung"] == "int4=1,fp32=3"
    assert bad.status_code == 400
    assert [str(f) for f in fake.submitted[0].faults] == ["nan@step=1"]


def test_breaker_and_quarantine_route_through_the_gateway(vocab, model_info):
    fake, gw, app = _app(vocab, model_info, allow_faults=True)
    faulted = {"model": MODEL, "max_tokens": 4, "qladder": {"faults": ["nan@step=1"]}}
    with TestClient(app) as c:
        first = c.post("/v1/chat/completions", json={**faulted, "messages": [{"role": "user", "content": "p0"}]})
        again = c.post("/v1/chat/completions", json={**faulted, "messages": [{"role": "user", "content": "p0"}]})
        assert first.json()["qladder"]["pool"] == "int4" and again.json()["qladder"]["route"] == "quarantine"
        for k in (1, 2):
            c.post("/v1/chat/completions", json={**faulted, "messages": [{"role": "user", "content": f"p{k}"}]})
        assert gw.breakers["int4"].mode is BreakerMode.OPEN  # 3 of 3 INT4 requests hit a hazard
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "new"}]})
        assert r.json()["qladder"]["route"] == "breaker:int4" and fake.submitted[-1].start_rung == 1
        ready = c.get("/readyz").json()
        metrics = c.get("/metrics").text
    assert ready["breakers"]["int4"] == "open" and ready["ready"]  # the standby still serves
    assert 'qladder_breaker_state{pool="int4"} 2.0' in metrics
    assert 'qladder_breaker_transitions_total{pool="int4",to="open"} 1.0' in metrics
    assert "qladder_quarantine_size 3.0" in metrics


def test_a_standby_may_put_int8_under_full_precision():
    """INT4 -> INT8 -> FP32 in the topology: int8 only as an in-process standby's first rung; the
    audit and verified decoding read full precision (never int8's answers)."""
    from qladder.config import Settings
    from qladder.health.detector import committed
    from qladder.server.serve import serving_config
    from qladder.server.topology import AUDIT_FLOOR

    s = Settings.from_env()
    pools = [{"name": "i", "rungs": ["int4"], "weight": 1.0, "handoff_to": "s"},
             {"name": "s", "rungs": ["int8", "fp32"]}]
    t = parse_topology({"pools": pools})
    c = serving_config(t, s)
    assert c.standby_rungs == ("int8", "fp32") and c.audit_rate == AUDIT_FLOOR and c.detector == committed()
    alone = serving_config(parse_topology({"pools": [pools[0], {"name": "s", "rungs": ["int8"]}]}), s)
    assert alone.audit_rate == 0.0 and alone.detector is None  # nothing full-precision to score with
    with pytest.raises(ConfigError, match="int8 is a standby's first rung"):
        parse_topology({"pools": [pools[0], {"name": "s", "rungs": ["fp32", "int8"]}]})
    with pytest.raises(ConfigError, match="int8 is a standby's first rung"):
        parse_topology({"pools": [pools[0], {"name": "s", "rungs": ["int8", "vllm"], "url": "http://b:2"}]})
    with pytest.raises(ConfigError, match="whose first rung verifies"):
        parse_topology({"pools": [{**pools[0], "precision": "verified"}, pools[1]]})
    with pytest.raises(ConfigError, match="audit_rate needs a standby to hand off to with a full-precision rung"):
        parse_topology({"pools": [{**pools[0], "audit_rate": 0.1}, {"name": "s", "rungs": ["int8"]}]})
