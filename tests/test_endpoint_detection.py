"""The audit finds a broken in-process INT4 pool and takes it out: real llama.cpp kernels on a
copy of the embedded GGUF with a held-out corruption (test half: rows 0-7 of layer 5's ffn_down,
every block's scale x30, whose finite salad passes the step guard), the committed detector
thresholds (health/detector_calibration.json: calibrated on the train half's clean answers only),
the real fp32 standby scoring the audited answers."""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from qladder.engines.replicas import Replicas
from qladder.health.detector import committed
from qladder.incidents import IncidentStore
from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.testing.gguf_patch import patch_scales
from qladder.validate.corpora import normal_prompts, split_of
from qladder.validate.replay import greedy

from .conftest import get_engine

PROMPTS = [p for p in normal_prompts() if split_of(p.id) == "test"][:24]


def _until(cond, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _serve(se: ServingEngine, n: int) -> list:
    """`n` held-out prompts one after another, each answer's audit (if chosen) done before the next.
    Their request ids are fixed (the audit chooses by a hash of the id: at 0.25, 5 of these 24)."""
    out = []
    for p in PROMPTS[:n]:
        ids = user_prompt_ids(se.info.chat_template, str(p.prompt), se.int4.tokenize)
        out.append(se.generate_sync(se.request(ids, SamplingParams(max_tokens=32), request_id=f"clean-{p.id}",
                                               prompt_text=str(p.prompt), prompt_class=p.cls)))
        _until(lambda: se.stats().get("audits_pending", 0) == 0, "the audit queue to drain")
    return out


@pytest.mark.slow
def test_a_pool_with_corrupted_weights_is_ejected_by_the_audit_and_its_requests_go_to_full_precision(
        model_info, tmp_path):
    bad = tmp_path / "scale-x30-rows.gguf"
    patch_scales(model_info.path, bad, "blk.5.ffn_down.weight", rows="0-7", blocks="all", x=30.0)
    store = IncidentStore(tmp_path / "incidents.db")
    fp32 = get_engine("fp32")
    cfg = ServingConfig(slots=4, audit_rate=0.25, detector=committed(), probe_every_s=0.0)
    se = ServingEngine(cfg, dataclasses.replace(model_info, path=bad.resolve()), incidents=store,
                       standby_engines=[fp32])
    alarms: list = []
    se.alarm_observers.append(alarms.append)
    try:
        answers = []
        for p in PROMPTS:
            if alarms:
                break
            ids = user_prompt_ids(se.info.chat_template, str(p.prompt), se.int4.tokenize)
            answers.append(se.generate_sync(se.request(ids, SamplingParams(max_tokens=32),
                                                       prompt_text=str(p.prompt), prompt_class=p.cls)))
            _until(lambda: se.stats().get("audits_pending", 0) == 0, "the audit queue to drain")
        assert alarms, f"no alarm after {len(answers)} answers of a corrupted pool: {se.stats()}"
        a = alarms[0]
        assert not a.returned and a.endpoint == se.int4.name and a.statistic >= a.threshold
        # the step guard let its salad through (an answer handed off says why: under the other
        # worker's load a step can pass its deadline)
        assert all(set(r.token_rungs) == {"int4"} or r.hazards for r in answers), [r.hazards for r in answers]
        st = se.stats()
        assert st["detector_int4_state"] in (2.0, 3.0) and st["detector_int4_alarms"] == 1.0
        # the evidence: audited answers' request ids and scores, each over the reference
        rows = [row for row in store.rows() if row["check_name"] == "audit"]
        assert len(rows) == 1 and rows[0]["action"] == f"eject:{se.int4.name}" and rows[0]["rung"] == se.int4.name
        assert rows[0]["value"] == pytest.approx(a.statistic) and rows[0]["threshold"] == pytest.approx(a.threshold)
        evidence = json.loads(rows[0]["detail"])["evidence"]
        assert evidence and [tuple(e) for e in evidence] == [tuple(e) for e in a.evidence]
        # ejected: the next requests are full precision's from their first token (exactly fp32's
        # greedy answer), and a probe (an unshown, audited INT4 answer) goes out beside each
        p = PROMPTS[-1]
        ids = user_prompt_ids(se.info.chat_template, str(p.prompt), se.int4.tokenize)
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=16), prompt_text=str(p.prompt)))
        assert r.token_ids and set(r.token_rungs) == {"fp32"}
        assert r.token_ids == greedy(fp32, ids, 16)
        _until(lambda: se.stats()["probes"] >= 1 and se.stats().get("audits_pending", 0) == 0, "a probe's audit")
        assert se.stats()["detector_int4_state"] in (2.0, 3.0)  # the corrupted pool's probe is no cleaner
    finally:
        se.close()
        store.close()


