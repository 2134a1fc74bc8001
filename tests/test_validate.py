"""`qladder validate`: corpora, fault models, the garbage judge, the queueing model, statistics (pure,
exact), and bare vs guarded on the real model with a tiny subset."""

from __future__ import annotations

import json
import math

import pytest

from qladder.engines.scripted import ScriptedEngine
from qladder.errors import ConfigError
from qladder.testing.faults import parse_fault
from qladder.types import FALLBACK_TEXT
from qladder.validate import corpora, queueing
from qladder.validate.fault_models import FAULT_MODELS, assign, by_name
from qladder.validate.garbage import judge, periodic_tail, same_answer
from qladder.validate.outcome import Outcome
from qladder.validate.replay import greedy

from .conftest import get_engine

# -- corpora ------------------------------------------------------------------------------------------


def test_corpora_sizes_classes_and_determinism():
    normal, abnormal = corpora.normal_prompts(), corpora.abnormal_prompts()
    assert len(normal) >= 200 and len(abnormal) >= 100
    assert {p.cls for p in normal} == set(corpora.NORMAL_CLASSES)
    assert {p.cls for p in abnormal} == set(corpora.ABNORMAL_CLASSES)
    assert len({p.id for p in normal + abnormal}) == len(normal) + len(abnormal)
    assert corpora.normal_prompts() == normal and corpora.abnormal_prompts() == abnormal
    raw = [p.prompt for p in abnormal if p.cls == "control_bytes"]
    assert all(isinstance(b, bytes) for b in raw) and any(b"\x00\xff\xfe" in b for b in raw)


def test_committed_corpora_match_the_generator(tmp_path):
    normal, abnormal = corpora.write_corpora(tmp_path)
    for path in (normal, abnormal):
        committed = corpora.DEFAULT_DIR / path.name
        assert committed.read_bytes() == path.read_bytes(), "regenerate: python -m qladder.validate.corpora"


def test_jsonl_round_trip_keeps_bytes_and_surrogates(tmp_path):
    items = [corpora.Prompt("b", "control_bytes", b"\x00\xff\xfeHi"),
             corpora.Prompt("s", "unicode_zero_width_bidi_homoglyph", "a\ud800b\u202e")]
    corpora.write_jsonl(tmp_path / "x.jsonl", items)
    (tmp_path / "x.jsonl").read_text(encoding="utf-8")  # valid UTF-8 on disk
    assert corpora.read_jsonl(tmp_path / "x.jsonl") == items
    line = json.loads((tmp_path / "x.jsonl").read_text().splitlines()[0])
    assert set(line) == {"id", "class", "prompt", "bytes_b64"}


def test_subset_takes_the_first_items_of_each_class():
    ps = corpora.abnormal_prompts()
    sub = corpora.subset(ps, {"long_math": 2, "over_long": 1})
    assert [p.id for p in sub] == ["a-long_math-000", "a-over_long-000", "a-long_math-001"]


# -- fault models -------------------------------------------------------------------------------------


def test_fault_models_parse_and_document_themselves():
    for m in FAULT_MODELS:
        assert (m.faults or m.gguf_patch) and m.phenomenon and m.mechanism
    assert [m.name for m in by_name(["nan_logits", "error@step=1"])] == ["nan_logits", "custom:error@step=1"]
    with pytest.raises(ConfigError):
        by_name(["boom@step=1"])


def test_assign_round_robin_skips_indices():
    models = by_name(["nan_logits", "zero_logits"])
    pairs = assign(4, models, 3, skip=[1])
    assert [(a.prompt_index, a.model.name) for a in pairs] == [
        (0, "nan_logits"), (2, "nan_logits"), (3, "nan_logits"),
        (0, "zero_logits"), (2, "zero_logits"), (3, "zero_logits")]
    assert assign(2, models, 1, skip=[0, 1]) == []


def test_assign_restricted_model_alternates_its_classes():
    glitch = by_name(["glitch_tokens"])[0]
    classes = ["long_math", "emoji_zwj", "emoji_zwj", "control_bytes", "control_bytes", "over_long"]
    pairs = assign(len(classes), [glitch, *by_name(["nan_logits"])], 3, skip=[5], classes=classes)
    assert [(a.prompt_index, a.model.name) for a in pairs[:3]] == [
        (1, "glitch_tokens"), (3, "glitch_tokens"), (2, "glitch_tokens")]
    assert [a.prompt_index for a in pairs[3:]] == [0, 1, 2]  # unrestricted: round-robin as before


