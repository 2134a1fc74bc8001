"""The drift audit's pure parts (selection, scoring, the per-class watch, the prompt classes) and
the audit run by the standby on the real engines."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qladder.audit import (
    AuditJob,
    AuditRecord,
    AuditTrail,
    DriftWatch,
    TopRow,
    calibrate_drift_bound,
    score,
    score_top,
    selected,
)
from qladder.classify import classify
from qladder.errors import RemoteStreamError
from qladder.validate.corpora import split_of


def test_selection_is_a_reproducible_share_of_request_ids():
    ids = [f"req-{k}" for k in range(20000)]
    share = sum(selected(i, 0.1) for i in ids) / len(ids)
    assert 0.09 < share < 0.11
    assert [selected(i, 0.1) for i in ids[:50]] == [selected(i, 0.1) for i in ids[:50]]
    assert not any(selected(i, 0.0) for i in ids[:100]) and all(selected(i, 1.0) for i in ids[:100])


def _job(answer, top):
    return AuditJob("r", "qa", "int4", (1, 2, 3), tuple(answer), tuple(top))


def test_score_reads_agreement_divergence_kl_and_gap_from_the_rows():
    v = 10
    rows = torch.full((3, v), -5.0)
    rows[0, 4] = 5.0  # fp32 prefers 4, INT4 wrote 4
    rows[1, 6] = 5.0  # fp32 prefers 6, INT4 wrote 7
    rows[1, 7] = 4.0
    rows[2, 2] = 5.0  # fp32 prefers 2, INT4 wrote 2
    same = tuple((t, math.log(0.2)) for t in range(5))  # INT4's top 5: uniform over 0..4
    r = score(_job([4, 7, 2], [same, tuple((t, math.log(0.2)) for t in (6, 7, 8, 9, 0)), same]), rows)
    assert r.tokens == 3 and r.agreement == pytest.approx(2 / 3) and r.first_divergence == 1
    assert r.fp32_gap == pytest.approx(1.0 / 3, rel=1e-4)  # only position 1: 5 - 4
    assert r.kl_top5 > 0
    exact = score(_job([4, 6, 2], [same] * 3), rows)
    assert exact.agreement == 1.0 and exact.first_divergence is None and exact.fp32_gap == 0.0
    # the excess surprise: -log p(token) - H(p), averaged; fp32's own argmax is never over its entropy
    logp = torch.log_softmax(rows, dim=-1)
    h = -(logp.exp() * logp).sum(dim=-1)
    want = float((-logp[torch.arange(3), torch.tensor([4, 7, 2])] - h).mean())
    assert r.excess == pytest.approx(want, rel=1e-5) and exact.excess is not None and exact.excess <= 0.0
    unlikely = score(_job([0, 0, 0], [same] * 3), rows)  # tokens fp32 gives ~e-10: far over its entropy
    assert unlikely.excess is not None and unlikely.excess > 9.0


def _top_rows(rows: torch.Tensor, answer: list[int], k: int) -> list[TopRow]:
    """What vLLM's prompt_logprobs = k report of full rows: each token's logprob and rank, the top k."""
    logp = torch.log_softmax(rows.double(), dim=-1)
    out = []
    for row, t in zip(logp, answer, strict=False):
        vals, idx = torch.topk(row, k)
        out.append(TopRow(float(row[t]), int((row > row[t]).sum()) + 1,
                          tuple(zip(idx.tolist(), vals.tolist(), strict=True))))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 12), scale=st.floats(0.1, 6.0), greedy=st.booleans())
def test_scoring_from_the_top_k_is_exact_where_it_can_be_and_never_overstates_the_excess(seed, k, scale, greedy):
    """A remote standby's audit (score_top, from vLLM's top-k prompt logprobs) against the full
    rows' (score): agreement, first divergence and fp32_gap the same; the excess at or under the
    exact one (the entropy bounded above), so a detector calibrated on exact scores alarms no more
    often; with every token reported, everything the same."""
    g = torch.Generator().manual_seed(seed)
    v, n = 16, 6
    rows = torch.randn((n, v), generator=g, dtype=torch.float64) * scale
    answer = (rows.argmax(dim=-1) if greedy else torch.randint(0, v, (n,), generator=g)).tolist()
    top = [tuple((int(t), float(x)) for t, x in zip(torch.randperm(v, generator=g)[:5].tolist(),
                                                     torch.log_softmax(torch.randn(5, generator=g), 0).tolist(),
                                                     strict=True)) for _ in range(n)]
    job = AuditJob("r", "qa", "int4", (1, 2), tuple(answer), tuple(top), greedy=greedy)
    exact = score(job, rows)
    bounded = score_top(job, _top_rows(rows, answer, k), v)
    assert (bounded.first_divergence, bounded.tokens) == (exact.first_divergence, exact.tokens)
    # score's means are float32's: a gap near 12 carries float32's ulp (~1e-6), so relative, not absolute
    assert bounded.agreement == pytest.approx(exact.agreement, rel=1e-5, abs=1e-6)
    assert bounded.fp32_gap == pytest.approx(exact.fp32_gap, rel=1e-5, abs=1e-6)
    assert exact.excess is not None and bounded.excess is not None and bounded.excess <= exact.excess + 1e-5
    whole = score_top(job, _top_rows(rows, answer, v), v)
    assert whole.excess == pytest.approx(exact.excess, abs=1e-5) and whole.kl_top5 == pytest.approx(exact.kl_top5,
                                                                                                  abs=1e-5)
    assert whole.key == exact.key and whole.greedy == exact.greedy


def test_a_record_names_a_probe_and_what_it_is_evidence_of():
    rows = torch.zeros((3, 10))
    a, again = score(_job([4, 7, 2], []), rows), score(_job([4, 7, 2], []), rows)
    assert a.key == again.key and len(a.key) == 16 and a.source == "audit"
    assert score(_job([4, 7], []), rows).key == a.key  # greedy: the prompt's answer, however long
    sampled = [score(AuditJob("r", "qa", "int4", (1, 2, 3), tuple(t), (), greedy=False), rows)
               for t in ([4, 7], [4, 8])]
    assert sampled[0].key != sampled[1].key != a.key  # sampled: each draw is its own evidence
    other = AuditJob("r", "qa", "int4", (1, 2), (3, 4, 7, 2), (), probe=True)  # the same ids, cut elsewhere
    probe = score(other, torch.zeros((4, 10)))
    assert probe.key != a.key and probe.source == "probe"
    trail = AuditTrail("p", "qa", "int4", (jobs := []).append, probe=True, chosen=False)
    trail.add(torch.zeros(10))
    trail.done((1,), (5,))
    assert jobs and jobs[0].probe and jobs[0].urgent and jobs[0].top  # a probe is chosen and urgent


def test_a_trail_asks_whether_its_answer_is_urgent_once_its_endpoint_is_known():
    """A pool of replicas: which one writes an answer is known at its first token, whether that
    one is suspect at its end; an answer not chosen for the audit's share is audited only then."""
    jobs: list[AuditJob] = []
    suspect = {"http://b"}
    top = ((1, -0.1), (2, -2.0), (3, -3.0), (4, -4.0), (5, -5.0))
    for rid, endpoint, chosen in (("a", "http://a", False), ("b", "http://b", False), ("c", "http://a", True)):
        t = AuditTrail(rid, "chat", "http://a", jobs.append, urgent=lambda e: e in suspect, chosen=chosen)
        t.at(endpoint)
        t.add_top(1, top)
        t.done([9], [1])
    assert [(j.request_id, j.pool, j.urgent) for j in jobs] == [("b", "http://b", True), ("c", "http://a", False)]
    assert jobs[0].top == () and len(jobs[1].top) == 1  # a light trail keeps no top-5: no KL estimate
    r = score(jobs[0], torch.zeros(1, 8))
    assert math.isnan(r.kl_top5) and r.fp32_gap == 0.0 and r.score == 0.0
    # in-band suspicion: an answer that left INT4 on a hazard is audited at once, urgently, and once
    t = AuditTrail("h", "chat", "int4", jobs.append, chosen=False)
    for _ in range(3):
        t.add(torch.zeros(8))
    t.done([9], [1, 2, 3], suspicious=True)
    t.done([9], [1, 2, 3, 4])  # (the answer's end: already sent)
    assert [(j.request_id, j.answer_ids, j.urgent) for j in jobs[2:]] == [("h", (1, 2, 3), True)]


