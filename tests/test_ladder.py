"""The ladder on scripted and real engines: hazards caught before emission, handoff by ids."""

from __future__ import annotations

import math

import pytest
import torch

from qladder.engines.scripted import ScriptedEngine
from qladder.health.guard import GUARD_PRESETS, StepGuard
from qladder.incidents import IncidentStore
from qladder.ladder import Ladder, LadderConfig
from qladder.model import user_prompt_ids
from qladder.policy import LadderPolicy
from qladder.sampling import SamplingParams
from qladder.testing.faults import parse_fault
from qladder.types import FALLBACK_TEXT, FinishReason
from qladder.validate.replay import greedy

from .conftest import get_engine


def test_write_up_example_nan_primary_backup_gives_token_2():
    primary = ScriptedEngine(lambda ids: [1.0, math.nan, 2.5], 3, name="int4")
    backup = ScriptedEngine(lambda ids: [1.0, 0.2, 8.5], 3, name="fp32")
    store = IncidentStore()
    r = Ladder([primary, backup], incidents=store).generate([0], SamplingParams(max_tokens=1))
    assert r.token_ids == [2] and r.degraded and r.token_rungs == ["fp32"]
    assert [h.check for h in r.hazards] == ["nonfinite"]
    assert store.count() == 1


def test_write_up_example_without_backup_gives_the_safe_fallback():
    primary = ScriptedEngine(lambda ids: [1.0, math.nan, 2.5], 3, name="int4")
    store = IncidentStore()
    r = Ladder([primary], incidents=store).generate([0], SamplingParams(max_tokens=4))
    assert r.finish_reason == FinishReason.DEGRADED and r.fallback and r.text == FALLBACK_TEXT
    assert r.token_ids == [] and store.count() == 1
    assert store.rows()[0]["action"] == "stop:degraded"


def test_a_finished_answer_runs_no_forward_pass_past_its_last_token():
    """n tokens cost the prefill and n - 1 pushes: the last token is never pushed, on the ladder
    and on the bare greedy loop alike, so neither pays for a row nobody reads."""
    def cycle(ids):
        row = [0.0] * 8
        row[1 + len(ids) % 7] = 9.0  # a 7-token cycle: no loop hazard within 5 tokens
        return row

    for run in (lambda e: Ladder([e]).generate([0], SamplingParams(max_tokens=5)).token_ids,
                lambda e: greedy(e, [0], 5)):
        engine = ScriptedEngine(cycle, 8, name="int4")
        assert len(run(engine)) == 5
        assert engine.steps == 5  # prefill + 4 pushes


def test_return_after_handoff_catches_up_the_token_accepted_on_the_way():
    """A policy handoff on a healthy token hands over the whole context, the token included."""
    seen: list[list[int]] = []

    def primary_fn(ids):
        seen.append(list(ids))
        return [0.0, math.nan, 9.0, 0.0]

    primary = ScriptedEngine(primary_fn, 4, name="int4")
    backup = ScriptedEngine(lambda ids: [0.0, 9.0, 0.0, 0.0], 4, name="fp32")
    r = Ladder([primary, backup], LadderConfig(policy=LadderPolicy(return_after=2))).generate(
        [3], SamplingParams(max_tokens=4))
    assert r.token_ids[:2] == [1, 1] and r.token_rungs[:2] == ["fp32", "fp32"]
    back = r.handoffs[1]
    assert back.to_rung == "int4" and back.step == 2
    assert seen[1] == [3, 1, 1]  # int4 caught up on the prompt and both fp32 tokens


def test_a_loop_both_rungs_reproduce_ends_withheld_and_recorded():
    """The model's own loop (both rungs continue it): finish_reason repetition, one copy of the
    pattern kept, the rest of the loop never in the answer; one incident."""

    def looping(ids):  # 3 new tokens, then token 4 forever
        row = [0.0] * 6
        row[min(len(ids), 4) if len(ids) < 4 else 4] = 5.0
        return row

    store = IncidentStore()
    engines = [ScriptedEngine(looping, 6, name="int4"), ScriptedEngine(looping, 6, name="fp32")]
    r = Ladder(engines, incidents=store).generate([0], SamplingParams(max_tokens=40))
    assert r.finish_reason == FinishReason.REPETITION and not r.fallback
    assert r.token_ids == [1, 2, 3, 4] and r.token_rungs == ["int4"] * 4
    assert [h.check for h in r.hazards] == ["repetition"] and store.count() == 1