def test_train_and_test_halves_and_fault_sets_are_disjoint():
    from qladder.validate.fault_models import TEST_FAULT_MODELS

    normal, abnormal = corpora.load_corpora()
    for ps in (normal, abnormal):
        halves = {s: {p.id for p in ps if p.split == s} for s in ("train", "test")}
        assert not halves["train"] & halves["test"] and abs(len(halves["train"]) - len(halves["test"])) <= len(ps) // 10
    quick = corpora.subset(abnormal, 2)
    for cls in corpora.ABNORMAL_CLASSES:
        assert {p.split for p in quick if p.cls == cls} == {"train", "test"}
    assert {m.fault_set for m in FAULT_MODELS} == {"train"} and {m.fault_set for m in TEST_FAULT_MODELS} == {"test"}
    train_patches = {m.gguf_patch for m in FAULT_MODELS if m.gguf_patch}
    assert not train_patches & {m.gguf_patch for m in TEST_FAULT_MODELS if m.gguf_patch}
    assert not {m.specs for m in FAULT_MODELS if m.specs} & {m.specs for m in TEST_FAULT_MODELS if m.specs}
    assert by_name(["error@step=1"])[0].fault_set == "test"


def test_gguf_patches_change_exactly_the_chosen_scales(tmp_path, model_info):
    import numpy as np
    from gguf import GGUFReader

    from qladder.testing.gguf_patch import parse_index_list, patch_scales

    assert parse_index_list("0-3,7,10-11", 20, "rows") == [0, 1, 2, 3, 7, 10, 11]
    assert parse_index_list("all", 3, "rows") == [0, 1, 2]
    for bad in ("3-1", "x", "25"):
        with pytest.raises(ConfigError):
            parse_index_list(bad, 20, "rows")
    src, dst = model_info.path, tmp_path / "p.gguf"
    change = patch_scales(src, dst, "blk.5.ffn_down.weight", "0-3", "1,2", x=30.0)
    assert change["n_blocks"] == 8 and change["rows"] == "0-3" and change["blocks"] == "1-2"

    def scales(path):
        t = {x.name: x for x in GGUFReader(str(path)).tensors}["blk.5.ffn_down.weight"]
        return np.array(t.data).reshape(t.data.shape[0], -1, 20)[..., :2].copy().view(np.float16)[..., 0]

    a, b = scales(src).astype(np.float32), scales(dst).astype(np.float32)
    changed = np.argwhere(a != b)
    assert {tuple(x) for x in changed} == {(r, k) for r in range(4) for k in (1, 2)}
    assert np.allclose(b[:4, 1:3], a[:4, 1:3] * 30, rtol=1e-3)
    assert src.read_bytes()[:4096] == dst.read_bytes()[:4096]  # the header untouched
    with pytest.raises(ConfigError):
        patch_scales(src, dst, "blk.5.ffn_down.weight", "0", "0")  # neither a factor nor a value


def test_cli_patch_gguf_writes_a_copy_and_refuses_mistakes(tmp_path, model_info):
    from typer.testing import CliRunner

    from qladder.cli import app

    out = tmp_path / "inf.gguf"
    res = CliRunner().invoke(app, ["faults", "patch-gguf", str(model_info.path), str(out), "--tensor",
                                   "blk.17.ffn_up.weight", "--rows", "100-101", "--blocks", "2", "--set", "inf"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["n_blocks"] == 2 and out.stat().st_size == model_info.path.stat().st_size
    res = CliRunner().invoke(app, ["faults", "patch-gguf", str(model_info.path), str(out), "--tensor",
                                   "blk.17.ffn_up.weight", "--scale", "2", "--set", "inf"])
    assert res.exit_code == 2 and "exactly one" in res.output
    res = CliRunner().invoke(app, ["faults", "patch-gguf", str(model_info.path), str(out), "--tensor", "nope",
                                   "--scale", "2"])
    assert res.exit_code == 2 and "no tensor" in res.output


# -- garbage judge --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "ids", "prompt", "reasons"), [
    ("The capital of France is Paris.", [5, 6, 7, 8], "", ()),
    ("NaN NaN NaN", [9, 10, 9], "", ("nan_text",)),
    ("x = NaN, a float", [1, 2], "", ()),
    ("ok \ufffd ok", [1, 2, 3], "", ("replacement_char",)),
    ("emoji cut \ufffd", [1, 2, 3], "", ("replacement_char",)),  # a cut mid-character counts too
    ("echo \ufffd", [1, 2, 3], "the prompt had \ufffd", ()),
    ("a\x00\x01b", [1, 2], "", ("control_chars",)),
    ("a\x00b", [1, 2], "", ()),  # one control character is not a run
    ("tab\tnew\nline", [1, 2], "", ()),
    ("\u25a0\u25a0\u25a0 \u2588\u2588", [1, 2], "", ("black_squares",)),
    ("......", [30], "", ("char_flood",)),  # merged into one token, the text still shows it
    ("| a | b |\n|------|---|\n| 1 | 2 |", [1, 2, 3, 4, 5], "", ()),  # a markdown rule is not a flood
    ("ab", [7, 7, 7, 7, 7, 7], "", ("token_flood",)),
    ("ab", [7, 7, 7, 7, 7], "", ()),
    ("", [], "", ("empty",)),
    ("  \n", [3, 4], "", ("empty",)),
    ("hi", [4, 0, 0, 0, 5], "", ("token0_flood",)),
])
def test_judge_symptoms(text, ids, prompt, reasons):
    assert judge(text, ids, prompt).reasons == reasons