def test_a_remote_answers_trail_is_its_endpoints_and_scores_over_the_servers_top_k():
    """A llama-server token's top-k (n_probs 4, nulls on a NaN row) padded to 5 with
    zero-probability entries; the trail takes the endpoint named before its first token; an answer
    written by two replicas (migrated mid-stream) is not audited."""
    jobs: list[AuditJob] = []
    t = AuditTrail("r", "qa", "pool", jobs.append)
    t.at("http://a")
    t.add_top(4, [(4, math.log(0.5)), (6, math.log(0.3)), (7, None), (8, math.log(0.1))])
    t.add_top(2, [])  # a server that sent none: the token alone
    t.done((1, 2, 3), (4, 2))
    (job,) = jobs
    assert job.pool == "http://a" and all(len(top) == 5 for top in job.top)
    assert job.top[0][:3] == ((4, math.log(0.5)), (6, math.log(0.3)), (8, math.log(0.1)))
    assert job.top[1][0] == (2, 0.0) and all(v == -math.inf for _, v in job.top[1][1:])
    rows = torch.full((2, 10), -5.0)
    rows[0, 4] = rows[1, 2] = 5.0
    r = score(job, rows)
    assert r.agreement == 1.0 and math.isfinite(r.kl_top5) and r.kl_top5 >= 0 and r.excess is not None
    moved = AuditTrail("m", "qa", "pool", jobs.append)
    moved.at("http://a")
    moved.add_top(4, [(4, -0.1)])
    moved.at("http://b")  # a stream continued at a sibling: nobody's evidence
    moved.add_top(2, [(2, -0.1)])
    moved.done((1, 2, 3), (4, 2))
    assert len(jobs) == 1


