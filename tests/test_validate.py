"""`qladder validate`: corpora, fault models, the garbage judge, the queueing model, statistics (pure,
exact), and bare vs guarded on the real model with a tiny subset."""

from __future__ import annotations

import json
import math

import pytest

from qladder.engines.scripted import ScriptedEngine
from qladder.errors import ConfigError
from qladder.faults import parse_fault
from qladder.validate import corpora, queueing
from qladder.validate.fault_models import FAULT_MODELS, assign, by_name
from qladder.validate.garbage import judge
from qladder.validate.replay import Outcome, agreement, greedy
from qladder.validate.stats import paired_ratio, percentile, rates

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


# -- garbage judge --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "ids", "truncated", "reasons"), [
    ("The capital of France is Paris.", [5, 6, 7, 8], False, ()),
    ("NaN NaN NaN", [9, 9, 9], False, ("nan_text",)),
    ("x = NaN, a float", [1, 2], False, ()),
    ("ok \ufffd ok", [1, 2, 3], False, ("replacement_char",)),
    ("emoji cut \ufffd", [1, 2, 3], True, ()),
    ("emoji cut \ufffd", [1, 2, 3], False, ("replacement_char",)),
    ("\u25a0\u25a0\u25a0 \u2588\u2588", [1, 2], False, ("black_squares",)),
    ("", [], False, ("empty",)),
    ("  \n", [3, 4], False, ("empty",)),
    ("hi", [4, 0, 0, 0, 5], False, ("token0_flood",)),
])
def test_judge_symptoms(text, ids, truncated, reasons):
    assert judge(text, ids, truncated).reasons == reasons


def test_judge_loops_by_rep4_and_compression_not_by_the_guards_rule():
    assert judge(",,,,,,,,,,,,", [11] * 12).reasons == ("loop",)  # a one-token flood
    assert judge("ab" * 6, [1, 2] * 6).rep4 > 0.6
    assert judge("short", [1, 2] * 5).reasons == ()  # 10 tokens: under LOOP_MIN_TOKENS
    assert judge("text", list(range(10)) * 2).reasons == ()  # a 10-token phrase said twice: rep-4 0.41
    loop = "a sanctuary of the soul, " * 12  # a long loop: repeated 4-grams and a text zlib shrinks 10x
    v = judge(loop, [5, 6, 7, 8, 9, 10] * 12)
    assert v.reasons == ("loop",) and v.zlib_ratio is not None and v.zlib_ratio > 4
    prose = ("The quick brown fox jumps over the lazy dog while the sun sets behind distant hills, "
             "and a cold wind carries the smell of rain across fields of wheat and barley.") * 2
    v = judge(prose, list(range(40)) * 2)  # repeated once: rep-4 0.49, under the bound
    assert v.reasons == () and v.rep4 < 0.6


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
    assert "token0_flood" in judge("x", nan).reasons
    looped = greedy(_scripted(loop=True), [1, 2, 3], 16)
    assert judge("bbbb", looped).reasons == ("loop",)
    faulted = greedy(_scripted(), [1, 2, 3], 6, [parse_fault("zero@step=2")])
    assert faulted[2:] == [0, 0, 0, 0]


def test_judge_implausible_by_reference_likelihood():
    assert "implausible" in judge(" the] is 3 the  the]", [1, 2, 3], nll=6.9).reasons
    assert judge("The capital of France is Paris.", [1, 2, 3], nll=0.4).reasons == ()
    assert judge("The capital of France is Paris.", [1, 2, 3]).reasons == ()  # not scored: symptoms only
    o = Outcome("bare", "p", "c", "abnormal", "corrupted_scale", "ok", text="x y z", token_ids=[5, 6, 7],
                finish_reason="length", nll=7.5)
    o.judge()
    assert o.garbage == ["implausible"] and o.is_garbage