def test_numbers_rules_and_ellipses_are_not_floods_but_floods_are(model_info):
    from qladder.engines.llamacpp import LlamaVocab

    v = LlamaVocab(model_info)
    try:
        for text in ("The answer is 1000000.", "Wait... let me think.", "def f():\n    # ----------\n    return 0",
                     "Total: 0.0000001 m", "Hmm, ok."):
            assert judge(text, v.tokenize(text, False)).reasons == (), text
        for text in ("." * 32, "!!!!!!!", "((((((((((", "Yes" + "?" * 9):
            assert judge(text, v.tokenize(text, False)).garbage, text
    finally:
        v.close()


def test_the_inf_scale_answer_is_garbage_without_a_likelihood():
    """llama-server's real answer on an inf scale: token 30 ('.') x 32, every logprob null."""
    v = judge("." * 32, [30] * 32)
    assert {"token_flood", "char_flood"} <= set(v.reasons) and not v.scored


def test_repetition_is_measured_but_decides_nothing():
    """Full precision loops by itself (tests/test_judge.py): rep-4 and zlib are kept for reading."""
    loop = "a sanctuary of the soul, " * 12
    v = judge(loop, [5, 6, 7, 8, 9, 10] * 12)
    assert v.reasons == () and v.rep4 > 0.9 and v.zlib_ratio is not None and v.zlib_ratio > 4
    assert judge(loop, [5, 6, 7, 8, 9, 10] * 12, nll=2.2, threshold=1.1).reasons == ("implausible",)


def test_judge_likelihood_scored_failed_and_unjudged():
    assert "implausible" in judge(" the] is 3 the  the]", [1, 2, 3], nll=6.9).reasons
    ok = judge("The capital of France is Paris.", [1, 2, 3], nll=0.4)
    assert ok.reasons == () and ok.scored and not ok.unjudged
    failed = judge("The capital of France is Paris.", [1, 2, 3], score_failed=True)
    assert failed.unjudged and not failed.scored and not failed.garbage
    loud = judge("", [], score_failed=True)  # a symptom decides alone: garbage, not unjudged
    assert loud.garbage and not loud.unjudged


def test_periodic_tail_and_the_models_own_answer():
    assert periodic_tail([1, 2, 3, 4, 5, 6, 5, 6, 5, 6]) == (4, 2)
    assert periodic_tail([1, 2, 3, 4]) is None
    assert same_answer([1, 2, 3], [1, 2, 3]) and not same_answer([1, 2, 3], [1, 2, 4])
    # the same loop, out of phase by one token and starting within 4 tokens
    assert same_answer([9, 1, 2, 1, 2, 1, 2, 1, 2], [8, 8, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2])
    assert not same_answer([9, 1, 2, 1, 2, 1, 2, 1, 2], [8, 8, 1, 3, 1, 3, 1, 3, 1, 3])  # another loop
    far = [4] * 6 + [1, 2] * 4
    assert not same_answer([1, 2] * 5, far)  # the same loop, 6 tokens later


def _scripted(nan_from: int | None = None, loop: bool = False) -> ScriptedEngine:
    def fn(ids):
        step = len(ids) - 3
        if nan_from is not None and step >= nan_from:
            return [float("nan")] * 8
        row = [0.0] * 8
        row[1 if loop else 1 + step % 6] = 8.0
        return row

    return ScriptedEngine(fn, n_vocab=8, eos_id=7)


def test_judge_on_scripted_engine_output():
    """Naive greedy on a scripted engine: argmax of an all-NaN row is index 0, a token-0 flood."""
    clean = greedy(_scripted(), [1, 2, 3], 12)
    assert judge("abcdefg", clean).reasons == ()
    nan = greedy(_scripted(nan_from=3), [1, 2, 3], 12)
    assert nan[3:] == [0] * 9
    assert {"token_flood", "token0_flood"} <= set(judge("x", nan).reasons)
    looped = greedy(_scripted(loop=True), [1, 2, 3], 16)
    assert "token_flood" in judge("bbbb", looped).reasons
    faulted = greedy(_scripted(), [1, 2, 3], 6, [parse_fault("zero@step=2")])
    assert faulted[2:] == [0, 0, 0, 0]


def test_fp32_scores_its_own_greedy_answer_as_plausible_and_noise_as_not():
    from qladder.model import inspect_model, user_prompt_ids
    from qladder.validate.calibration import committed
    from qladder.validate.garbage import mean_nll

    fp32 = get_engine("fp32")
    ids = user_prompt_ids(inspect_model().chat_template, "What is the capital of France?", fp32.tokenize)
    answer = greedy(fp32, ids, 8)
    lp = fp32.score(ids, answer)
    assert len(lp) == len(answer) and all(x <= 0 for x in lp)
    assert mean_nll(lp) < 1.0
    noise = fp32.tokenize(" the] is 3 the  the] ,,; zebra", False)
    assert mean_nll(fp32.score(ids, noise)) > committed().threshold
    assert fp32.score(ids, []) == []