def test_drift_watch_sends_a_class_to_verified_below_its_bound_only_with_enough_answers():
    w = DriftWatch(bound=0.8, window=10, min_answers=3)
    for a in (0.5, 0.6):
        w.record(AuditRecord("r", "math", "int4", 10, a, 0, 0.1, 0.2))
    assert not w.verify("math")  # two answers: not enough to judge
    w.record(AuditRecord("r", "math", "int4", 20, 0.7, 0, 0.1, 0.2))
    assert w.agreement("math") == pytest.approx((5 + 6 + 14) / 40) and w.verify("math")
    for _ in range(10):
        w.record(AuditRecord("r", "math", "int4", 10, 0.95, None, 0.0, 0.0))
    assert not w.verify("math") and not w.verify("chat") and w.agreement("chat") is None


def test_drift_watch_judges_greedy_answers_only():
    w = DriftWatch(bound=0.8, window=10, min_answers=3)
    for _ in range(5):
        w.record(AuditRecord("r", "chat", "int4", 10, 0.2, 0, 0.1, 0.2, greedy=False))  # the sampler's choices
    assert w.agreement("chat") is None and not w.verify("chat")


def test_the_drift_bound_is_the_lowest_class_quantile_of_the_fewest_answers_judged():
    steady = [(32, 0.97)] * 40
    wobbly = [(32, 1.0)] * 30 + [(32, 0.5)] * 10  # mean 0.875; 20 draws can hold many of the 0.5s
    cal = calibrate_drift_bound({"chat": steady, "math": wobbly, "thin": [(8, 1.0)]}, min_answers=20,
                                false_verify=0.01, runs=4000)
    assert cal["classes"]["chat"]["quantile"] == pytest.approx(0.97)
    assert cal["classes"]["math"]["agreement"] == pytest.approx(0.875)
    assert cal["bound"] == cal["classes"]["math"]["quantile"] < 0.875 and "thin" not in cal["classes"]
    # a clean window of the wobbly class falls under the bound about 1% of the time, not more
    rng = np.random.default_rng(3)
    a = np.array([x for _, x in wobbly])
    windows = a[rng.integers(0, len(a), (4000, 20))].mean(axis=1)
    assert (windows < cal["bound"]).mean() <= 0.02
    with pytest.raises(ValueError):
        calibrate_drift_bound({"thin": [(8, 1.0)]})


