"""`qladder sweep` (validate/sweep.py) and its figures (validate/sweep_figures.py): a small real sweep
over two levels, every figure recomputed from its outcomes; the recommendation's rule on outcomes
made to fall on each side of the bound."""

from __future__ import annotations

import json

import pytest

from qladder.validate.outcome import Outcome
from qladder.validate.sweep_figures import GROUPS, figures, main, recommendation


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    from qladder.validate.sweep import SweepConfig, sweep

    out = tmp_path_factory.mktemp("sweep")
    cfg = SweepConfig.quick_preset(levels=("Q4_1", "Q8_0"), abnormal_per_half={"control_bytes": 1},
                                   max_tokens=8, throughput_tokens=8, threads=1)
    return out, sweep(cfg, out, show_progress=False)


def test_a_sweep_writes_outcomes_that_give_its_figures_again(small_sweep):
    out, results = small_sweep
    assert {p.name for p in out.iterdir()} >= {"outcomes.jsonl", "levels.json", "results.json", "report.md"}
    assert main([str(out)]) == 0  # the figures recompute from outcomes.jsonl
    levels = results["levels"]
    assert levels["Q8_0"]["bits_per_weight"] > levels["Q4_1"]["bits_per_weight"] > 4.0
    q = results["figures"]["quality"]
    for level in ("Q4_1", "Q8_0"):
        normal = q[level]["normal"]
        assert normal["train"]["bare_answers"] == 4 and normal["test"]["bare_answers"] == 4  # a prompt a class and half
        assert normal["all"]["guarded_answers"] == 8
        assert 0.0 <= normal["all"]["top1_agreement"]["value"] <= 1.0
        assert q[level]["raw_bytes"]["all"]["bare_answers"] == 2
        for c in ("c1", "c8"):
            t = results["figures"]["throughput"][level][c]
            assert t["windows"] == 1 and t["errors"] == 0 and t["tokens_per_s"] > 0
    rec = results["figures"]["recommendation"]
    assert rec["bounds_from"].startswith("Q8_0") and set(rec["verdicts"]) == {"Q4_1", "Q8_0"}
    assert {v for per in rec["verdicts"].values() for v in per.values()} <= {"within", "outside", "inconclusive",
                                                                              "no data"}
    lines = (out / "outcomes.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert {r["config"] for r in rows} == {"bare", "guarded", "throughput"}
    assert all(r["level"] in ("Q4_1", "Q8_0") for r in rows)
    bare = [r for r in rows if r["config"] == "bare"]
    assert all(r["fp32_reference_ids"] is not None and r["verdict"] for r in bare)
    assert "Recommendation" in (out / "report.md").read_text()


def test_a_changed_outcome_is_found_by_the_recompute(small_sweep, tmp_path):
    out, _ = small_sweep
    for name in ("levels.json", "results.json"):
        (tmp_path / name).write_text((out / name).read_text())
    rows = [json.loads(x) for x in (out / "outcomes.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["config"] == "bare")
    first["fp32_top1_agreement"] = 0.0 if first["fp32_top1_agreement"] != 0.0 else 1.0
    (tmp_path / "outcomes.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main([str(tmp_path)]) == 1


def _answers(level: str, split: str, agreement: float, garbage: int, n: int = 20) -> list[Outcome]:
    out = []
    for g, classes in GROUPS.items():
        for i in range(n):
            o = Outcome("sweep", "bare", f"{g}-{split}-{i}", classes[0], "normal", phase="sweep", split=split,
                        level=level, token_ids=[1, 2, 3], text="fine words", fp32_reference_ids=[1, 2, 3])
            o.fp32_top1_agreement = agreement if i % 2 else min(1.0, agreement + 0.02)
            o.verdict = {"garbage": i < garbage}
            out.append(o)
    return out


def test_the_recommendation_is_the_fewest_bits_within_the_bound_on_every_class():
    levels = {"Q2_K": {"bits_per_weight": 4.5}, "Q4_0": {"bits_per_weight": 5.3}, "Q8_0": {"bits_per_weight": 8.5}}
    cfg = {"levels": list(levels), "reference_level": "Q8_0", "min_agreement": None, "max_garbage": None}
    outs = [*_answers("Q8_0", "train", 0.95, 0), *_answers("Q8_0", "test", 0.96, 0),
            *_answers("Q4_0", "train", 0.96, 0), *_answers("Q4_0", "test", 0.97, 0),
            *_answers("Q2_K", "train", 0.60, 9), *_answers("Q2_K", "test", 0.60, 9)]
    f = figures(outs, levels, cfg)
    rec = f["recommendation"]
    assert rec["verdicts"]["Q2_K"] == dict.fromkeys(GROUPS, "outside")
    assert rec["verdicts"]["Q4_0"] == dict.fromkeys(GROUPS, "within")
    assert rec["level"] == "Q4_0" and rec["bits_per_weight"] == 5.3
    # the bound is Q8_0's train-half interval: its agreement's low end, its garbage's high end
    b = rec["bounds"]["normal"]
    q8 = f["quality"]["Q8_0"]["normal"]["train"]
    assert b["min_agreement"] == q8["top1_agreement"]["low"] and b["max_garbage"] == q8["bare_garbage"]["high"]
    # a bound the user sets replaces it: nothing reaches an agreement of 0.99
    strict = recommendation(f["quality"], levels, {**cfg, "min_agreement": 0.99})
    assert strict["level"] is None and strict["bounds_from"] == "set by the user"