def test_incident_with_a_lone_surrogate_in_the_prompt_is_stored_escaped():
    primary = ScriptedEngine(lambda ids: [1.0, math.nan, 2.5], 3, name="int4")
    store = IncidentStore()
    r = Ladder([primary], incidents=store).generate([0], SamplingParams(max_tokens=2),
                                                   prompt_text="bad \ud800 text")
    assert r.fallback and store.count() == 1
    assert store.rows()[0]["prompt_text"] == "bad \\ud800 text"


def test_a_failing_incident_store_does_not_fail_the_answer(caplog):
    def broken(_incident):
        raise OSError("disk full")

    primary = ScriptedEngine(lambda ids: [1.0, math.nan, 2.5], 3, name="int4")
    backup = ScriptedEngine(lambda ids: [1.0, 0.2, 8.5], 3, name="fp32")
    r = Ladder([primary, backup], incidents=broken).generate([0], SamplingParams(max_tokens=1))
    assert r.token_ids == [2]
    assert "incident store failed" in caplog.text and "nonfinite" in caplog.text


def _chat(engine, text="Write one sentence about the sea."):
    from qladder.model import inspect_model

    return user_prompt_ids(inspect_model().chat_template, text, engine.tokenize)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_nan_fault_hands_off_and_continues_as_fp32_would(k):
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    prompt = _chat(int4)
    store = IncidentStore()
    ladder = Ladder([int4, fp32], incidents=store)
    r = ladder.generate(prompt, SamplingParams(max_tokens=16), faults=[parse_fault(f"nan@step={k}")])
    assert r.token_rungs[:k] == ["int4"] * k
    assert r.token_rungs[k:] == ["fp32"] * (len(r.token_ids) - k)
    assert [(h.check, h.step, h.rung) for h in r.hazards] == [("nonfinite", k, "int4")]
    assert store.count() == 1 and len(r.handoffs) == 1 and r.handoffs[0].step == k
    # Nothing from step k was emitted: the rest is what fp32 generates fed the same prefix.
    prefix = r.token_ids[:k]
    rest = greedy(fp32, prompt + prefix, 16 - k)  # the validation harness's naive greedy loop
    assert rest and r.token_ids[k:] == rest  # a continuation to compare, not an empty tail


@pytest.mark.parametrize("spec,check", [
    ("zero@step=2", "flat"),
    ("inf@step=2", "nonfinite"),
    ("error@step=2", "engine_error"),
    ("stall@step=2,s=0.3", "deadline"),
])
def test_each_fault_is_caught_and_recorded_once(spec, check):
    """On a fake clock that only the injected stall moves: a real step never overruns the 0.2 s
    deadline however busy the machine, and the 0.3 s stall always does."""
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    from qladder.health.guard import GuardConfig

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    store = IncidentStore()
    cfg = LadderConfig(guard=GuardConfig(step_deadline_s=0.2))
    r = Ladder([int4, fp32], cfg, incidents=store, clock=lambda: now[0], sleep=sleep).generate(
        _chat(int4), SamplingParams(max_tokens=8), faults=[parse_fault(spec)])
    assert [h.check for h in r.hazards] == [check]
    assert r.hazards[0].step == 2 and r.token_rungs[:2] == ["int4", "int4"]
    assert set(r.token_rungs[2:]) == {"fp32"}
    assert store.count() == len(r.hazards) == 1
    row = store.rows()[0]
    assert row["check_name"] == check and row["action"] == "handoff:fp32"
    assert row["handoff_latency_ms"] is not None and row["prompt_text"] is None


def test_every_fault_without_backup_ends_in_fallback_not_exception():
    int4 = get_engine("int4")
    for spec in ["nan@step=0", "zero@step=1", "inf@step=0", "error@step=0"]:
        store = IncidentStore()
        r = Ladder([int4], incidents=store).generate(_chat(int4), SamplingParams(max_tokens=6),
                                                     faults=[parse_fault(spec)])
        assert r.finish_reason == FinishReason.DEGRADED and r.fallback
        assert store.count() == 1


def _w4a16_logits_with_gain(w4a16, prompt, x):
    w4a16.add_layer_fault(11, lambda h: h * torch.where(torch.arange(h.shape[-1]) == 507, x, 1.0).to(h.dtype))
    try:
        s = w4a16.open(prompt)
        row = s.logits().clone()
        s.close()
        return row
    finally:
        w4a16.clear_faults()