def test_prompt_classes_on_the_held_out_half_of_the_corpus():
    """The rules were written from the train half of the labelled normal corpus; on the test half
    they must get at least 95% right (measured: 110 of 112). A changed prompt is abnormal."""
    rows = [json.loads(line) for line in (Path(__file__).resolve().parents[1] / "corpora/normal.jsonl")
            .read_text(encoding="utf-8").splitlines()]
    test = [r for r in rows if split_of(r["id"]) == "test"]
    right = sum(classify(r["prompt"]) == r["class"] for r in test)
    assert right / len(test) >= 0.95, right
    assert classify("What is 2+2?", changed=True) == "abnormal" and classify(None) == "chat"


# -- on the real engines ---------------------------------------------------------------------------
def _until(pred, what: str, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_the_standby_audits_int4_answers_as_a_teacher_forced_fp32_forward_would():
    """audit_rate 1: every INT4 answer is re-scored in the background; each record's agreement
    and first divergence equal fp32's own teacher-forced argmax over prompt + answer (the
    one-sequence engine, one forward); France's INT4 answer leaves fp32's argmax at token 0."""
    import threading

    from qladder.model import user_prompt_ids
    from qladder.sampling import SamplingParams
    from qladder.serving import ServingConfig, ServingEngine

    from .conftest import get_engine

    fp32 = get_engine("fp32")
    se = ServingEngine(ServingConfig(slots=4, audit_rate=1.0), standby_engines=[fp32])
    records, lock = [], threading.Lock()

    def keep(r):
        with lock:
            records.append(r)

    se.add_audit_observer(keep)
    try:
        texts = ["What is the capital of France?", "Name three colors.", "What is 48 * 93?",
                 "Write a haiku about rain."]
        results = {}
        for t in texts:
            ids = user_prompt_ids(se.info.chat_template, t, se.int4.tokenize)
            req = se.request(ids, SamplingParams(max_tokens=24), prompt_text=t)
            results[req.request_id] = (t, ids, se.generate_sync(req))
        _until(lambda: len(records) == len(texts), "an audit of every answer")
        assert se.stats()["audits_done"] == len(texts) and se.stats()["audits_dropped"] == 0
        for a in records:
            t, ids, r = results[a.request_id]
            assert a.tokens == len(r.token_ids) and set(r.token_rungs) == {"int4"}
            with torch.inference_mode():
                logits = fp32.model(input_ids=torch.tensor([ids + r.token_ids]), use_cache=False).logits[0]
            best = logits[len(ids) - 1: len(ids) + len(r.token_ids) - 1].argmax(dim=-1)
            agree = best == torch.tensor(r.token_ids)
            assert a.agreement == pytest.approx(float(agree.float().mean())), t
            wrong = (~agree).nonzero().flatten()
            assert a.first_divergence == (int(wrong[0]) if len(wrong) else None), t
            assert a.kl_top5 >= 0 and a.fp32_gap >= 0 and a.pool == "int4"
        assert {a.prompt_class for a in records} == {"qa", "math", "chat"}
        france = next(a for a in records if results[a.request_id][0].startswith("What is the capital"))
        assert france.first_divergence == 0 and france.agreement < 1.0  # "L'Étoile..." against "The ..."
    finally:
        se.close()



@pytest.mark.slow
def test_fast_answers_cost_full_precision_nothing_on_their_path():
    """The default mode is fast: clean greedy INT4 answers, no sampled audit, a standby on hand.
    The standby runs no forward for them (no drift windows, no scoring on the path), the answers
    are INT4's alone, and no audit record is made."""
    from qladder.model import user_prompt_ids
    from qladder.sampling import SamplingParams
    from qladder.serving import ServingConfig, ServingEngine

    from .conftest import get_engine

    se = ServingEngine(ServingConfig(slots=4), standby_engines=[get_engine("fp32")])
    records: list = []
    se.add_audit_observer(records.append)
    try:
        for t in ["What is the capital of France?", "Name three colors.", "What is 48 * 93?"]:
            ids = user_prompt_ids(se.info.chat_template, t, se.int4.tokenize)
            r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24), prompt_text=t))
            assert r.token_ids and set(r.token_rungs) == {"int4"} and not r.hazards, t
        assert se.standby is not None and se.standby.forwards == 0 and not records
    finally:
        se.close()


