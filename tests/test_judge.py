"""The calibrated judge on real answers: salads, loops and cut-short answers lifted from the committed
runs are garbage or stopped; the train half's normal answers and full precision's own answers are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qladder.validate import calibration
from qladder.validate.calibration import Calibration, calibrate, committed, quantile, rejudge
from qladder.validate.garbage import judge, same_answer
from qladder.validate.outcome import Outcome, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "judge"
FULL = ROOT / "bench" / "results" / "validate-full-2026-12-02"


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines() if line]


LIFTED = _lines("lifted.jsonl")
SALADS = [x for x in LIFTED if x["kind"] in ("salad", "loop")]
TRUNCATIONS = [x for x in LIFTED if x["kind"] == "truncation"]


@pytest.fixture(scope="module")
def full_run() -> list[Outcome]:
    return read_jsonl(FULL / "outcomes.jsonl")


def test_the_committed_calibration_is_what_its_run_gives(full_run):
    """Not hand-set: judge_calibration.json is calibrate() on the committed full run's train half."""
    again = calibrate(full_run, source=f"{FULL.name} (train half)")
    assert again == committed()
    assert committed().quantile == calibration.QUANTILE and committed().margin == calibration.MARGIN
    assert committed().threshold == pytest.approx(committed().quantile_nll + calibration.MARGIN)


def test_train_half_normal_answers_are_clean_and_the_test_half_judges_the_margin(full_run):
    rejudge(full_run)
    train = [o for o in full_run if o.phase == "normal" and o.split == "train"]
    test = [o for o in full_run if o.phase == "normal" and o.split == "test"]
    assert train and all(not o.garbage for o in train)
    assert sum(o.garbage for o in test) <= 0.01 * len(test)


@pytest.mark.parametrize("row", SALADS, ids=lambda r: f"{r['folder']}:{r['config']}:{r['prompt_id']}:{r['fault']}")
def test_lifted_salads_and_loops_are_garbage(row):
    v = judge(row["text"], row["token_ids"], row["prompt"], row["nll"], threshold=committed().threshold)
    assert v.garbage and "implausible" in v.reasons, (row["text"], row["nll"])


@pytest.mark.parametrize("row", LIFTED, ids=lambda r: f"{r['folder']}:{r['config']}:{r['prompt_id']}:{r['fault']}")
def test_lifted_rows_are_the_committed_runs_own(row):
    """Provenance: each fixture is a row of the committed folder it names, text and ids as written."""
    rows = read_jsonl(ROOT / "bench" / "results" / row["folder"] / "outcomes.jsonl")
    match = [o for o in rows if (o.config, o.prompt_id, o.fault, o.round, o.phase) ==
             (row["config"], row["prompt_id"], row["fault"], row["round"], row["phase"])]
    assert any(o.text == row["text"] and o.token_ids == row["token_ids"] for o in match)


@pytest.mark.parametrize("row", TRUNCATIONS, ids=lambda r: f"{r['folder']}:{r['prompt_id']}:{r['fault']}")
def test_answers_the_guard_cut_short_are_stopped_not_clean(row):
    o = Outcome("t", "guarded", row["prompt_id"], "x", "abnormal", text=row["text"], token_ids=row["token_ids"],
                finish_reason=row["finish_reason"], fp32_identical=True)
    o.judge()
    assert o.stopped and not o.answered_clean and o.bad
    assert o.identical is False  # a prefix of fp32's answer is not fp32's answer
    o.fp32_reference_ids = [*row["token_ids"], *row["token_ids"]]  # the reference went on
    assert o.stopped and o.identical is False
    o.fp32_reference_ids = list(row["token_ids"])  # the guard gave the whole reference
    assert not o.stopped and o.identical is True