@pytest.mark.slow
def test_a_clean_pool_audited_at_the_same_rate_raises_no_alarm(model_info, tmp_path):
    cfg = ServingConfig(slots=4, audit_rate=0.25, detector=committed(), probe_every_s=0.0)
    se = ServingEngine(cfg, model_info, standby_engines=[get_engine("fp32")])
    alarms: list = []
    se.alarm_observers.append(alarms.append)
    try:
        answers = _serve(se, len(PROMPTS))
        st = se.stats()
        assert st["audits_done"] >= 3, st  # some answers were audited
        assert not alarms and st["detector_int4_alarms"] == 0.0 and st["detector_int4_state"] in (0.0, 1.0)
        # INT4's answers, or a hazard's handoff; after a step past its deadline under the box's load
        # (the watchdog marks the pool unhealthy until a probe passes) an answer may start on fp32
        stalled = [i for i, r in enumerate(answers) if any(h.check == "deadline" for h in r.hazards)]
        assert all(set(r.token_rungs) == {"int4"} or r.hazards
                   or (stalled and i > stalled[0] and set(r.token_rungs) == {"fp32"})
                   for i, r in enumerate(answers)), [(r.token_rungs[:1], r.hazards) for r in answers]
    finally:
        se.close()


@pytest.mark.slow
def test_a_corrupted_llama_server_replica_is_condemned_by_the_audit_and_its_sibling_answers(model_info, tmp_path):
    """Two real llama-servers as one pool's replicas, the second on the held-out corrupted GGUF,
    the in-process fp32 standby auditing every answer: requests two at a time (one on each
    replica) until the audit's test decides. The corrupted replica's URL alone is ejected (an
    incident with the evidence, its detector state), condemned in the pool (no stream goes to it,
    whatever its /health says), its sibling serves on, and a probe of it alone is audited."""
    _condemn_the_corrupted_replica(model_info, tmp_path, {}, [get_engine("fp32")])


@pytest.mark.slow
def test_a_vllm_standby_audits_through_its_prompt_logprobs_and_condemns_the_corrupted_replica(
        model_info, vllm_server, tmp_path):
    """The same with the standby on vLLM's OpenAI server (the fp32 folder): the audited answers
    are scored through its prompt logprobs (each token's rank and logprob, fp32's top 20:
    serving/remote_auditor.py) against the same committed thresholds."""
    se = _condemn_the_corrupted_replica(model_info, tmp_path, {"standby_rungs": ("vllm",),
                                                                 "standby_url": vllm_server.base_url}, None)
    assert se.standby is None and se.remote_auditor is not None and se.remote_auditor.failed == 0