@pytest.mark.slow
def test_qladder_serve_audits_stores_and_exports_by_class_and_sends_a_drifting_class_to_verified(tmp_path):
    """Through `qladder serve` (openai client): with audit_rate 1 every INT4 answer is audited,
    stored beside the incidents and counted by class in /metrics; with verify_below above any
    agreement, a class with 20 audited answers is served verified from then on (fp32's tokens),
    another class still INT4's; `qladder incidents audits` reads the store."""
    import dataclasses

    import httpx
    import openai
    from typer.testing import CliRunner

    from qladder.cli import app
    from qladder.server.serve import build_server
    from qladder.server.topology import Topology, default_pools

    from .conftest import get_engine, live_app

    db = tmp_path / "incidents.sqlite3"
    t = Topology()
    t = dataclasses.replace(t, server=dataclasses.replace(t.server, incidents=str(db), verify_below=1.01),
                            pools=(dataclasses.replace(default_pools()[0], audit_rate=1.0), default_pools()[1]))
    server = build_server(t, standby_engines=[get_engine("fp32")])
    try:
        with live_app(server.app) as v1, openai.OpenAI(base_url=v1, api_key="none", max_retries=0,
                                                       timeout=120) as client:
            def ask(text):
                r = client.chat.completions.create(model=t.server.model_name, max_tokens=6, temperature=0,
                                                   messages=[{"role": "user", "content": text}])
                return set(r.model_extra["qladder"]["tokens_per_rung"])

            for k in range(20):
                assert ask(f"What is {k + 11} * {k + 3}?") == {"int4"}
            _until(lambda: server.engine.stats()["audits_done"] >= 20, "20 audits")
            assert ask("What is 17 * 29?") == {"fp32"}  # math now drifts past the bound: verified
            assert ask("Write a haiku about rain.") == {"int4"}  # chat: not enough audits to judge
            scrape = httpx.get(v1.removesuffix("/v1") + "/metrics", timeout=30).text
            count = next(float(line.split()[-1]) for line in scrape.splitlines()
                         if line.startswith("qladder_audit_agreement_count") and 'prompt_class="math"' in line)
            assert count >= 20
            excess = next(float(line.split()[-1]) for line in scrape.splitlines()
                          if line.startswith("qladder_audit_excess_nats_count") and 'prompt_class="math"' in line)
            assert excess == count  # every audited answer's excess surprise, exported beside its agreement
            # the audit's test is on by default: the clean pool is watched (0) or suspect (1), never ejected
            state = next(float(line.split()[-1]) for line in scrape.splitlines()
                         if line.startswith("qladder_endpoint_state{") and 'endpoint="int4"' in line)
            assert state in (0.0, 1.0) and server.engine.stats()["detector_int4_alarms"] == 0.0
        _until(lambda: len(server.store.audits()) >= 21, "the audits stored")
        assert {r["prompt_class"] for r in server.store.audits()} >= {"math"}
        assert all(r["excess"] is not None for r in server.store.audits())
    finally:
        server.close()
    out = CliRunner().invoke(app, ["incidents", "audits", "--db", str(db)])
    assert out.exit_code == 0 and "math" in out.stdout and "agreement" in out.stdout