def test_gain_fault_on_w4a16_caught_by_activation_headroom_before_nonfinite():
    w4a16, fp32 = get_engine("w4a16"), get_engine("fp32")
    prompt = _chat(fp32, "Hi")
    # The fp16 boundary is real: x=2.5 lifts channel 507 to ~62,300 (95% of 65,504) with finite
    # logits; x=3 overflows to inf and the logits become non-finite.
    assert torch.isfinite(_w4a16_logits_with_gain(w4a16, prompt, 2.5)).all()
    assert not torch.isfinite(_w4a16_logits_with_gain(w4a16, prompt, 3.0)).all()
    for x, finite in [(2.5, True), (3.0, False)]:
        store = IncidentStore()
        r = Ladder([w4a16, fp32], incidents=store).generate(
            prompt, SamplingParams(max_tokens=12), faults=[parse_fault(f"gain@layer=11,channel=507,x={x}")])
        assert [h.check for h in r.hazards] == ["activation"], x
        h = r.hazards[0]
        assert h.step == 0 and h.layer == 11 and h.value is not None and h.value > 0.6 * 65504
        assert math.isfinite(h.value) == finite
        assert set(r.token_rungs) == {"fp32"} and r.text.strip() and store.count() == 1
    # Without the fault, w4a16 serves the prompt itself: its natural peak (~25k, 38%) is inside.
    r = Ladder([w4a16, fp32]).generate(prompt, SamplingParams(max_tokens=4))
    assert r.hazards == [] and set(r.token_rungs) == {"w4a16"}


def test_clean_prompts_do_not_climb():
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    prompts = ["What is the capital of Italy?", "Write a haiku about autumn.", "What is 12 times 7?",
               "Explain what a CPU does in two sentences.", "def add(a, b):\n    # complete this",
               "List three fruits.", "Translate 'good morning' to French.", "Why is the sky blue?"]
    ladder = Ladder([int4, fp32])
    for p in prompts:
        r = ladder.generate(_chat(int4, p), SamplingParams(max_tokens=24))
        assert r.handoffs == [] and not r.fallback, (p, r.hazards)


def test_return_to_rung_zero_after_k_healthy_tokens():
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    cfg = LadderConfig(policy=LadderPolicy(return_after=3))
    r = Ladder([int4, fp32], cfg).generate(_chat(int4), SamplingParams(max_tokens=10),
                                           faults=[parse_fault("stall@step=1,s=0")])
    assert r.hazards == []  # a zero-second stall is no hazard
    r = Ladder([int4, fp32], cfg).generate(_chat(int4), SamplingParams(max_tokens=10),
                                           faults=[parse_fault("error@step=2")])
    # The error is sticky (a broken kernel stays broken): each return hits it again.
    assert r.token_rungs[:2] == ["int4", "int4"] and "fp32" in r.token_rungs
    assert all(h.check == "engine_error" for h in r.hazards) and len(r.hazards) >= 2
    assert len(r.handoffs) >= 2 and r.handoffs[1].to_rung == "int4"


def test_warm_shadow_handoff_matches_cold():
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    prompt = _chat(int4)
    fault = [parse_fault("nan@step=6")]
    cold = Ladder([int4, fp32]).generate(prompt, SamplingParams(max_tokens=12), faults=fault)
    warm = Ladder([int4, fp32], LadderConfig(warm_shadow=True, shadow_sync_every=4)).generate(
        prompt, SamplingParams(max_tokens=12), faults=fault)
    assert warm.handoffs[0].warm and not cold.handoffs[0].warm
    assert warm.handoffs[0].caught_up_tokens < cold.handoffs[0].caught_up_tokens
    # The warm session continues the same answer the cold open does, after the handoff too.
    assert len(cold.token_ids) > 6 and warm.token_ids == cold.token_ids
    assert warm.token_rungs == cold.token_rungs and warm.token_rungs[6:] == ["fp32"] * (len(cold.token_ids) - 6)