def test_full_precisions_own_answers_are_never_garbage():
    """fp32 alone, greedy, 128 tokens, on plain requests (poems, songs, lists: bench/fp32_own_answers.py)
    and normal prompts: a loop it writes itself ('A winter's night, a winter's night, ...') is its own."""
    rows = _lines("fp32_own.jsonl")
    assert len(rows) >= 60
    loops = [r for r in rows if judge(r["text"], r["token_ids"]).rep4 >= 0.6]
    assert loops, "the fixture holds full precision's own loops"
    for r in rows:
        v = judge(r["text"], r["token_ids"], r["prompt"], r["nll"], threshold=committed().threshold)
        assert not v.garbage, (r["prompt_id"], v.reasons, r["text"][:80])


def test_same_answer_takes_no_prefix_for_a_guard_ended_answer():
    assert not same_answer([1, 2], [1, 2, 3, 4], finish="repetition")
    assert not same_answer([1, 2], [1, 2, 3, 4], finish="degraded")
    assert same_answer([1, 2, 3, 4], [1, 2, 3, 4], finish="repetition")
    assert same_answer([1, 2, 3], [1, 2, 3, 4], finish="length")  # a cut inside a character


def test_calibration_rule():
    assert quantile([3.0, 1.0, 2.0], 1.0) == 3.0 and quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    outs = [Outcome("t", "bare", f"n-{i}", "chat", "normal", phase="normal", split="train", text="a",
                    token_ids=[i], fp32_nll=0.01 * i) for i in range(calibration.MIN_ANSWERS)]
    cal = calibrate(outs)
    assert isinstance(cal, Calibration) and cal.answers == calibration.MIN_ANSWERS
    assert cal.threshold == pytest.approx(0.01 * (calibration.MIN_ANSWERS - 1) + calibration.MARGIN)
    # rounds that repeat an answer count it once; the test half and other phases never calibrate
    more = [*outs, Outcome("t", "bare", "n-0", "chat", "normal", phase="normal", split="train", text="a",
                           token_ids=[0], fp32_nll=9.0),
            Outcome("t", "bare", "n-x", "chat", "normal", phase="normal", split="test", text="a",
                    token_ids=[1], fp32_nll=9.0)]
    assert calibrate(more) == cal
    assert calibrate(outs[:-1]) is None  # too few: the committed calibration judges
    assert calibration.for_run(outs[:-1]) == committed()


@pytest.mark.parametrize("folder", ["validate-full-2026-12-02", "bench-verified-2026-12-03", "bench-fleet-2026-12-05",
                                    "bench-verified-2026-12-06", "bench-fleet-2026-12-06",
                                    "bench-serve-2026-12-06-box"])
def test_recompute_reproduces_committed_runs_without_torch_and_exits_on_their_verdict(folder):
    """Each committed run recomputes exactly at HEAD; a FAIL exits 1, an INCONCLUSIVE 3; no torch is loaded."""
    import subprocess
    import sys

    code = ("import sys\nfrom qladder.validate import recompute\nrc = recompute.main([sys.argv[1]])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\nsys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench" / "results" / folder)], capture_output=True,
                         text=True, timeout=600)
    stored = json.loads((ROOT / "bench" / "results" / folder / "results.json").read_text())["figures"]["verdict"]
    assert "reproduced exactly" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.returncode == {"pass": 0, "fail": 1, "inconclusive": 3}[stored]


@pytest.mark.parametrize(("script", "folder"), [("detection.py", "detection-2026-12-06"),
                                               ("detection_c8.py", "detection-c8-2026-12-07"),
                                               ("detection_c8.py", "detection-c8-2026-12-07b"),
                                               ("detection_c8.py", "detection-c8-2026-12-07c"),
                                               ("false_alarms.py", "false-alarms-2026-12-07")])
def test_the_committed_detection_runs_recompute_and_exit_on_their_verdicts(script, folder):
    """bench/detection*.py --recompute: the figures again from outcomes.jsonl, exit 1 on a FAIL."""
    import subprocess
    import sys

    path = ROOT / "bench" / "results" / folder
    stored = json.loads((path / "results.json").read_text())["figures"]["verdict"]
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--recompute", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT / "bench")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"reproduced": True, "verdict": stored}, res.stderr[-2000:]
    assert res.returncode == (0 if stored == "PASS" else 1)
