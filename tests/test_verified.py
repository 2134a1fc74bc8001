"""Verified decoding on the real engines: INT4 drafts on the batched llama.cpp slots, the batched
fp32 rung decides every token; the answer is fp32's, streamed as it is verified."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from qladder.errors import ConfigError
from qladder.model import user_prompt_ids
from qladder.sampling import Sampler, SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.serving.drafts import K_MAX, K_MIN, Drafts, next_k
from qladder.testing.faults import parse_fault
from qladder.types import FinalEvent, FinishReason, TokenEvent
from qladder.validate.replay import greedy

from .conftest import get_engine

PROMPTS = ["What is the capital of France?", "Who painted the Mona Lisa?", "Name three colors.",
           "What is 12*7?", "Write a haiku about rain.", "Explain gravity in one sentence."]


@pytest.fixture(scope="module")
def served():
    # every verified request drafts here (the default lets one draft at a time: see the routing test)
    se = ServingEngine(ServingConfig(slots=6, allow_faults=True, verify_drafting=8),
                       standby_engines=[get_engine("fp32")])
    yield se
    se.close()


def _ids(se, text):
    return user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)


def _concurrently(fn, n):
    out = [None] * n
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, fn(k))) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _until(pred, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.01)


# -- the pure parts ------------------------------------------------------------------------------
def test_window_size_adapts_to_agreement():
    assert next_k(6, 6, 6) == 8  # a window that stood whole grows
    assert next_k(K_MAX, K_MAX, K_MAX) == K_MAX
    assert next_k(8, 8, 3) == 4  # one that did not shrinks to what stood plus one
    assert next_k(8, 8, 0) == K_MIN


def test_reconcile_keeps_the_lookahead_only_when_the_new_context_is_what_was_drafted():
    d = Drafts(base=[1, 2, 3], n_prompt=2, params=SamplingParams(), eos_ids=frozenset({0}), n_ctx=100)
    d.ids = [10, 11, 12, 13, 14]
    ids = d.window().ids
    assert ids == (10, 11, 12, 13, 14) and d.away and not d.ready()
    d.ids += [15, 16]  # drafted on while away
    # every draft stood, and the verifier's own next token is the next draft: 16 stays a draft
    assert d.reconcile([1, 2, 3, 10, 11, 12, 13, 14, 15]) == 9
    assert d.ids == [16] and d.base[-1] == 15 and not d.away
    d.ids += [17, 18]
    d.window()
    # the second draft was refused: the verifier's correction 99 ends the agreement
    assert d.reconcile([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 99]) == 10
    assert d.ids == [] and d.base[-1] == 99


def test_coupled_draws_are_the_rows_distribution_and_agree_across_rungs(served):
    """The coupled draw (Gumbel-max, noise from (seed, position)) of fp32's real row for one
    prompt is distributed as that row's distribution (chi-square over 6,000 seeds); INT4's draw
    with the same noise is the same token most of the time, not always (temperature 1, top-k 20:
    the rows differ where it matters)."""
    se = served
    ids = _ids(se, "Tell me a story about a dragon.")
    q_row = get_engine("int4").open(ids).logits().clone()
    p_row = get_engine("fp32").open(ids).logits().clone()
    base = SamplingParams(temperature=1.0, top_k=20)
    p = torch.softmax(Sampler(base).scores(p_row), dim=-1)
    q = torch.softmax(Sampler(base).scores(q_row), dim=-1)
    assert float((p - q).abs().sum()) > 0.05
    n = 6000
    counts = torch.zeros_like(p)
    same = 0
    for seed in range(n):
        s = Sampler(dataclasses.replace(base, seed=seed), coupled=True)
        t = s.sample(p_row, 3)
        counts[t] += 1
        same += s.sample(q_row, 3) == t
        if seed < 50:
            assert s.sample(p_row, 3) == t  # a function of (row, seed, position) alone
    support = (p > 1e-3).nonzero().flatten()
    expected = p[support] * n
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    # df = |support| - 1 <= 19; the 0.999 quantile of chi-square(19) is 43.8
    assert chi2 < 43.8, (chi2, len(support))
    assert float(counts[(p <= 1e-3)].sum()) <= n * 1e-3 * 3
    assert 0.5 < same / n < 1.0


# -- on the serving engine -----------------------------------------------------------------------
def test_verified_greedy_answers_are_fp32s_and_differ_from_int4s(served):
    se = served
    params = SamplingParams(max_tokens=32)
    differ = 0
    for text in PROMPTS:
        ids = _ids(se, text)
        v = se.generate_sync(se.request(ids, params, verified=True))
        ref = greedy(get_engine("fp32"), ids, params.max_tokens)
        assert v.token_ids == ref, text
        assert set(v.token_rungs) == {"fp32"} and not v.hazards and not v.handoffs
        assert v.timings["verify_windows"] >= 1 and 0 < v.timings["verify_kept"] <= v.timings["verify_drafts"]
        bare = se.generate_sync(se.request(ids, params))
        differ += bare.token_ids != ref
    assert differ >= 1  # INT4 alone does not give fp32's answer everywhere (France: "L'Étoile, ...")


def test_verified_streams_only_verified_tokens_in_order(served):
    se = served
    ids = _ids(se, PROMPTS[1])
    events = list(se.stream_sync(se.request(ids, SamplingParams(max_tokens=32), verified=True)))
    final = events[-1]
    assert isinstance(final, FinalEvent)
    streamed = [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]
    rungs = [r for ev in events if isinstance(ev, TokenEvent) for r in ev.rungs]
    assert streamed == final.result.token_ids and set(rungs) == {"fp32"}
    assert streamed == greedy(get_engine("fp32"), ids, 32)


def test_a_hazard_while_drafting_is_a_rejected_draft_and_a_second_a_handoff(served):
    """A NaN row on INT4 at step 5 ends that window: fp32 takes the step (a rejected draft, the
    hazard recorded). The fault stays (every row from step 5 on is NaN): the next draft row is
    refused too, and the request leaves verified decoding by an ordinary handoff to fp32. The
    answer is fp32's throughout."""
    se = served
    ids = _ids(se, PROMPTS[2])
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24), verified=True,
                                    faults=[parse_fault("nan@step=5")]))
    assert r.token_ids == greedy(get_engine("fp32"), ids, 24)
    assert [(h.check, h.rung, h.step) for h in r.hazards] == [("nonfinite", "int4", 5), ("nonfinite", "int4", 6)]
    assert [(h.from_rung, h.to_rung, h.step) for h in r.handoffs] == [("int4", "fp32", 6)]
    assert set(r.token_rungs) == {"fp32"}
    assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and not r.fallback