def test_fp32_scores_its_own_greedy_answer_as_plausible_and_noise_as_not():
    from qladder.validate.garbage import IMPLAUSIBLE_NLL, mean_nll

    fp32 = get_engine("fp32")
    from qladder.model import inspect_model, user_prompt_ids

    ids = user_prompt_ids(inspect_model().chat_template, "What is the capital of France?", fp32.tokenize)
    answer = greedy(fp32, ids, 8)
    lp = fp32.score(ids, answer)
    assert len(lp) == len(answer) and all(x <= 0 for x in lp)
    assert mean_nll(lp) < 1.0
    noise = fp32.tokenize(" the] is 3 the  the] ,,; zebra", False)
    assert mean_nll(fp32.score(ids, noise)) > IMPLAUSIBLE_NLL
    assert fp32.score(ids, []) == []


def test_outcome_judgement_skips_errors_and_fallbacks():
    o = Outcome("bare", "p", "c", "abnormal", "nan", "error", text="")
    o.judge(False)
    assert o.garbage == [] and not o.is_garbage


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
        assert p["jobs"] == 5 and 0 <= lo <= hi and isinstance(p["confirmed"], bool)
    assert "error" in confirm(engine, [], (0.5,), servers=1, n_jobs=3, seed=0)


def test_simulation_matches_m_d_1():
    # M/D/1: Wq = rho * s / (2 (1 - rho)) = 0.5 at rho 0.5, s 1.
    assert queueing.simulate(1, 0.5, [1.0], n=100_000, seed=1) == pytest.approx(0.5, rel=0.05)


# -- statistics ---------------------------------------------------------------------------------------


def test_percentile_and_rates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0 and percentile([], 50) is None
    outs = [Outcome("bare", "a", "c", "abnormal", "none", "ok", text="fine", token_ids=[1, 2]),
            Outcome("bare", "b", "c", "abnormal", "nan", "ok", text="", garbage=["empty"]),
            Outcome("bare", "c", "c", "abnormal", "error", "error", error_kind="engine_error: x")]
    r = rates(outs)
    assert (r["garbage_rate"], r["error_rate"], r["reject_rate"]) == (1 / 3, 1 / 3, 0.0)
    assert r["error_kinds"] == {"engine_error": 1}


def test_paired_ratio_and_agreement():
    bare = [Outcome("bare", p, "qa", "normal", "none", "ok", token_ids=[1], wall_ms=w) for p, w in
            (("a", 100.0), ("b", 200.0))]
    guarded = [Outcome("guarded", p, "qa", "normal", "none", "ok", token_ids=[1], wall_ms=w) for p, w in
               (("a", 110.0), ("b", 220.0))]
    assert paired_ratio(bare, guarded)["paired_median"] == pytest.approx(1.1)
    # A noisy round on one prompt moves the pooled P99, not the P99 of the prompts' medians.
    for r, noise in ((1, 1.0), (2, 1.0), (3, 3.0)):
        bare += [Outcome("bare", p, "qa", "normal", "none", "ok", token_ids=[1], wall_ms=w, round=r)
                 for p, w in (("a", 100.0), ("b", 200.0 * noise))]
        guarded += [Outcome("guarded", p, "qa", "normal", "none", "ok", token_ids=[1], wall_ms=w, round=r)
                    for p, w in (("a", 101.0), ("b", 202.0))]
    pr = paired_ratio(bare, guarded)
    assert pr["p99_prompt_medians"] == pytest.approx(202.0 / 200.0) and pr["prompts"] == 2
    assert pr["p99"] < 0.5
    assert agreement([1, 2, 3], [1, 2, 4, 5]) == (0.5, 0.5)
    assert agreement([], []) == (1.0, 1.0)


# -- the real model: bare vs guarded on the same prompts ----------------------------------------------


@pytest.fixture(scope="module")
def configs():
    from qladder.config import Settings
    from qladder.model import inspect_model
    from qladder.validate.replay import serve

    se, bare, guarded = serve(inspect_model(), get_engine("fp32"), Settings.from_env(), None)
    yield bare, guarded
    se.close()