def test_int4_activation_monitor_sees_the_massive_activation():
    int4 = get_engine("int4")
    assert int4.monitor is not None, int4.monitor_error
    int4.monitor_activations(True)
    s = int4.open(_chat(int4, "Hi"))
    peaks = int4.activation_peaks.clone()
    s.close()
    rest = int4.activation_rest_peaks.clone()
    # SmolLM2's residual stream carries ~24,900 on channel 507 from layer 11 on (first token);
    # away from the first position it stays small.
    assert 20_000 < float(peaks[11]) < 32_000 and float(peaks[5]) < 2_000
    assert float(peaks.max()) < 0.6 * 65504
    assert float(rest.max()) < 4_000 and float(rest[11]) < float(peaks[11]) / 5


@pytest.mark.parametrize("x,check", [(1.5, "outlier"), (2.5, "activation"), (4.0, "activation")])
def test_int4_gain_fault_caught_at_prefill_by_the_activation_monitor(x, check):
    int4, fp32 = get_engine("int4"), get_engine("fp32")
    store = IncidentStore()
    r = Ladder([int4, fp32], incidents=store).generate(
        _chat(int4, "What is the capital of France? Answer in one sentence."), SamplingParams(max_tokens=16),
        faults=[parse_fault(f"gain@layer=11,channel=507,x={x}")])
    assert [(h.check, h.step, h.layer) for h in r.hazards] == [(check, 0, 11)]
    assert set(r.token_rungs) == {"fp32"} and "Paris" in r.text
    assert store.count() == 1
    # Bare, the same fault is silent garbage: finite logits, a wrong answer.
    bare = Ladder([int4], LadderConfig(guard=GUARD_PRESETS["off"])).generate(
        _chat(int4, "What is the capital of France? Answer in one sentence."), SamplingParams(max_tokens=16),
        faults=[parse_fault(f"gain@layer=11,channel=507,x={x}")])
    assert bare.hazards == [] and "Paris" not in bare.text


def test_int4_fused_row_stats_match_torch_reductions():
    int4 = get_engine("int4")
    int4.guard_row_stats(True)
    try:
        s = int4.open(_chat(int4, "Hi"))
        row = s.logits()
        total, hi, lo = s.row_stats()
        assert total == pytest.approx(float(row.double().sum()), rel=1e-6)
        assert (hi, lo) == (float(row.max()), float(row.min()))
        s.push(int(row.argmax()))
        row2 = s.logits()
        assert s.row_stats()[1] == float(row2.max())
        s.close()
    finally:
        int4.guard_row_stats(False)
    s = int4.open(_chat(int4, "Hi"))
    s.logits()
    assert s.row_stats() is None  # without the flag the copy is a plain copy
    s.close()


def test_native_copy_stats_on_nan_and_inf_rows(tmp_path):
    import numpy as np

    from qladder.engines.monitor import ActivationMonitor

    m = ActivationMonitor(n_layer=2, n_embd=4, cache_dir=tmp_path)
    for src, expect in [([1.0, math.nan, 2.5], "nan"), ([1.0, math.inf, 2.5], "inf"), ([0.0, 0.0, 0.0], "zero")]:
        a = np.array(src, dtype=np.float32)
        dst = np.empty_like(a)
        out = np.zeros(3)
        m.copy_stats(a.ctypes.data, dst.ctypes.data, a.size, out.ctypes.data)
        np.testing.assert_array_equal(dst, a)
        guard_hazard = StepGuard().check(torch.from_numpy(dst), [], "int4", row_stats=tuple(out))
        assert guard_hazard is not None and guard_hazard.check == ("flat" if expect == "zero" else "nonfinite")