def test_verified_and_plain_requests_together_and_an_abort_mid_verification(served):
    """Six at once: three verified (fp32's answers), two plain (INT4's answers, as alone), one
    verified aborted after its first tokens; afterwards no slot or verifying session is left."""
    se = served
    params = SamplingParams(max_tokens=32)
    ids = [_ids(se, p) for p in PROMPTS]
    plain_alone = {k: se.generate_sync(se.request(ids[k], params)).token_ids for k in (3, 4)}
    aborted: list[object] = []

    def run(k):
        if k in (3, 4):
            return se.generate_sync(se.request(ids[k], params)).token_ids
        req = se.request(ids[k], SamplingParams(max_tokens=200, ignore_eos=True) if k == 5 else params,
                         verified=True)
        if k != 5:
            return se.generate_sync(req).token_ids
        it = se.stream_sync(req)
        for ev in it:
            if isinstance(ev, TokenEvent):
                se.abort(req.request_id)
            if isinstance(ev, FinalEvent):
                aborted.append(ev.result)
        return None

    res = _concurrently(run, 6)
    for k in (0, 1, 2):
        assert res[k] == greedy(get_engine("fp32"), ids[k], 32)
    for k in (3, 4):
        assert res[k] == plain_alone[k]
    assert len(aborted) == 1 and aborted[0].finish_reason == FinishReason.ABORT
    assert len(aborted[0].token_ids) < 200
    _until(lambda: se.scheduler.slots_in_use == 0 and se.aborts.live == 0, "every slot freed")
    # the verifying sessions of ended requests are closed at the standby's next turn
    se.generate_sync(se.request(ids[0], SamplingParams(max_tokens=4), start_rung=1))
    _until(lambda: not se.standby._kept, "the kept verifying sessions closed")


def test_a_seeded_sampled_verified_answer_is_fp32s_own_for_that_seed(served):
    """A sampled verified request draws every token from fp32's row with the noise of its seed
    and position: drafted (twice, so windows and timing differ) or answered by fp32 alone, the
    same seed gives the same answer."""
    se = served
    ids = _ids(se, "Tell me a story about a dragon.")
    for seed in (3, 4):
        params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=seed)
        a = se.generate_sync(se.request(ids, params, verified=True))
        b = se.generate_sync(se.request(ids, params, verified=True))
        alone = se.generate_sync(se.request(ids, params, verified=True, start_rung=1))
        assert a.token_ids == b.token_ids == alone.token_ids
        assert set(a.token_rungs) == {"fp32"} and a.timings["verify_windows"] >= 1
        assert "verify_windows" not in alone.timings