def test_the_audits_recent_cost_is_its_chunks_core_seconds_over_the_window():
    """What the engine's audit budget reads: the core-seconds of the chunks that ended in the last
    SPENT_WINDOW_S (on the standby's clock), older ones forgotten."""
    from qladder.serving.auditor import SPENT_WINDOW_S, Auditor

    a = Auditor(None, lambda r: None)  # type: ignore[arg-type]  (no chunk runs here)
    a.charge(100.0, 0.5)
    a.charge(101.0, 0.25)
    assert a.spent(101.0) == 0.75
    assert a.spent(100.0 + SPENT_WINDOW_S + 0.5) == 0.25  # the first chunk is out of the window
    a.charge(200.0, 1.0)  # (and dropped from the record)
    assert a.spent(200.0) == 1.0


class _FakeSession:
    def __init__(self, engine: _FakeBatched, prompt: list[int]):
        self.engine, self.pending, self.n_rows = engine, prompt, 0

    def take_pending(self) -> list[int]:
        out, self.pending = self.pending, []
        return out

    def rows(self) -> torch.Tensor:
        return torch.zeros(self.n_rows, 64)

    def close(self) -> None:
        self.engine.free_slots += 1


class _FakeBatched:
    """A batched rung's surface as the auditor uses it (reserve, run, free slots), recording each
    chunk's size; its rows are uniform (every score is defined)."""

    def __init__(self) -> None:
        self.free_slots, self.chunks = 4, []

    def reserve(self, prompt_ids):
        self.free_slots -= 1
        return _FakeSession(self, list(prompt_ids))

    def run(self, work) -> None:
        for s, ids, n_rows in work:
            self.chunks.append(len(ids))
            s.n_rows = n_rows


def test_the_auditor_scores_urgent_jobs_first_in_order_then_the_newest_ordinary_one():
    """An answer of an endpoint whose test has not decided (or a probe) is what decides an alarm:
    it goes before the floor's backlog; under a backlog the freshest ordinary evidence goes next;
    a full queue drops its oldest, counted; a chunk's size is the caller's when it names one."""
    from qladder.serving.auditor import Auditor

    done: list[str] = []
    engine = _FakeBatched()
    a = Auditor(engine, lambda r: done.append(r.request_id), max_jobs=3, chunk=64)  # type: ignore[arg-type]

    def job(rid: str, urgent: bool = False, n: int = 4) -> AuditJob:
        return AuditJob(rid, "chat", "int4", (1, 2, 3), tuple(range(n)), (((0, -1.0),) * 5,) * n, urgent=urgent)

    for rid in ("old", "mid", "new", "newest"):  # the queue holds 3: "old" is dropped
        a.offer(job(rid))
    a.offer(job("u1", urgent=True))
    a.offer(job("u2", urgent=True))
    assert a.dropped == 1 and a.pending == 5
    while a.step():
        pass
    assert done == ["u1", "u2", "newest", "new", "mid"] and a.pending == 0 and a.done == 5
    a.offer(job("long", n=40))
    engine.chunks.clear()
    while a.step(16):
        pass
    assert engine.chunks == [16, 16, 10] and done[-1] == "long"  # prompt (3) + 39 answer ids fed
    # an urgent job that comes while an ordinary one is under way sets it aside, and it goes on after
    a.offer(job("ordinary", n=40))
    assert a.step(16) and a.pending == 1
    a.offer(job("u3", urgent=True))
    assert a.pending == 2
    while a.step(16):
        pass
    assert done[-2:] == ["u3", "ordinary"] and a.pending == 0 and engine.free_slots == 4
    # an ordinary job of an endpoint that turned suspect since it was queued goes before newer ones
    a.prefer = lambda endpoint: endpoint == "replica-b"
    a.offer(AuditJob("of-b", "chat", "replica-b", (1,), (0, 1), (((0, -1.0),) * 5,) * 2))
    a.offer(job("newer"))
    while a.step():
        pass
    assert done[-2:] == ["of-b", "newer"]