@pytest.mark.parametrize("n", [49152, 1031, 17, 3])
def test_native_copy_stats_match_numpy_on_long_rows(tmp_path, n):
    """The vector-lane pass against float64 numpy, with a NaN or an Inf at every kind of position
    (lane, block tail, scalar tail) and a finite row whose float partial sums overflow."""
    import numpy as np

    from qladder.engines.monitor import ActivationMonitor

    m = ActivationMonitor(n_layer=2, n_embd=4, cache_dir=tmp_path)
    rng = np.random.default_rng(n)

    def stats(a):
        dst, out = np.empty_like(a), np.zeros(3)
        m.copy_stats(a.ctypes.data, dst.ctypes.data, a.size, out.ctypes.data)
        np.testing.assert_array_equal(dst, a)
        return out

    a = (rng.standard_normal(n) * 8 + 3).astype(np.float32)
    out = stats(a)
    assert out[0] == pytest.approx(float(a.astype(np.float64).sum()), rel=1e-5, abs=1e-2)
    assert (out[1], out[2]) == (float(a.max()), float(a.min()))
    for pos in {0, n // 2, n - 1}:
        for bad, expect_nan in ((np.nan, True), (np.inf, False), (-np.inf, False)):
            b = a.copy()
            b[pos] = bad
            out = stats(b)
            assert not math.isfinite(out[0])
            assert math.isnan(out[1]) == expect_nan and math.isnan(out[2]) == expect_nan
    big = np.full(n, 3e38, dtype=np.float32)  # finite; float sums overflow, the double one does not
    out = stats(big)
    assert out[0] == pytest.approx(3e38 * n, rel=1e-6) and out[1] == out[2] == pytest.approx(3e38, rel=1e-6)


def test_corrupted_quantization_scale_in_a_gguf_copy_is_caught(tmp_path):
    """A corrupted scale in one Q4_1 block of layer 11's ffn_down (row 507): real kernels, real
    garbage bare; the guarded ladder sees the outlier at prefill and fp32 answers."""
    from qladder.config import Settings
    from qladder.engines import load_engine
    from qladder.model import bundled_model_path, inspect_model
    from qladder.testing.gguf_patch import corrupt_gguf_scale

    dst = tmp_path / "corrupt.gguf"
    change = corrupt_gguf_scale(bundled_model_path(), dst, x=1000.0)
    assert change["n_blocks"] == 1 and change["new_d_max_abs"] == pytest.approx(change["d_max_abs"] * 1000.0, rel=1e-3)
    bad = load_engine("int4", inspect_model(dst, tmp_path), Settings.from_env())
    fp32 = get_engine("fp32")
    try:
        prompt = _chat(bad, "What is the capital of France? Answer in one sentence.")
        bare = Ladder([bad], LadderConfig(guard=GUARD_PRESETS["off"])).generate(prompt, SamplingParams(max_tokens=16))
        assert "Paris" not in bare.text
        r = Ladder([bad, fp32]).generate(prompt, SamplingParams(max_tokens=16))
        assert [(h.check, h.step, h.layer) for h in r.hazards] == [("outlier", 0, 11)]
        assert set(r.token_rungs) == {"fp32"} and "Paris" in r.text
    finally:
        bad.close()


def test_glitch_token_embeddings_in_an_untied_gguf_copy(tmp_path):
    """Byte-fallback tokens with input embeddings x1000 (output untied, so logits are untouched):
    an emoji prompt becomes garbage bare; the per-layer outlier bounds see it at prefill and fp32
    answers. At x=1 the untied copy decodes exactly as the original."""
    from qladder.config import Settings
    from qladder.engines import load_engine
    from qladder.model import bundled_model_path, inspect_model
    from qladder.testing.gguf_patch import byte_fallback_tokens, glitch_gguf

    int4, fp32 = get_engine("int4"), get_engine("fp32")
    pieces = fp32.tokenizer.convert_ids_to_tokens(list(range(fp32.n_vocab)))
    glitch = set(byte_fallback_tokens(pieces))
    assert len(glitch) == 137 and int4.tokenize("\u00e9", False)[0] not in glitch
    assert int4.lone_byte_ids == glitch  # the set the remote guard flags a prompt by (LlamaVocabMixin)
    prompt = _chat(int4, "Describe \U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 and "
                         "\U0001f3f3\ufe0f\u200d\U0001f308 in one sentence.")
    assert glitch & set(prompt)
    params = SamplingParams(max_tokens=12)
    off = LadderConfig(guard=GUARD_PRESETS["off"])
    clean = Ladder([int4], off).generate(prompt, params)
    for x in (1.0, 1000.0):
        dst = tmp_path / f"glitch-{x:g}.gguf"
        change = glitch_gguf(bundled_model_path(), dst, x=x)
        assert change["tokens"] == 137
        engine = load_engine("int4", inspect_model(dst, tmp_path), Settings.from_env())
        try:
            bare = Ladder([engine], off).generate(prompt, params)
            if x == 1.0:
                assert bare.token_ids == clean.token_ids
                continue
            assert bare.token_ids != clean.token_ids
            r = Ladder([engine, fp32]).generate(prompt, params)
            assert [(h.check, h.step) for h in r.hazards] == [("outlier", 0)]
            assert set(r.token_rungs) == {"fp32"}
            assert Ladder([engine, fp32]).generate(_chat(engine, "Name three colors."), params).hazards == []
        finally:
            engine.close()