def _condemn_the_corrupted_replica(model_info, tmp_path, standby: dict, engines: list | None) -> ServingEngine:
    bad = tmp_path / "scale-x30-rows.gguf"
    patch_scales(model_info.path, bad, "blk.5.ffn_down.weight", rows="0-7", blocks="all", x=30.0)
    servers = [LlamaServer(path, n_parallel=2, threads=1, n_ctx_per_slot=1024).start()
               for path in (model_info.path, bad)]
    clean, broken = (s.base_url for s in servers)
    store = IncidentStore(tmp_path / "incidents.db")
    cfg = ServingConfig(remote_url=(clean, broken), audit_rate=1.0, detector=committed(), probe_every_s=0.0,
                        **standby)
    se = ServingEngine(cfg, model_info, incidents=store, standby_engines=engines)
    alarms: list = []
    se.alarm_observers.append(alarms.append)
    try:
        rung = se.int4
        assert isinstance(rung, Replicas) and se.watch is not None and se.int4_endpoints == [clean, broken]

        def ask(p) -> object:
            ids = user_prompt_ids(se.info.chat_template, str(p.prompt), rung.tokenize)
            return se.generate_sync(se.request(ids, SamplingParams(max_tokens=32), prompt_text=str(p.prompt),
                                               prompt_class=p.cls))

        answers = []
        for k in range(0, len(PROMPTS) - 2, 2):
            if alarms:
                break
            with ThreadPoolExecutor(2) as pool:  # two at once: the least-in-flight pick sends one to each
                answers += list(pool.map(ask, PROMPTS[k:k + 2]))
            _until(lambda: se.stats().get("audits_pending", 0) == 0, "the audit queue to drain")
        assert alarms, f"no alarm after {len(answers)} answers: {se.stats()}"
        a = alarms[0]
        assert len(alarms) == 1 and not a.returned and a.endpoint == broken and a.statistic >= a.threshold
        st = se.stats()
        assert st[f"detector_{broken}_state"] in (2.0, 3.0) and st[f"detector_{broken}_alarms"] == 1.0
        assert st[f"detector_{clean}_state"] in (0.0, 1.0) and st[f"detector_{clean}_alarms"] == 0.0
        _until(lambda: rung.healthy == [True, False], "the condemned replica out of rotation")
        assert rung.condemned == 1
        rows = [row for row in store.rows() if row["check_name"] == "audit"]
        assert len(rows) == 1 and rows[0]["action"] == f"eject:{broken}" and rows[0]["rung"] == broken
        assert [tuple(e) for e in json.loads(rows[0]["detail"])["evidence"]] == [tuple(e) for e in a.evidence]
        # the sibling serves on (INT4's answers, not the standby's), and the condemned one is probed
        before = se.probes
        after = [ask(p) for p in PROMPTS[-2:]]
        assert all(set(r.token_rungs) == {"llama-server"} or r.hazards for r in after), [r.hazards for r in after]
        assert rung.healthy == [True, False] and se.probes > before
        _until(lambda: float(se.watch.snapshot()[broken]["answers"]) > a.answers, "a probe's audit")
        assert se.stats()[f"detector_{broken}_state"] in (2.0, 3.0)  # its probes are no cleaner
    finally:
        se.close()
        store.close()
        for s in servers:
            s.stop()
    return se


def _eject(se: ServingEngine, endpoint: str) -> None:
    """The audit's verdict, as the standby's thread gives it: EVIDENCE audited answers of `endpoint`
    far over the reference (the watch's own record path: the alarm, its observers, the ejection)."""
    from qladder.audit import AuditRecord
    from qladder.health.detector import EVIDENCE

    assert se.watch is not None
    for k in range(EVIDENCE):
        se.watch.record(AuditRecord(f"forced-{k}", "chat", endpoint, 16, 0.0, 0, 1.0, 9.0, excess=9.0))
    assert se.watch.ejected(endpoint)


def _in_flight(se: ServingEngine, reqs: list, tokens: int = 4) -> tuple[list, ThreadPoolExecutor]:
    """Submit `reqs` and wait until each has `tokens` tokens out (its TokenEvents)."""
    from qladder.types import TokenEvent

    seen: dict[str, int] = {}

    def count(ev) -> None:
        if isinstance(ev, TokenEvent):
            seen[ev.request_id] = seen.get(ev.request_id, 0) + len(ev.token_ids)

    se.add_observer(count)
    pool = ThreadPoolExecutor(len(reqs))
    futures = [pool.submit(se.generate_sync, r, 300) for r in reqs]
    _until(lambda: all(seen.get(r.request_id, 0) >= tokens for r in reqs), "the answers under way")
    return futures, pool


@pytest.mark.slow
def test_an_ejected_pools_answers_in_flight_leave_it_at_once_and_a_whole_answer_has_none_of_its_tokens(model_info):
    """The audit ejects the in-process pool while two answers are being written there: both leave
    for the standby at once (an `audit` hazard). The one its client reads whole (not streamed)
    starts again at full precision: none of INT4's tokens in it, exactly fp32's greedy answer; the
    streamed one keeps what its client was sent and goes on at fp32."""
    fp32 = get_engine("fp32")
    cfg = ServingConfig(slots=4, audit_rate=0.05, detector=committed(), probe_every_s=3600.0)
    se = ServingEngine(cfg, model_info, standby_engines=[fp32])
    try:
        text = "Write a long story about a lighthouse keeper and the storm."
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        params = SamplingParams(max_tokens=160)
        whole = se.request(ids, params, prompt_text=text, streamed=False)
        streamed = se.request(ids, params, prompt_text=text)
        futures, pool = _in_flight(se, [whole, streamed])
        _eject(se, se.int4.name)
        w, s = (f.result(timeout=300) for f in futures)
        pool.shutdown()
        assert [h.check for h in w.hazards] == ["audit"] and set(w.token_rungs) == {"fp32"}
        assert w.token_ids == greedy(fp32, ids, 160)
        # its timings are the kept answer's: its first token is fp32's, after the ejection
        assert len(w.step_ms) == len(w.token_ids) - 1 and w.timings["ttft_ms"] > s.timings["ttft_ms"]
        assert [h.check for h in s.hazards] == ["audit"] and s.token_rungs[0] == "int4" and s.token_rungs[-1] == "fp32"
        assert se.stats()["withdrawn"] == 2.0
    finally:
        se.close()