@pytest.mark.slow
def test_the_standby_audits_in_a_share_of_its_turns_while_a_handoff_keeps_it_busy():
    """A long answer on the standby keeps it busy; an INT4 answer audited meanwhile is scored
    before that answer ends (in BUSY_CHUNK chunks, within BUSY_SHARE of the standby's time), not
    after it: the floor's audits run however busy handoffs keep full precision."""
    import threading

    from qladder.model import user_prompt_ids
    from qladder.sampling import SamplingParams
    from qladder.serving import ServingConfig, ServingEngine

    from .conftest import get_engine

    se = ServingEngine(ServingConfig(slots=4, audit_rate=1.0), standby_engines=[get_engine("fp32")])
    records: list = []
    se.add_audit_observer(records.append)
    try:
        ids = user_prompt_ids(se.info.chat_template, "Tell me a long story about a lighthouse keeper.",
                              se.int4.tokenize)
        long = se.request(ids, SamplingParams(max_tokens=200, ignore_eos=True), start_rung=1)
        ended: list[bool] = []
        t = threading.Thread(target=lambda: ended.append(bool(se.generate_sync(long, timeout_s=600).token_ids)))
        t.start()
        _until(lambda: se.standby is not None and se.standby.forwards >= 3, "the long answer under way")
        q = user_prompt_ids(se.info.chat_template, "Name three colors.", se.int4.tokenize)
        r = se.generate_sync(se.request(q, SamplingParams(max_tokens=24), prompt_text="Name three colors."))
        assert r.token_ids and not ended, "the INT4 answer ended while the standby was busy"
        _until(lambda: bool(records) or bool(ended), "the audit, or the long answer's end")
        assert records and not ended, "the audit waited for the handoff to end"
        assert records[0].tokens == len(r.token_ids)
        t.join(timeout=600)
        assert ended == [True]
    finally:
        se.close()


class _FakeTopScorer:
    """A remote standby's audit call as RemoteAuditor uses it (score_top), recording each prompt;
    a prompt in `fail` answers as a server error would; `gate` holds every call until set."""

    def __init__(self, gate: threading.Event) -> None:
        self.entered: list[tuple[int, ...]] = []
        self.calls: list[tuple[int, ...]] = []
        self.fail: set[tuple[int, ...]] = set()
        self.gate = gate

    async def score_top(self, client, prompt, answer, k):
        self.entered.append(tuple(prompt))
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        self.calls.append(tuple(prompt))
        if tuple(prompt) in self.fail:
            raise RemoteStreamError("vLLM answered HTTP 400")
        return [TopRow(-0.25, 1, ((t, -0.25), (t + 1, -2.0))) for t in answer]