@pytest.mark.slow
def test_guarded_clean_and_bare_broken_under_faults(configs):
    from qladder.sampling import SamplingParams

    bare, guarded = configs
    params = SamplingParams(max_tokens=8)
    prompts = [*corpora.subset(corpora.normal_prompts(), {"qa": 1, "math": 1}),
               corpora.Prompt("bytes", "control_bytes", b"\x00\xff\xfeWhat is 2 + 2?")]
    for fault, spec in (("nan", "nan@step=2"), ("error", "error@step=2")):
        faults = [parse_fault(spec)]
        b = [bare.run(p, "abnormal", fault, faults, params) for p in prompts]
        g = [guarded.run(p, "abnormal", fault, faults, params) for p in prompts]
        assert all(o.status == "ok" and not o.garbage for o in g), [(o.status, o.garbage) for o in g]
        assert all(o.handoff_ms and "fp32" in o.token_rungs for o in g)
        if fault == "nan":
            assert all(o.status == "ok" and "token0_flood" in o.garbage for o in b)
        else:
            assert all(o.status == "error" and o.error_kind.startswith("engine_error") for o in b)
    clean = [guarded.run(p, "normal", "none", [], params) for p in prompts[:2]]
    assert all(not o.handoff_ms and set(o.token_rungs) == {"int4"} for o in clean)


@pytest.mark.slow
def test_bare_refuses_over_long(configs):
    from qladder.sampling import SamplingParams

    bare, _ = configs
    long = corpora.Prompt("long", "over_long", "word " * 3000)
    assert bare.run(long, "abnormal", "none", [], SamplingParams(max_tokens=2)).status == "rejected"


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


@pytest.mark.slow
def test_validate_end_to_end_writes_results_and_report(tmp_path):
    from qladder.validate.runner import ValidateConfig, validate

    cfg = ValidateConfig(quick=True, max_tokens=6, normal_per_class=1,
                         abnormal_per_class={"control_bytes": 1, "long_math": 1}, fault_names=("nan@step=1",),
                         prompts_per_fault=2, rounds=1, warmup=1, reference_prompts=2, sweep_xs=(1.0, 3.0),
                         sweep_prompts=1, sweep_tokens=2, level_prompts=1, level_rounds=1, level_tokens=3,
                         monitor_rounds=1, monitor_tokens=2, n_ctx=512, replay_jobs=3, replay_max_tokens=2)
    r = validate(cfg, tmp_path, show_progress=False)
    for name in ("results.json", "report.md", "report.html", "outcomes.jsonl", "incidents.sqlite3"):
        assert (tmp_path / name).is_file(), name
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["guarded"]["garbage_rate"] == 0.0 and on_disk["guarded"]["error_rate"] == 0.0
    assert r["bare"]["by_fault"]["custom:nan@step=1"]["garbage_rate"] == 1.0
    assert r["guarded"]["handoff"]["count"] >= 2
    assert r["precision_boundary"]["boundary"]["w4a16"]["first_nonfinite_x"] == 3.0
    assert set(r["environment"]["versions"]) >= {"torch", "transformers", "llama_cpp_python", "gguf"}
    assert r["garbage_judge"]["scored"] >= 2 and r["garbage_judge"]["clean_flagged"] == 0
    replayed = r["availability_boundary"]["concurrent_replay"]["points"]
    assert len(replayed) == 2 and all(p["jobs"] == 3 for p in replayed)
    html = (tmp_path / "report.html").read_text()
    assert "<table>" in html and html.count("data:image/png;base64") == 5


def test_rates_count_the_models_own_garbage_apart():
    from qladder.validate.replay import Outcome
    from qladder.validate.stats import rates

    own = Outcome("guarded", "p1", "emoji", "abnormal", "none", "ok", garbage=["loop"], model_own=True)
    ours = Outcome("guarded", "p2", "emoji", "abnormal", "nan_logits", "ok", garbage=["token0_flood"])
    clean = Outcome("guarded", "p3", "qa", "abnormal", "none", "ok")
    r = rates([own, ours, clean])
    assert r["garbage"] == 2 and r["garbage_model_own"] == 1 and abs(r["garbage_beyond_fp32_rate"] - 1 / 3) < 1e-9