def test_outcome_columns_errors_fallbacks_and_unjudged():
    err = Outcome("t", "bare", "p", "c", "abnormal", status="error")
    err.judge()
    assert err.verdict == {} and err.five_xx and not err.answered_clean and not err.garbage
    fb = Outcome("t", "guarded", "p", "c", "abnormal", fallback=True, text=FALLBACK_TEXT)
    fb.judge()
    assert not fb.garbage and not fb.answered_clean  # its own column, never clean
    un = Outcome("t", "guarded", "p", "c", "abnormal", text="Fine.", token_ids=[1, 2])
    un.judge(None, score_failed=True)
    assert un.unjudged and not un.answered_clean and not un.garbage
    assert Outcome("t", "bare", "p", "c", "abnormal", status=503).five_xx
    assert Outcome("t", "bare", "p", "c", "abnormal", status=413).four_xx


# -- queueing model -----------------------------------------------------------------------------------


def test_erlang_c_exact_values():
    assert queueing.erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert queueing.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert queueing.erlang_c(3, 3.0) == 1.0 and queueing.erlang_c(3, 0.0) == 0.0
    assert queueing.mmc_wait(1, 0.5, 1.0) == pytest.approx(1.0)  # rho / (mu - lam)
    assert queueing.mmc_wait(2, 1.0, 1.0) == pytest.approx(1 / 3)
    assert math.isinf(queueing.mmc_wait(2, 2.0, 1.0))


def test_standby_model_saturation():
    m = queueing.StandbyModel(s_primary=0.1, s_standby=0.5, servers=10, standby_share=0.2, primary_util=0.7)
    assert (m.c_standby, m.c_primary) == (2, 8)
    assert m.arrival_rate == pytest.approx(56.0)
    assert m.saturation_share == pytest.approx(1 / 14)
    assert m.saturation_rate == pytest.approx(4.0)
    assert m.point(m.saturation_share / 2)["utilization"] == pytest.approx(0.5)
    share = m.share_at_wait(0.5)
    assert 0 < share < m.saturation_share
    wq = queueing.mmc_wait(2, share * m.arrival_rate, 0.5)
    assert wq == pytest.approx(0.5, rel=1e-6)


def test_fcfs_waits_exact():
    # one server: job 2 arrives at 1 while job 1 runs until 2; job 3 finds the server free
    assert queueing.fcfs_waits(1, [0.0, 1.0, 5.0], [2.0, 1.0, 1.0]) == [0.0, 1.0, 0.0]
    assert queueing.fcfs_waits(2, [0.0, 0.0, 0.0], [3.0, 1.0, 1.0]) == [0.0, 0.0, 1.0]


def test_finite_run_waits_start_empty_and_stay_under_the_steady_state():
    light = queueing.finite_run_waits(1, 0.01, [1.0], n=20, reps=200, seed=3)
    assert max(light) < 0.2
    short = queueing.finite_run_waits(1, 0.8, [1.0], n=10, reps=2000, seed=3)
    steady = queueing.simulate(1, 0.8, [1.0], n=100_000, seed=3)  # M/D/1: 0.8 / (2 * 0.2) = 2.0
    assert steady == pytest.approx(2.0, rel=0.1)
    assert 0 < sum(short) / len(short) < steady


def test_standby_replay_runs_every_job_fcfs_on_a_real_engine():
    from qladder.validate.standby_replay import Job, confirm, replay_point

    engine = ScriptedEngine(lambda ids: [float(len(ids) % 4 == i) for i in range(4)], n_vocab=4)
    done: list[int] = []
    jobs = [Job((1, 2, 3), 2) for _ in range(6)]
    r = replay_point(engine, jobs, lam=50.0, servers=1, seed=0,
                     work=lambda e, j: done.append(len(j.ids)))
    assert len(done) == 6
    assert all(a <= s <= e for a, s, e in zip(r["arrival"], r["start"], r["end"], strict=True))
    assert r["start"] == sorted(r["start"]) and r["arrival"] == sorted(r["arrival"])  # one server: FCFS
    out = confirm(engine, jobs, (0.3, 0.6), servers=1, n_jobs=5, seed=1)
    assert [p["target_utilization"] for p in out["points"]] == [0.3, 0.6]
    for p in out["points"]:
        lo, hi = p["model_band_95_ms"]
        assert p["jobs"] == 5 and 0 <= lo <= hi
        # The verdict is the stated rule on the figures it reports: the measured mean wait inside the band.
        assert p["confirmed"] is (lo <= p["wait_mean_ms"] <= hi)
        assert p["wait_max_ms"] >= p["wait_mean_ms"] >= 0 and p["service_mean_ms"] > 0
    assert "error" in confirm(engine, [], (0.5,), servers=1, n_jobs=3, seed=0)