@pytest.mark.slow
def test_a_policy_that_returns_to_int4_never_returns_to_an_ejected_pool(model_info):
    """return_after: after K healthy tokens on the standby an answer goes back to rung 0, unless
    the audit ejected it; then the answer stays at full precision, whole and exact (handed back,
    it would be withdrawn again and again until the handoffs ran out)."""
    from qladder.policy import LadderConfig, LadderPolicy

    fp32 = get_engine("fp32")
    cfg = ServingConfig(slots=4, audit_rate=0.05, detector=committed(), probe_every_s=3600.0)
    se = ServingEngine(cfg, model_info, standby_engines=[fp32])
    try:
        _eject(se, se.int4.name)
        ladder = LadderConfig(guard=se.config.ladder.guard, policy=LadderPolicy(return_after=3))
        text = str(PROMPTS[0].prompt)
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24), prompt_text=text, ladder=ladder,
                                        streamed=False), timeout_s=300)
        assert set(r.token_rungs) == {"fp32"} and not r.hazards and not r.handoffs
        assert r.token_ids == greedy(fp32, ids, 24) and se.stats()["withdrawn"] == 0.0
    finally:
        se.close()


@pytest.mark.slow
def test_a_replica_ejected_mid_answer_gives_it_up_to_the_standby(model_info):
    """The same through a real llama-server (the pool's one replica): a whole answer it is
    streaming when the audit ejects it starts again at full precision, none of its tokens kept."""
    fp32 = get_engine("fp32")
    server = LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024).start()
    cfg = ServingConfig(remote_url=server.base_url, audit_rate=0.05, detector=committed(), probe_every_s=3600.0)
    se = ServingEngine(cfg, model_info, standby_engines=[fp32])
    try:
        text = "Write a long story about a lighthouse keeper and the storm."
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        whole = se.request(ids, SamplingParams(max_tokens=160), prompt_text=text, streamed=False)
        futures, pool = _in_flight(se, [whole])
        _eject(se, se.int4_endpoints[0])
        w = futures[0].result(timeout=300)
        pool.shutdown()
        assert [h.check for h in w.hazards] == ["audit"] and set(w.token_rungs) == {"fp32"}
        assert w.token_ids == greedy(fp32, ids, 160)
        # its timings are the kept answer's: its first token is fp32's, after the ejection
        assert len(w.step_ms) == len(w.token_ids) - 1
        assert se.stats()["withdrawn"] == 1.0
    finally:
        se.close()
        server.stop()


@pytest.mark.slow
def test_the_audit_takes_its_spare_share_only_while_the_pool_has_room(model_info):
    """At full load every core the audit holds is one INT4 decodes without: the spare share runs
    while the pool has a free slot, only the floor while every slot is busy."""
    cfg = ServingConfig(slots=2, audit_rate=0.05, audit_spare_rate=0.5)
    se = ServingEngine(cfg, model_info, standby_engines=[get_engine("fp32")])
    try:
        assert se._audit_share() == 0.5  # idle
        text = "Write a long story about a lighthouse keeper and the storm."
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        reqs = [se.request(ids, SamplingParams(max_tokens=96, ignore_eos=True), prompt_text=text) for _ in range(2)]
        futures, pool = _in_flight(se, reqs)
        assert se.scheduler.slots_in_use == 2 and se._audit_share() == 0.05
        for f in futures:
            f.result(timeout=300)
        pool.shutdown()
        assert se._audit_share() == 0.5
    finally:
        se.close()