def test_under_load_verified_requests_are_answered_by_fp32_alone(served):
    """With one drafting request allowed (the default): A drafts; B, sent while A is in flight,
    is answered by the fp32 rung alone from the start; A, at its next window, finds the rung
    busy and goes on there alone with its verifying session. No drafts for B, no handoff for
    either, fp32's answers both."""
    se = served
    ids = [_ids(se, PROMPTS[k]) for k in (1, 5)]
    # The standby publishes its open handoffs after each turn: an earlier test's last answer ends
    # inside a turn, so A waits for that count to settle (it would find the rung busy).
    deadline = time.monotonic() + 30
    while se.standby.active + se.standby.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert se.standby.active + se.standby.depth == 0, "the standby still holds an earlier test's work after 30 s"
    se.draft_limit = 1
    stopped = se.scheduler.stopped_drafting
    try:
        a_req = se.request(ids[0], SamplingParams(max_tokens=40), verified=True)
        a_events = se.stream_sync(a_req)
        first = next(ev for ev in a_events if isinstance(ev, TokenEvent))
        b = se.generate_sync(se.request(ids[1], SamplingParams(max_tokens=40), verified=True))
        a = next(ev for ev in a_events if isinstance(ev, FinalEvent)).result
    finally:
        se.draft_limit = 8
    assert first.token_ids and a.timings["verify_windows"] >= 1 and "verify_windows" not in b.timings
    for k, r in enumerate((a, b)):
        assert r.token_ids == greedy(get_engine("fp32"), ids[k], 40)
        assert set(r.token_rungs) == {"fp32"} and not r.handoffs and not r.hazards
    assert not se._drafting and se.scheduler.stopped_drafting == stopped + 1  # A went on alone


def test_verified_is_refused_where_nothing_can_verify(model_info, settings):
    se = ServingEngine(ServingConfig(slots=1, standby_rungs=()), model_info, settings, standby_engines=[])
    try:
        with pytest.raises(ConfigError, match="verified"):
            se.generate_sync(se.request([1, 2, 3], verified=True))
    finally:
        se.close()


def test_a_first_window_that_crosses_a_prefill_chunk_is_decided_whole(served):
    """The first window evaluates the whole context and the drafts, in chunks of 256 ids: with 253
    context ids and 6 drafts the last chunk must still hold the window's 7 rows."""
    se = served
    words = "one two three four five six seven eight nine ten " * 40
    ids = _ids(se, "Repeat after me: " + words)
    ids = ids[:240] + _ids(se, "Now say hi.")[-13:]  # a chat prompt's end, 253 ids in all
    assert len(ids) == 253
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=12), verified=True))
    assert r.token_ids == greedy(get_engine("fp32"), ids, 12)
    assert r.timings["verify_windows"] >= 1 and not r.hazards


def test_an_int4_stall_while_drafting_hands_a_verified_request_to_fp32(served):
    """A draft decode that hangs (stall at draft 2, past a 0.5 s deadline): the watchdog hands the
    request to fp32 (a deadline hazard on int4, a handoff), which answers it: fp32's answer."""
    from qladder.health.guard import GUARD_PRESETS
    from qladder.policy import LadderConfig

    se = served
    ids = _ids(se, PROMPTS[2])
    ladder = LadderConfig(guard=dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=0.5))
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=16), verified=True, ladder=ladder,
                                    faults=[parse_fault("stall@step=2,s=3")]))
    assert r.token_ids == greedy(get_engine("fp32"), ids, 16)
    assert [(h.check, h.rung) for h in r.hazards] == [("deadline", "int4")]
    assert [(h.from_rung, h.to_rung) for h in r.handoffs] == [("int4", "fp32")]
    _until(lambda: se.scheduler.healthy, "the int4 pool's probe")


def test_a_failed_forward_in_a_chunked_handoff_ends_the_request(served, monkeypatch):
    """The standby's batched forward fails on the first chunk of a long context: the request ends
    (no rung above fp32: the fallback) instead of waiting forever on the rest of its context."""
    from qladder.errors import EngineError

    se = served
    engine = se.standby.engines[1]
    real = type(engine).run
    calls = []

    def failing(self, work):
        calls.append(len(work))
        if len(calls) == 1:
            raise EngineError("injected: the forward failed")
        return real(self, work)

    monkeypatch.setattr(type(engine), "run", failing)
    ids = _ids(se, "Repeat after me: " + "one two three four five six seven eight nine ten " * 40)
    assert len(ids) > 256
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=8), start_rung=1), timeout_s=60)
    assert r.finish_reason == FinishReason.DEGRADED and [h.check for h in r.hazards] == ["engine_error"]


def test_a_verified_request_never_returns_to_int4_alone(served):
    """A policy that returns to rung 0 after 3 healthy tokens (return_after) does not apply to a
    verified request: its answer stays fp32's, drafted throughout, and no slot is left."""
    from qladder.policy import LadderConfig, LadderPolicy

    se = served
    ids = _ids(se, PROMPTS[4])
    ladder = LadderConfig(policy=LadderPolicy(return_after=3))
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24), verified=True, ladder=ladder))
    assert r.token_ids == greedy(get_engine("fp32"), ids, 24) and set(r.token_rungs) == {"fp32"}
    assert not r.handoffs and r.timings["verify_windows"] >= 2
    _until(lambda: se.scheduler.slots_in_use == 0 and se.aborts.live == 0, "every slot freed")
    assert not se._drafting