def test_simulation_matches_m_d_1():
    # M/D/1: Wq = rho * s / (2 (1 - rho)) = 0.5 at rho 0.5, s 1.
    assert queueing.simulate(1, 0.5, [1.0], n=100_000, seed=1) == pytest.approx(0.5, rel=0.05)


# -- figures from outcomes (qladder.validate.recompute) ---------------------------------------------------


def _normal(config: str, prompt: int, rnd: int, ms: float, status: str = "ok") -> Outcome:
    o = Outcome("t", config, f"n-qa-{prompt:03d}", "qa", "normal", round=rnd, phase="normal",
                split=corpora.split_of(f"n-qa-{prompt:03d}"), status=status, latency_ms=ms,
                text="A fine answer.", token_ids=[5, 6, 7], rungs=["int4"] * 3)
    o.judge(0.5)
    return o


def _crafted(config: str, k: int, fault: str | None, *, text: str = "A fine answer.", ids: list[int] | None = None,
             fallback: bool = False, rungs: list[str] | None = None, cont: bool | None = None) -> Outcome:
    pid = f"a-long_math-{k:03d}"
    o = Outcome("t", config, pid, "long_math", "abnormal", fault=fault, phase="faulted" if fault else "abnormal",
                split=corpora.split_of(pid), fault_set=corpora.split_of(pid) if fault else None, text=text,
                token_ids=[5, 6, 7] if ids is None else ids, fallback=fallback, rungs=rungs or ["int4"] * 3,
                fp32_continuation_identical=cont, handoff_ms=[120.0] if rungs and "fp32" in rungs else [])
    o.judge(0.5 if text.strip() else None)
    return o


def _run(give_up: bool, prompts: int = 180, rounds: int = 3) -> list[Outcome]:
    """A run with >= 500 normal requests per side, and faulted requests on both halves: bare answers
    them with garbage, guarded hands them to fp32 (or, `give_up`, answers with the fallback)."""
    outs = [_normal(c, p, r, 100.0 + p % 7) for r in range(rounds) for p in range(prompts)
            for c in ("bare", "bare_aa", "guarded")]
    for k in range(8):
        outs += [_crafted("bare", k, None), _crafted("guarded", k, None)]
        outs.append(_crafted("bare", k, "nan_logits", text="", ids=[0] * 6))
        outs.append(_crafted("bare", k, "inf_logits"))  # greedy argmax survives an inf: bare answers fine
        for fault in ("nan_logits", "inf_logits"):
            if give_up:
                outs.append(_crafted("guarded", k, fault, text=FALLBACK_TEXT, ids=[], fallback=True, rungs=[]))
            else:
                outs.append(_crafted("guarded", k, fault, rungs=["int4", "fp32", "fp32"], cont=True))
    return outs


def test_a_guard_that_gives_up_fails_the_verdict_and_the_guard_that_does_not_passes():
    from qladder.validate.recompute import figures

    good = figures(_run(give_up=False), "in-process")
    assert good["verdict"] == "pass", [v for v in good["verdicts"] if v["status"] != "pass"]
    bad = figures(_run(give_up=True), "in-process")
    for split in ("train", "test"):
        b, g = bad["crafted"][split]["bare"], bad["crafted"][split]["guarded"]
        assert g["answered_clean_rate"] < b["answered_clean_rate"]
        assert g["garbage"] == 0 and g["fallback"] == 8
    failed = {v["name"] for v in bad["verdicts"] if v["status"] == "fail"}
    assert bad["verdict"] == "fail"
    assert {"train: guarded fallback answers", "test: answered clean, guarded minus bare",
            "train: greedy faulted answers token-identical to fp32's continuation"} <= failed


