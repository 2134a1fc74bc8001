"""The serving core on the real engines: many requests at once, faults, aborts, stalls."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from qladder.errors import ConfigError, QueueFullError
from qladder.health.guard import GUARD_PRESETS
from qladder.incidents import IncidentStore
from qladder.model import user_prompt_ids
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.serving import SchedulerConfig, ServingConfig, ServingEngine
from qladder.stream import _complete
from qladder.testing.faults import parse_fault
from qladder.types import FinalEvent, FinishReason, TokenEvent
from qladder.validate.replay import greedy

from .conftest import get_engine

pytestmark = pytest.mark.slow

PROMPTS = ["Name three colors.", "What is 2+2?", "Write a haiku about rain.", "What is the capital of France?",
           "Explain gravity in one sentence.", "List five prime numbers.", "Say hello in Spanish.",
           "What is Python?"]


@pytest.fixture(scope="module")
def served():
    store = IncidentStore()
    guard = dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=1.0)
    cfg = ServingConfig(slots=8, allow_faults=True, ladder=LadderConfig(guard=guard),
                        scheduler=SchedulerConfig(max_queue=4, probe_every_s=0.2))
    se = ServingEngine(cfg, incidents=store, standby_engines=[get_engine("fp32")])
    yield se, store
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


def _fp32_greedy(ids, n):
    return greedy(get_engine("fp32"), ids, n)  # the validation harness's naive greedy loop


def test_eight_at_once_clean_rows_exact_faulted_rows_continue_on_fp32(served):
    se, store = served
    params = SamplingParams(max_tokens=24)
    ids = [_ids(se, p) for p in PROMPTS]
    alone = [se.generate_sync(se.request(i, params)) for i in ids]
    faults = {2: "nan@step=4", 5: "error@step=9"}
    before = store.count()
    res = _concurrently(lambda k: se.generate_sync(
        se.request(ids[k], params, faults=[parse_fault(faults[k])] if k in faults else [])), 8)
    for k, r in enumerate(res):
        if k in faults:
            step = int(faults[k].split("=")[1])
            assert r.token_ids[:step] == alone[k].token_ids[:step]
            assert set(r.token_rungs[:step]) == {"int4"} and set(r.token_rungs[step:]) == {"fp32"}
            assert r.token_ids[step:] == _fp32_greedy(ids[k] + r.token_ids[:step], len(r.token_ids) - step)
            assert [h.to_rung for h in r.handoffs] == ["fp32"] and r.handoffs[0].step == step
        else:
            assert r.token_ids == alone[k].token_ids, PROMPTS[k]
            assert r.hazards == alone[k].hazards
    assert store.count() - before == sum(len(r.hazards) for r in res)  # one incident per hazard


def test_an_aborted_request_frees_its_slot_for_the_next_within_one_step(served):
    se, _ = served
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    base = _ids(se, "Count from one to one thousand.")
    holders = [se.request(base, params) for _ in range(7)]
    streams = [se.stream_sync(r) for r in holders]
    for s in streams:
        next(s)  # all 7 hold a slot and decode
    victim = se.request(base, params)
    vs = se.stream_sync(victim)
    assert isinstance(next(vs), TokenEvent)
    waiting = se.request(_ids(se, "Name a color."), SamplingParams(max_tokens=4))
    got: list = []
    th = threading.Thread(target=lambda: got.append(se.generate_sync(waiting)))
    th.start()
    _until(lambda: se.stats()["queue_depth"] == 1, "the ninth request to wait for a slot (every slot taken)")
    vs.close()  # the client goes away: the generator aborts its request
    th.join(timeout=60)
    log = list(se.scheduler.slot_log)
    released = next(e for e in log if e[1] == "release" and e[2] == victim.request_id)
    admitted = next(e for e in log if e[1] == "admit" and e[2] == waiting.request_id)
    assert admitted[3] == released[3] and admitted[0] - released[0] <= 1
    assert got and got[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    for r in holders:
        assert se.abort(r.request_id)
    for s in streams:
        final = [e for e in s if isinstance(e, FinalEvent)]
        assert final[0].result.finish_reason == FinishReason.ABORT
    assert se.stats()["live"] == 0


def test_a_hung_int4_step_moves_its_whole_batch_to_the_standby(served):
    se, _ = served
    params = SamplingParams(max_tokens=20)
    ids = [_ids(se, p) for p in PROMPTS[:4]]
    stall = parse_fault("stall@step=8,s=120")  # hangs inside llama_decode until aborted
    t0 = time.perf_counter()
    res = _concurrently(lambda k: se.generate_sync(se.request(ids[k], params, faults=[stall] if k == 0 else [])), 4)
    wall = time.perf_counter() - t0
    assert wall < 60  # nobody waited for the 120 s hang
    for k, r in enumerate(res):
        # every request whose row was in the hung decode goes on at fp32; one admitted after it is INT4's
        if k == 0 or r.hazards:
            assert [h.check for h in r.hazards] == ["deadline"]
            assert r.handoffs and r.handoffs[0].to_rung == "fp32" and r.token_rungs[-1] == "fp32"
        else:
            assert set(r.token_rungs) == {"int4"}
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert se.scheduler.stalls >= 1
    deadline = time.monotonic() + 10
    while not se.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert se.ready  # the probe after the stall succeeded
    assert se.generate_sync(se.request(ids[1], params)).token_rungs[0] == "int4"


def test_an_answer_cut_inside_a_multibyte_character_never_ends_in_replacement(served):
    se, _ = served
    ids = _ids(se, "Say hello in Spanish.")  # "Hola in español! 😊🌍": emoji split over byte tokens
    full = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24)))
    pieces = [se.int4.detokenize_bytes([t]) for t in full.token_ids]
    cuts = [k for k in range(1, len(pieces) + 1) if not _complete(b"".join(pieces[:k]))]
    assert cuts, f"no multi-byte character split over tokens in {full.text!r}"
    r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=cuts[0])))
    assert not r.text.endswith("\ufffd")
    assert r.text == se.int4.detokenize_bytes(r.token_ids).decode("utf-8")
    assert len(r.token_ids) < cuts[0]  # the partial character's tokens were dropped


def test_a_full_queue_is_a_typed_error_and_faults_need_the_operator(served):
    se, _ = served
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    ids = _ids(se, "Count to a hundred.")
    # an answer handed to the standby frees its INT4 slot just after its final event
    _until(lambda: se.stats()["slots_in_use"] == 0, "the earlier tests' slots to be freed")
    bound = se.int4.n_slots + se.config.scheduler.max_queue
    reqs = [se.request(ids, params) for _ in range(bound)]
    streams = [se.stream_sync(r) for r in reqs]  # submitted at once: slots plus the queue
    with pytest.raises(QueueFullError):
        se.stream_sync(se.request(ids, params))
    for r in reqs:
        assert se.abort(r.request_id)
    for s in streams:
        assert next(e for e in s if isinstance(e, FinalEvent)).result.finish_reason == FinishReason.ABORT
    cfg = se.config
    se.config = dataclasses.replace(cfg, allow_faults=False)
    try:
        with pytest.raises(ConfigError):
            se.generate_sync(se.request(ids, params, faults=[parse_fault("nan@step=1")]))
    finally:
        se.config = cfg
    assert se.stats()["live"] == 0


@pytest.mark.parametrize("n", [49152, 1031, 17, 3, 1])
def test_native_argmax_is_torchs_argmax(tmp_path, n):
    """First maximum; NaN counts as the maximum; ties and +Inf as torch decides them."""
    import ctypes

    import numpy as np
    import torch

    from qladder.engines.monitor import load_native

    lib = load_native(tmp_path)
    lib.qladder_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.qladder_argmax.restype = ctypes.c_int64
    rng = np.random.default_rng(n)
    for trial in range(24):
        a = rng.standard_normal(n).astype(np.float32)
        if trial % 4 == 1:
            a[rng.integers(n)] = np.nan
        elif trial % 4 == 2:
            a[:] = 1.0
        elif trial % 4 == 3:
            a[rng.integers(n)] = np.inf
        assert lib.qladder_argmax(a.ctypes.data, n) == int(torch.from_numpy(a).argmax())


def test_a_request_back_from_the_standby_is_rung_0_from_its_first_row(served):
    """return_after=3 and a NaN from step 2 on: up to fp32 at 2, back to INT4 at 5, whose first
    row back is INT4's own, faulted, and caught there (at step 5, on int4), as the in-process
    ladder does on the same rungs; no INT4 token is emitted after step 2."""
    from qladder.ladder import Ladder
    from qladder.policy import LadderPolicy

    se, _ = served
    ladder = LadderConfig(guard=se.config.ladder.guard, policy=LadderPolicy(return_after=3))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids, nan = _ids(se, PROMPTS[0]), [parse_fault("nan@step=2")]
    served_r = se.generate_sync(se.request(ids, params, faults=nan, ladder=ladder), timeout_s=300)
    local = Ladder([get_engine("int4"), get_engine("fp32")], ladder).generate(ids, params, faults=nan)
    for r in (served_r, local):
        assert [(h.check, h.rung) for h in r.hazards][:2] == [("nonfinite", "int4")] * 2
        assert [h.step for h in r.hazards][:2] == [2, 5]
        assert r.token_rungs[:2] == ["int4"] * 2 and "int4" not in r.token_rungs[2:]
        assert [(h.from_rung, h.to_rung, h.step) for h in r.handoffs][:3] == [
            ("int4", "fp32", 2), ("fp32", "int4", 5), ("int4", "fp32", 5)]
    assert [(h.check, h.rung, h.step) for h in served_r.hazards] == [(h.check, h.rung, h.step) for h in local.hazards]
    assert served_r.token_rungs == local.token_rungs


def test_a_gain_fault_hits_its_own_slot_only(served):
    """A massive-activation gain on one request (added in C to that slot's rows of layer 11):
    the monitor catches it at prefill and the request continues on fp32; its neighbour in the
    batch is untouched and equals its answer alone."""
    se, _ = served
    params = SamplingParams(max_tokens=12)
    a, b = _ids(se, PROMPTS[0]), _ids(se, PROMPTS[3])
    alone = se.generate_sync(se.request(b, params))
    gain = parse_fault("gain@layer=11,channel=507,x=3")
    res = _concurrently(lambda k: se.generate_sync(se.request(a if k == 0 else b, params,
                                                              faults=[gain] if k == 0 else [])), 2)
    hit, clean = res
    assert hit.hazards and hit.hazards[0].check in ("activation", "outlier") and hit.hazards[0].step == 0
    assert set(hit.token_rungs) == {"fp32"}
    assert clean.token_ids == alone.token_ids and not clean.hazards


def test_a_bug_in_our_code_is_not_a_hazard(served, monkeypatch):
    """A TypeError inside the standby's step ends that request with the fallback and is raised
    again when the pool closes: bugs fail loudly, they are never recorded as engine hazards."""
    from qladder.errors import EngineDeadError
    from qladder.serving.standby import StandbyPool

    se, _ = served
    pool = StandbyPool({1: get_engine("fp32")}, se.aborts, max_sessions=1)

    def broken(self, t, got):
        raise TypeError("a bug")

    monkeypatch.setattr(StandbyPool, "_rows", broken)  # where a turn's rows are acted on
    m = se._machine_for_test(se.request(_ids(se, "Hi"), SamplingParams(max_tokens=4)))
    from qladder.actions import MoveTo

    pool.submit(m, MoveTo(1, poisoned=False))
    deadline = time.monotonic() + 30
    while m.done is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.done is not None and m.done.fallback and m.done.hazards == []
    with pytest.raises(EngineDeadError):
        pool.close()


def test_a_copied_prefix_gives_the_rows_of_a_full_prefill(model_info, settings):
    """The chat template's system turn is prefilled once; a slot that copies its KV (or kept it
    from its last request) and decodes the rest of the prompt gives bit-identical rows to a full
    prefill, on every later step too."""
    import torch

    from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry
    from qladder.serving.engine import template_prefix

    e = BatchedLlamaCpp(model_info, n_slots=2, n_ctx=256, native_dir=settings.cache_dir)
    try:
        pre = template_prefix(model_info, e.tokenize)
        e.cache_prefix(pre)
        ids = user_prompt_ids(model_info.chat_template, "Name three colors.", e.tokenize)
        assert len(pre) >= 16 and tuple(ids[:len(pre)]) == e.prefix

        def rows(slot, cached):
            held = e.copy_prefix(slot) if cached else 0
            e.decode([Entry(slot, ids[held:], held)])
            pos, out = len(ids), []
            for _ in range(12):
                out.append(e.row(slot).clone())
                e.decode([Entry(slot, [e.argmax(slot)], pos)])
                pos += 1
            e.release(slot)  # keeps the prefix's KV in a slot that holds it
            return out

        full, copied = rows(0, False), rows(1, True)
        assert all(torch.equal(a, b) for a, b in zip(full, copied, strict=True))
        kept = rows(1, True)  # the slot kept the prefix from its last request: no second copy
        assert e.prefix_copies == 1 and all(torch.equal(a, b) for a, b in zip(full, kept, strict=True))
    finally:
        e.close()


def test_each_requests_guard_sets_how_often_its_decodes_are_monitored(model_info, settings, monkeypatch):
    """The default guard checks activations every 32 decode steps of the pool, the strict one
    every step (GuardConfig.activation_every, read per request: no separate scheduler knob), and a
    default request batched beside a strict one is not handed the peaks its own guard did not ask
    for (its verdict never depends on its neighbours)."""
    from qladder.serving.scheduler import Int4Scheduler

    rows: dict[str, list[bool]] = {}  # request id -> whether each of its rows came with peaks
    together: list[int] = []  # requests in slots at each of the default request's rows
    real = Int4Scheduler._on_row

    def spy(self, s, error, monitored):
        rows.setdefault(s.m.request_id, []).append(monitored)
        if s.m.request_id == "default":
            together.append(len(self._slots))
        return real(self, s, error, monitored)

    monkeypatch.setattr(Int4Scheduler, "_on_row", spy)
    se = ServingEngine(ServingConfig(slots=2, prefix_cache=False), model_info, settings, standby_engines=[])
    try:
        assert se.scheduler.monitor, "the native helpers did not build: nothing is ever monitored"
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        reqs = {p: se.request(_ids(se, "Name three colors."), params, request_id=p,
                              ladder=LadderConfig(guard=GUARD_PRESETS[p])) for p in ("strict", "default")}
        results = _concurrently(lambda k: se.generate_sync(list(reqs.values())[k]), 2)
        assert [len(r.token_ids) for r in results] == [40, 40]
    finally:
        se.close()
    strict, default = rows["strict"], rows["default"]
    assert len(strict) == len(default) == 40  # the prefill's row, then 39 decodes each
    assert all(strict)
    assert sum(n == 2 for n in together) >= 30  # decoded beside the strict one, not after it
    assert default[0] and 1 <= sum(default[1:]) <= 3  # its prefill, then its own every-32nd decodes


def test_an_outlier_in_an_early_prefill_chunk_is_judged_on_the_last_chunks_row(model_info, settings):
    """A prompt longer than `prefill_chunk` is prefilled in chunks and only the last chunk's row is
    judged: the peaks of the earlier chunks must reach it. A guard whose activation bound sits
    between the whole prompt's peak (position 0, in the first chunk) and the last chunk's own must
    fire at the prefill, as on the one-sequence engine that prefills the prompt at once."""
    from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry

    k = 16
    probe = BatchedLlamaCpp(model_info, n_slots=1, n_ctx=512, n_threads=1, native_dir=settings.cache_dir)
    try:
        assert probe.has_native, probe.native_error
        ids = user_prompt_ids(model_info.chat_template, "Summarize the plot of a long novel about a lighthouse "
                              "keeper, his daughter and the storm that changed their island.", probe.tokenize)
        assert len(ids) > 2 * k
        probe.decode([Entry(0, ids, 0)], monitor=True)
        top = float(probe.peaks(0)[0].max())
        start = (len(ids) - 1) // k * k  # the last chunk's first position
        probe.truncate(0, start)
        probe.decode([Entry(0, ids[start:], start)], monitor=True)
        last = float(probe.peaks(0)[0].max())
        limit = probe.activation_limit
    finally:
        probe.close()
    assert top > 4 * last
    guard = dataclasses.replace(GUARD_PRESETS["default"], activation_fraction=(top * last) ** 0.5 / limit,
                                step_deadline_s=60.0)
    se = ServingEngine(ServingConfig(slots=1, prefix_cache=False, scheduler=SchedulerConfig(prefill_chunk=k),
                                     ladder=LadderConfig(guard=guard)), model_info, settings, standby_engines=[])
    try:
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=4)))
    finally:
        se.close()
    assert [(h.check, h.step) for h in r.hazards][:1] == [("activation", 0)], r.hazards
    assert r.fallback and r.token_ids == []


def test_a_cached_prompt_gives_the_answer_and_the_verdict_of_its_prefill(model_info, settings):
    """The prompt cache (serving/prompt_states.py): the same prompt again is restored, not
    prefilled, and gives the same greedy answer, bit for bit, as its prefill did and as a pool
    without the cache does; a guard whose activation bound sits between the prompt's peak and its
    last position's own still fires at the first row (the prefill's peaks are carried); a request
    with faults is neither stored nor restored."""
    from qladder.serving.prompt_states import PromptStates

    params = SamplingParams(max_tokens=24)

    def answers(cache_bytes, guard=GUARD_PRESETS["default"], n=2, faults=()):
        se = ServingEngine(ServingConfig(slots=2, prefix_cache=False, allow_faults=True,
                                         scheduler=SchedulerConfig(prompt_cache_bytes=cache_bytes),
                                         ladder=LadderConfig(guard=guard)), model_info, settings, standby_engines=[])
        try:
            p = user_prompt_ids(model_info.chat_template, "Summarize the plot of a long novel about a lighthouse "
                                "keeper, his daughter and the storm that changed their island.", se.int4.tokenize)
            out = [se.generate_sync(se.request(p, params, faults=faults)) for _ in range(n)]
            prompts: PromptStates = se.scheduler.prompts
            return out, (prompts.hits, prompts.misses, len(prompts)), se.int4.activation_limit, p
        finally:
            se.close()

    (first, again), counts, limit, p = answers(512 << 20)
    assert counts == (1, 1, 1), counts  # prefilled once, restored once
    (plain,), off, _, _ = answers(0, n=1)
    assert off == (0, 0, 0)
    assert again.token_ids == first.token_ids == plain.token_ids and len(first.token_ids) > 4
    assert not first.hazards and not again.hazards

    # the guard's bound between the whole prompt's peak and its last position's own (as the
    # chunked-prefill test above): the restored prompt's first row must fire as the prefill's did
    from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry

    probe = BatchedLlamaCpp(model_info, n_slots=1, n_ctx=512, n_threads=1, native_dir=settings.cache_dir)
    try:
        probe.decode([Entry(0, p, 0)], monitor=True)
        top = float(probe.peaks(0)[0].max())
        probe.truncate(0, len(p) - 1)
        probe.decode([Entry(0, p[-1:], len(p) - 1)], monitor=True)
        last = float(probe.peaks(0)[0].max())
    finally:
        probe.close()
    assert top > 4 * last
    guard = dataclasses.replace(GUARD_PRESETS["default"], activation_fraction=(top * last) ** 0.5 / limit,
                                step_deadline_s=60.0)
    results, counts, _, _ = answers(512 << 20, guard=guard)
    assert counts == (1, 1, 1), counts
    for r in results:
        assert [(h.check, h.step) for h in r.hazards][:1] == [("activation", 0)], r.hazards

    # the peaks judged are the entry's, not what the slot's last occupant left: an entry whose
    # peaks are over the bound (put while the scheduler's thread waits for work) fires at once
    from qladder.serving.prompt_states import PromptState

    se = ServingEngine(ServingConfig(slots=1, prefix_cache=False), model_info, settings, standby_engines=[])
    try:
        ok = se.generate_sync(se.request(p, params))
        assert not ok.hazards, ok.hazards
        e = se.scheduler.prompts.get(tuple(p), True)
        assert e is not None and e.peaks is not None and e.rest is not None
        se.scheduler.prompts.put(tuple(p), PromptState(e.state, e.peaks + 2 * limit, e.rest + 2 * limit))
        r = se.generate_sync(se.request(p, params))
    finally:
        se.close()
    assert [(h.check, h.step) for h in r.hazards][:1] == [("activation", 0)], r.hazards

    faulted, counts, _, _ = answers(512 << 20, faults=(parse_fault("nan@step=2"),))
    assert counts == (0, 0, 0), counts  # never looked up, never kept
    assert all(r.hazards for r in faulted)