def test_a_remote_auditor_scores_urgent_jobs_first_in_the_standbys_spare_turns_and_counts_failures():
    """RemoteAuditor on a real event loop (a thread of its own, as the remote pool's): jobs queued
    while a call is under way are scored urgent first, then the newest; an ordinary job waits while
    the standby continues handoffs (`busy`), an urgent one does not; a failed call is counted and
    the next job goes on; each call's time in flight is charged to the budget."""
    from qladder.serving.remote_auditor import RemoteAuditor

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    records: list[AuditRecord] = []
    gate, busy = threading.Event(), threading.Event()
    scorer = _FakeTopScorer(gate)
    now = [0.0]

    def spawn(work) -> None:
        asyncio.run_coroutine_threadsafe(work(None), loop)

    def job(rid: str, prompt: tuple[int, ...], urgent: bool = False) -> AuditJob:
        return AuditJob(rid, "chat", "http://a:1", prompt, (5, 6, 7), (), urgent=urgent)

    a = RemoteAuditor(scorer, 64, records.append, spawn, loop.call_soon_threadsafe, busy.is_set,
                      clock=lambda: now[0])
    try:
        a.offer(job("first", (1,)))  # taken at once, held at the gate
        _until(lambda: scorer.entered == [(1,)], "the first call")
        for rid, p, u in (("old", (2,), False), ("new", (3,), False), ("urgent", (4,), True)):
            a.offer(job(rid, p, u))
        assert a.pending == 4
        scorer.fail.add((3,))
        gate.set()
        _until(lambda: a.pending == 0, "the queue to drain")
        assert scorer.calls == [(1,), (4,), (3,), (2,)]  # urgent first, then the newest
        assert [r.request_id for r in records] == ["first", "urgent", "old"] and a.failed == 1 and a.done == 3
        assert all(r.agreement == 1.0 and r.fp32_gap == 0.0 and r.pool == "http://a:1" for r in records)
        busy.set()  # the standby is continuing handoffs: an ordinary job waits, an urgent one does not
        a.offer(job("waits", (8,)))
        a.offer(job("goes", (9,), urgent=True))
        _until(lambda: len(records) == 4, "the urgent job")
        assert records[-1].request_id == "goes" and a.pending == 1
        busy.clear()
        _until(lambda: a.pending == 0, "the waiting job")
        assert records[-1].request_id == "waits"
        now[0] = 1.0
        assert a.spent(1.0) == 0.0  # (the fake clock stood still: no time in flight was charged)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()



def test_an_audit_call_on_a_standby_served_from_this_machine_is_charged_as_the_boxs_cores():
    """A vLLM standby on loopback shares the box with the INT4 servers: a second of its audit call
    costs INT4 every core it holds, so it is charged as the box's cores (measured: the audit at the
    default budget, charged as one core, made guarded 1.28x bare in validate --remote on 2 cores,
    1.03x with it off); a standby elsewhere, one core's. A call's time in flight is charged so."""
    from qladder.engines.remote_vllm import VllmRung
    from qladder.engines.replicas import Replicas
    from qladder.serving.remote_auditor import RemoteAuditor, charge_for, on_this_machine

    assert all(on_this_machine(u) for u in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000",
                                            "https://127.3.4.5/v1"))
    assert not any(on_this_machine(u) for u in ("http://10.0.0.6:8000", "http://gpu-box:8000", "http://[2001:db8::1]/"))

    def rung(url: str) -> VllmRung:
        r = VllmRung.__new__(VllmRung)  # (no server to ask: charge_for reads only its url)
        r.base_url = url
        return r

    here, there = rung("http://127.0.0.1:8000"), rung("http://10.0.0.6:8000")
    assert charge_for(here, 2) == 2.0 and charge_for(there, 2) == 1.0
    both = Replicas.__new__(Replicas)
    both.endpoints = [here, there]
    assert charge_for(both, 16) == 1.0  # (one replica elsewhere: not all of it is this box's)
    both.endpoints = [here, rung("http://localhost:8001")]
    assert charge_for(both, 16) == 16.0

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    gate = threading.Event()
    gate.set()
    now = [0.0]

    class _Slow(_FakeTopScorer):
        async def score_top(self, client, prompt, answer, k):
            now[0] += 0.5  # half a second in flight, on the fake clock
            return await super().score_top(client, prompt, answer, k)

    records: list[AuditRecord] = []
    a = RemoteAuditor(_Slow(gate), 64, records.append, lambda w: asyncio.run_coroutine_threadsafe(w(None), loop),
                      loop.call_soon_threadsafe, lambda: False, clock=lambda: now[0], charge_cores=2.0)
    try:
        a.offer(AuditJob("r", "chat", "http://127.0.0.1:8000", (1,), (5, 6), ()))
        _until(lambda: a.pending == 0 and len(records) == 1, "the call")
        assert a.spent(now[0]) == pytest.approx(1.0)  # 0.5 s in flight x 2 cores
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