def test_a_failed_request_counts_as_the_slowest_latency_and_the_verdict_reads_an_interval():
    from qladder.validate.recompute import figures, latency_side

    outs = [_normal("bare", p, 0, 100.0) for p in range(10)] + [_normal("bare", 10, 0, 900.0)]
    failed = _normal("bare", 11, 0, 1.0, status="error")
    side = latency_side([*outs, failed], slowest=900.0)
    assert side["failed"] == 1 and side["p99_ms"] == pytest.approx(900.0)
    run = _run(give_up=False, prompts=20, rounds=3)
    f = figures(run, "in-process")
    lat = next(v for v in f["verdicts"] if v["name"].startswith("latency:"))
    assert lat["status"] == "pass" and lat["interval"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert f["latency"]["ratios"]["aa_over_bare"]["per_prompt_p99"] == pytest.approx(1.0)
    # every round of three guarded prompts fails: each counts as the run's slowest, never dropped
    for o in run:
        if o.config == "guarded" and o.phase == "normal" and o.prompt_id in ("n-qa-000", "n-qa-001", "n-qa-002"):
            o.status = "error"
    f = figures(run, "in-process")
    m = f["latency"]["ratios"]["guarded_over_bare"]["mean_ratio"]
    slowest = f["slowest_latency_ms"]
    assert m["value"] == pytest.approx((sum(100.0 + p % 7 for p in range(3, 20)) + 3 * slowest)
                                       / sum(100.0 + p % 7 for p in range(20)))
    lat = next(v for v in f["verdicts"] if v["name"].startswith("latency:"))
    assert lat["status"] in ("fail", "inconclusive") and f["verdict"] != "pass"


def test_an_aa_interval_that_excludes_1_makes_the_latency_verdict_inconclusive():
    from qladder.validate.recompute import figures

    run = _run(give_up=False, prompts=20, rounds=3)
    for o in run:
        if o.config == "bare_aa" and o.phase == "normal":
            o.latency_ms *= 1.05  # the two identical processes differ: the measurement itself is biased
    f = figures(run, "in-process")
    lat = next(v for v in f["verdicts"] if v["name"].startswith("latency:"))
    assert lat["status"] == "inconclusive" and "excludes 1" in lat["note"] and f["verdict"] == "inconclusive"


def test_garbage_is_shown_raw_and_net_of_fp32s_own_for_bare_and_guarded_alike():
    from qladder.validate.recompute import row

    own = [_crafted(c, 0, None, text="!" * 10, ids=[3] * 10) for c in ("bare", "guarded")]
    for o in own:
        o.fp32_identical = True
    ours = _crafted("bare", 2, "nan_logits", text="", ids=[0] * 6)
    r = row([own[0], ours])
    assert (r["garbage"], r["garbage_fp32_identical"], r["garbage_net"]) == (2, 1, 1)
    assert row([own[1]])["garbage_net"] == 0


def test_recompute_reproduces_the_stored_figures_and_finds_any_change(tmp_path, capsys):
    from qladder.validate import recompute
    from qladder.validate.runner import write_outputs

    write_outputs(tmp_path, _run(give_up=False, prompts=10, rounds=2), "in-process", {"kind": "in-process"})
    assert recompute.main([str(tmp_path)]) == 0 and recompute.main([str(tmp_path), "--check"]) == 0
    assert "reproduced exactly" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    res["figures"]["verdicts"][0]["status"] = "fail"  # a stored verdict is recomputed, not read
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert recompute.main([str(tmp_path)]) == 1 and "DIFFERS" in capsys.readouterr().out
    write_outputs(tmp_path, _run(give_up=True, prompts=10, rounds=2), "in-process", {"kind": "in-process"})
    assert recompute.main([str(tmp_path)]) == 1  # a FAIL exits 1, with or without --check
    write_outputs(tmp_path, _run(give_up=False, prompts=10, rounds=2), "in-process", {"kind": "in-process"})
    lines = (tmp_path / "outcomes.jsonl").read_text().splitlines()
    edited = json.loads(lines[3])
    edited["latency_ms"] += 1e-6
    (tmp_path / "outcomes.jsonl").write_text("\n".join([*lines[:3], json.dumps(edited), *lines[4:]]) + "\n")
    assert recompute.main([str(tmp_path)]) == 1
    assert "DIFFERS" in capsys.readouterr().out


# -- the real model: bare vs guarded on the same prompts ----------------------------------------------


@pytest.fixture(scope="module")
def configs():
    from qladder.config import Settings
    from qladder.model import inspect_model
    from qladder.validate.replay import serve_bare, serve_guarded

    info, settings = inspect_model(), Settings.from_env()
    bare, guarded = serve_bare(info, settings), serve_guarded(info, get_engine("fp32"), settings, None)
    yield bare, guarded
    bare.se.close()
    guarded.se.close()


def _one(cfg, p, fault=None, max_tokens=8):
    from qladder.sampling import SamplingParams

    o = Outcome("t", cfg.name, p.id, p.cls, "abnormal", fault=fault)
    ids = cfg.run(p, o, [parse_fault(fault)] if fault else [], SamplingParams(max_tokens=max_tokens))
    o.judge()
    return o, ids


@pytest.mark.slow
def test_guarded_clean_and_bare_broken_under_faults(configs):
    bare, guarded = configs
    prompts = [*corpora.subset(corpora.normal_prompts(), {"qa": 1, "math": 1}),
               corpora.Prompt("bytes", "control_bytes", b"\x00\xff\xfeWhat is 2 + 2?")]
    for spec in ("nan@step=2", "error@step=2"):
        b = [_one(bare, p, spec)[0] for p in prompts]
        g = [_one(guarded, p, spec)[0] for p in prompts]
        assert all(o.ok and o.answered_clean for o in g), [(o.status, o.verdict) for o in g]
        assert all(o.handoff_ms and o.rungs[:2] == ["int4", "int4"] and "fp32" in o.rungs for o in g)
        if spec.startswith("nan"):
            assert all(o.ok and "token0_flood" in o.reasons for o in b)
        else:
            assert all(o.status == "error" and o.error.startswith("engine_error") for o in b)
    clean = [_one(guarded, p)[0] for p in prompts[:2]]
    assert all(not o.handoff_ms and set(o.rungs) == {"int4"} for o in clean)


@pytest.mark.slow
def test_bare_sends_raw_bytes_as_their_tokens_and_guarded_sanitizes_them(configs):
    bare, guarded = configs
    p = corpora.Prompt("bytes", "control_bytes", b"\x00\xff\xfeWhat is 2 + 2?")
    o, ids = _one(bare, p)
    vocab = bare.se.int4
    assert vocab.detokenize_bytes(ids).count(b"\x00") == 1 and "\\xff" in o.prompt  # the byte itself
    g, gids = _one(guarded, p)
    assert b"\x00" not in vocab.detokenize_bytes(gids) and "\x00" not in g.prompt


@pytest.mark.slow
def test_bare_refuses_over_long(configs):
    bare, _ = configs
    o, _ = _one(bare, corpora.Prompt("long", "over_long", "word " * 3000), max_tokens=2)
    assert o.status == "rejected" and o.four_xx


def test_precision_trace_on_scripted_engine():
    from qladder.health.guard import GUARD_PRESETS, StepGuard
    from qladder.validate.boundaries import trace

    t = trace(_scripted(nan_from=2), [1, 2, 3], 5, [], StepGuard(GUARD_PRESETS["default"]))
    assert (t.first_nonfinite, t.detected, t.detected_check) == (2, 2, "nonfinite")
    assert t.tokens[2:] == [0, 0, 0]


# -- the whole run, in miniature ------------------------------------------------------------------------


def test_cli_rejects_a_malformed_fault_before_loading(tmp_path):
    from typer.testing import CliRunner

    from qladder.cli import app

    res = CliRunner().invoke(app, ["validate", "--quick", "--out", str(tmp_path), "--faults", "boom@x=1"])
    assert res.exit_code == 2 and "unknown fault" in res.output
    assert not (tmp_path / "results.json").exists()
    for mode in ([], ["--remote"]):  # a round count under 1 is refused as well, in either mode
        res = CliRunner().invoke(app, ["validate", "--quick", *mode, "--out", str(tmp_path), "--rounds", "0"])
        assert res.exit_code == 2 and "--rounds" in res.output, res.output
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_validate_end_to_end_writes_outcomes_results_and_report(tmp_path, capsys):
    from qladder.validate import recompute
    from qladder.validate.outcome import read_jsonl
    from qladder.validate.runner import ValidateConfig, validate

    cfg = ValidateConfig(quick=True, max_tokens=6, normal_per_class=1,
                         abnormal_per_class={"control_bytes": 2, "long_math": 2},
                         fault_names=("nan_logits", "zero_logits_prefill"), prompts_per_fault=1, rounds=1, warmup=1,
                         reference_prompts=2, sweep_xs=(1.0, 3.0), sweep_prompts=1, sweep_tokens=2, level_prompts=1,
                         level_rounds=1, level_tokens=3, monitor_rounds=1, monitor_tokens=2, n_ctx=512,
                         replay_jobs=3, replay_max_tokens=2, precision_per_class=1, precision_abnormal=1,
                         precision_known=2, precision_w4a16=1)
    r = validate(cfg, tmp_path, show_progress=False)
    for name in ("results.json", "boundaries.json", "report.md", "report.html", "outcomes.jsonl", "incidents.sqlite3"):
        assert (tmp_path / name).is_file(), name
    code = recompute.main([str(tmp_path)])  # a miniature run: its verdicts may not pass, its figures reproduce
    assert "reproduced exactly" in capsys.readouterr().out and code == recompute.exit_code(r["figures"]["verdict"])
    outs = read_jsonl(tmp_path / "outcomes.jsonl")
    assert {o.config for o in outs if o.phase != "precision"} == {"bare", "bare_aa", "guarded"}
    assert {o.phase for o in outs} == {"warmup", "normal", "abnormal", "faulted", "precision"}
    table = r["figures"]["precision"]
    assert set(table) == {"int4", "guarded", "w4a16", "verified", "fp32"}
    assert table["fp32"]["classes"]["all"]["reference"] is True  # the reference: never compared with itself
    assert all(o.fp32_reference_ids is not None for o in outs if o.phase == "precision" and o.config != "fp32" and o.ok)
    assert table["verified"]["classes"]["all"]["identical_share"] == 1.0  # verified decoding: fp32's answers
    assert table["verified"]["classes"]["all"]["answers"] == 7 and table["int4"]["classes"]["known"]["known_asked"] == 2
    assert all(m["tok_s"] and m["tok_s"] > 0 for m in table.values())
    assert table["w4a16"]["classes"]["all"]["answers"] == 1  # fp16 on a CPU: the first prompt only
    faulted = [o for o in outs if o.phase == "faulted"]
    assert {(o.fault, o.fault_set, o.split) for o in faulted} == {("nan_logits", "train", "train"),
                                                                   ("zero_logits_prefill", "test", "test")}
    f = r["figures"]
    for split in ("train", "test"):
        assert f["crafted"][split]["guarded"]["garbage_net"] == 0 and f["crafted"][split]["guarded"]["five_xx"] == 0
        assert f["crafted"][split]["bare"]["garbage"] >= 1
        assert f["quality"][split]["share"] == 1.0
    assert all(o.verdict.get("scored") for o in outs if o.phase not in ("warmup", "precision") and o.ok and o.token_ids)
    assert all(o.fp32_identical is not None and o.fp32_reference_ids is not None
               for o in outs if o.population == "abnormal" and o.ok)
    b = json.loads((tmp_path / "boundaries.json").read_text())
    assert b["precision"]["boundary"]["w4a16"]["first_nonfinite_x"] == 3.0
    assert len(b["availability"]["concurrent_replay"]["points"]) == 2
    assert set(r["environment"]["versions"]) >= {"torch", "transformers", "llama_cpp_python", "gguf"}
    html = (tmp_path / "report.html").read_text()
    assert "<table>" in html and html.count("data:image/png;base64") == 5 and "Verdict" in html
    assert "Precision boundary" in html


@pytest.mark.slow
def test_a_real_guard_with_no_rung_above_gives_up_and_the_table_says_so():
    """The guarded ladder with its standby taken away: every faulted request ends with the safe
    fallback. The table shows it answering clean less often than bare, and the verdicts fail."""
    from qladder.config import Settings
    from qladder.model import inspect_model
    from qladder.sampling import SamplingParams
    from qladder.service import Qladder
    from qladder.serving import ServingConfig, ServingEngine
    from qladder.validate.recompute import figures
    from qladder.validate.replay import Guarded, serve_bare

    info, settings = inspect_model(), Settings.from_env()
    bare = serve_bare(info, settings)
    se = ServingEngine(ServingConfig(slots=1, n_ctx=settings.n_ctx, standby_rungs=(), allow_faults=True), info,
                       settings)
    giving_up = Guarded(se, Qladder(engines=[se.int4], model=info, settings=settings))
    outs = []
    try:
        for p in corpora.subset(corpora.abnormal_prompts(), {"long_math": 2, "code_block": 2}):
            for fault in (None, "inf@step=2", "nan@step=2"):
                for cfg in (bare, giving_up):
                    o = Outcome("t", cfg.name, p.id, p.cls, "abnormal", fault=fault, split=p.split,
                                fault_set=p.split if fault else None, phase="faulted" if fault else "abnormal")
                    cfg.run(p, o, [parse_fault(fault)] if fault else [], SamplingParams(max_tokens=6))
                    o.judge()
                    outs.append(o)
    finally:
        bare.se.close()
        se.close()
    f = figures(outs, "in-process")
    for split in ("train", "test"):
        g, b = f["crafted"][split]["guarded"], f["crafted"][split]["bare"]
        assert g["fallback"] == 4 and g["garbage"] == 0  # no garbage: it gave up instead
        assert g["answered_clean_rate"] < b["answered_clean_rate"]
    failed = {v["name"] for v in f["verdicts"] if v["status"] == "fail"}
    assert {"train: guarded fallback answers", "test: answered clean, guarded minus bare"} <= failed
    assert f["verdict"] == "fail"


def test_precision_table_scores_known_answers_as_words_and_finds_the_first_divergence():
    from qladder.validate.precision_table import KNOWN, first_divergence, known_correct, known_prompts, table

    assert known_correct("known-000", "The capital of France is Paris.")
    assert not known_correct("known-000", "A Parisian café.") and not known_correct("known-000", "Lyon")
    assert known_correct("known-011", "12 * 7 = 84") and not known_correct("known-011", "12*7 = 841")
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([5], [5]) is None
    assert len(known_prompts()) == len(KNOWN) and known_prompts(3)[2].id == "known-002"
    outs = []
    for mode, ids in (("fp32", [1, 2, 3]), ("int4", [1, 9, 3])):
        o = Outcome("t", mode, "known-000", "known", "precision", phase="precision", token_ids=ids,
                    latency_ms=1000.0, text="Paris" if mode == "fp32" else "Lyon")
        o.fp32_reference_ids = None if mode == "fp32" else [1, 2, 3]  # the table recomputes from the ids
        o.fp32_top1_agreement, o.known_correct = 1.0 if mode == "fp32" else 2 / 3, mode == "fp32"
        outs.append(o)
    t = table(outs)
    assert t["fp32"]["classes"]["known"]["known_right"] == 1 and t["int4"]["classes"]["known"]["known_right"] == 0
    assert t["int4"]["classes"]["all"]["first_divergence_median"] == 1 and t["int4"]["tok_s"] == 3.0
    assert t["int4"]["classes"]["all"]["identical_to_fp32"] == 0 and t["int4"]["classes"]["all"]["compared"] == 1
    assert t["fp32"]["classes"]["all"] == {"answers": 1, "errors": 0, "known_right": 1, "known_asked": 1,
                                           "reference": True}  # fp32 is never compared with itself
