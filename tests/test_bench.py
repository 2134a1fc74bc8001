"""The load benchmarks' figures (from their outcomes), their checkers (exit 1 on a miss), and a
tiny real `bench serving` run whose results recompute from its outcomes.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qladder.validate.outcome import Outcome, read_jsonl, write_jsonl
from qladder.validate.recompute import EXIT_INCONCLUSIVE, figures

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _req(config: str, c: int, r: int, k: int, start: float, end: float, tokens: int, *, fault: str | None = None,
         phase: str = "all", rungs: list[str] | None = None, handoff: bool = False) -> Outcome:
    o = Outcome("bench-serving", config, f"n-qa-{k:03d}", "qa", "normal", fault=fault, round=r, phase=phase,
                concurrency=c, window=f"{phase}/{config}/c{c}/r{r}", start_s=start, end_s=end,
                latency_ms=(end - start) * 1e3, ttft_ms=10.0, step_ms=[5.0] * (tokens - 1),
                token_ids=list(range(100, 100 + tokens)), text="A fine answer, word after word.",
                rungs=rungs or ["int4"] * tokens, finish_reason="length", handoff_ms=[50.0] if handoff else [])
    o.judge()
    return o


def _serving(rate8: dict[str, float], rounds: int = 6) -> list[Outcome]:
    """Each window: 4 requests of 10 tokens over 2 s at c1, over 2 / rate8[config] * ... at c8."""
    outs = []
    for r in range(rounds):
        for config in ("guarded", "bare", "raw", "guarded_faulted"):
            for c, span in ((1, 2.0), (8, 40 / rate8[config])):
                for k in range(4):
                    fault = "nan@step=3" if config == "guarded_faulted" and k == 0 else None
                    rungs = ["int4"] * 3 + ["fp32"] * 7 if fault else None
                    outs.append(_req(config, c, r, k, 0.0 if k == 0 else span / 2, span, 10, fault=fault,
                                     rungs=rungs, handoff=fault is not None))
    return outs


def test_serving_figures_are_tokens_over_each_windows_span():
    f = figures(_serving({"guarded": 30.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}), "bench-serving")
    g = f["results"]["all"]["guarded"]
    assert g["1"]["tok_s"] == pytest.approx(20.0) and g["8"]["tok_s"] == pytest.approx(30.0)
    assert g["8"]["tok_s_rounds"] == pytest.approx([30.0] * 6) and g["8"]["rounds"] == 6
    assert f["ratios"]["all"]["guarded_c8_over_c1"]["value"] == pytest.approx(1.5)
    assert f["ratios"]["all"]["guarded_over_raw_c8"]["value"] == pytest.approx(30 / 31)
    assert f["results"]["all"]["guarded_faulted"]["8"]["faulted_answered_via_standby"] == 6  # one a round
    assert f["verdict"] == "pass", f["verdicts"]
    slow = figures(_serving({"guarded": 25.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}), "bench-serving")
    assert slow["verdict"] == "fail"


def _folder(tmp_path: Path, outs: list[Outcome], mode: str, obs: dict | None = None, name: str = "run") -> Path:
    """A run's folder as the benchmarks write it: outcomes.jsonl, then results.json from what it reads."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    write_jsonl(d / "outcomes.jsonl", outs)
    res = {"figures": figures(read_jsonl(d / "outcomes.jsonl"), mode, obs), **({"observations": obs} if obs else {})}
    (d / "results.json").write_text(json.dumps(res))
    return d


def _check(script: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / script), str(path)], capture_output=True, text=True,
                          timeout=120)


def test_check_serving_exits_1_on_a_miss_3_when_inconclusive_and_refuses_what_it_cannot_recompute(tmp_path):
    good = _folder(tmp_path, _serving({"guarded": 30.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}),
                   "bench-serving", name="good")
    bad = _folder(tmp_path, _serving({"guarded": 25.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}),
                  "bench-serving", name="bad")
    short = _folder(tmp_path, _serving({"guarded": 30.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}, 2),
                    "bench-serving", name="short")  # 2 windows a side: under MIN_WINDOWS
    assert _check("check_serving.py", good).returncode == 0
    res = _check("check_serving.py", bad)
    assert res.returncode == 1 and "FAIL" in res.stdout and "guarded_over_raw_c8" in res.stdout
    res = _check("check_serving.py", short)
    assert res.returncode == EXIT_INCONCLUSIVE and "INCONCLUSIVE" in res.stdout
    js = tmp_path / "r.json"
    js.write_text((good / "results.json").read_text())
    assert _check("check_serving.py", js).returncode == 1  # verdicts without their outcomes: not checked
    assert _check("check_serve.py", good).returncode == 1  # another benchmark's run


def test_a_forged_verdict_or_figure_fails_the_checker(tmp_path):
    """The checker never reads a stored verdict: it recomputes, and a stored figure that differs fails."""
    bad = _folder(tmp_path, _serving({"guarded": 25.0, "bare": 31.0, "raw": 31.0, "guarded_faulted": 29.0}),
                  "bench-serving")
    res = json.loads((bad / "results.json").read_text())
    for v in res["figures"]["verdicts"]:
        v["status"] = "pass"
    res["figures"]["verdict"] = "pass"
    (bad / "results.json").write_text(json.dumps(res))
    assert _check("check_serving.py", bad).returncode == 1
    outs = read_jsonl(bad / "outcomes.jsonl")  # forged the other way: a verdict stored in the outcomes
    for o in outs:
        o.verdict = {**o.verdict, "garbage": False, "reasons": []}
    assert figures(outs, "bench-serving")["verdict"] == "fail"


def _serve_outcomes(guarded_ms: float, faulted_clean: bool) -> list[Outcome]:
    outs = []
    for k in range(20):
        o = Outcome("bench-serve", "guarded", f"n-qa-{k:03d}", "normal", "normal", phase="faulted",
                    fault="nan@step=2" if k < 2 else None, text="Fine." if faulted_clean or k >= 2 else "",
                    token_ids=[5, 6] if faulted_clean or k >= 2 else [], latency_ms=100.0,
                    hazards=["nonfinite"] if k < 2 else [], handoff_ms=[40.0] if k < 2 else [])
        o.judge(0.3 if o.token_ids else None)
        outs.append(o)
    for k in range(10):
        o = Outcome("bench-serve", "guarded", f"burst-{k}", "normal", "normal", phase="burst", fault="nan@step=1",
                    text="Fine.", token_ids=[5, 6], latency_ms=100.0, hazards=["nonfinite"], handoff_ms=[40.0])
        o.judge()
        outs.append(o)
    for r in range(6):
        for config, ms in (("guarded", guarded_ms), ("bare", 100.0), ("llama_server", 100.0),
                           ("llama_server_aa", 100.0)):
            for k in range(110):
                o = Outcome("bench-serve", config, f"n-qa-{k % 40:03d}", "normal", "normal", phase="compare",
                            round=r, window=f"compare/{config}/r{r}", start_s=float(k % 16), end_s=60.0,
                            latency_ms=ms, text="Fine.", token_ids=[5] * 60)
                o.judge()
                outs.append(o)
    return outs


OBS = {"faulted": {"incident_rows": 2}, "burst": {"timeline": [[0.0, "closed"], [20.0, "open"], [40.0, "half_open"],
                                                               [45.0, "closed"]]}}


def test_serve_figures_and_check_serve(tmp_path):
    good = figures(_serve_outcomes(104.0, True), "bench-serve", OBS)
    assert good["verdict"] == "pass", [v for v in good["verdicts"] if v["status"] != "pass"]
    assert good["latency_ratios"]["guarded_over_llama_server"]["pooled_p99"] == pytest.approx(1.04)
    assert good["latency_ratios"]["guarded_over_llama_server"]["mean_ratio"]["value"] == pytest.approx(1.04)
    assert good["latency_ratios"]["guarded_over_llama_server"]["requests_per_side"] == 660
    assert _check("check_serve.py", _folder(tmp_path, _serve_outcomes(104.0, True), "bench-serve", OBS)).returncode == 0
    for i, (outs, obs) in enumerate(((_serve_outcomes(130.0, True), OBS),  # latency over 1.1x
                                     (_serve_outcomes(104.0, False), OBS),  # faulted answers empty
                                     (_serve_outcomes(104.0, True), {**OBS, "faulted": {"incident_rows": 1}}))):
        assert figures(outs, "bench-serve", obs)["verdict"] == "fail"
        assert _check("check_serve.py", _folder(tmp_path, outs, "bench-serve", obs, name=f"bad{i}")).returncode == 1


@pytest.mark.slow
def test_a_tiny_serving_run_recomputes_from_its_outcomes(tmp_path, capsys):
    from qladder.benchmarks.serving import run_serving_bench
    from qladder.validate import recompute
    from qladder.validate.outcome import read_jsonl

    r = run_serving_bench(n_prompts=3, max_tokens=6, concurrency=(1, 8), rounds=1, fault_share=0.34, out_dir=tmp_path)
    # every figure reproduces; one round is one window a side, too few for a throughput verdict: exit 3, never 0
    assert recompute.main([str(tmp_path)]) == recompute.EXIT_INCONCLUSIVE
    assert "every figure reproduced exactly" in capsys.readouterr().out
    assert r["figures"]["verdict"] == "inconclusive"
    outs = read_jsonl(tmp_path / "outcomes.jsonl")
    windows = {o.window for o in outs if o.phase != "warmup"}
    assert len(windows) == 2 * 2 * 4  # 2 prompt sets x 2 levels x 4 configurations, one round
    assert {o.config for o in outs} == {"guarded", "bare", "raw", "guarded_faulted"}
    assert r["figures"]["results"]["all"]["guarded_faulted"]["8"]["faulted"] == 1
    assert all(len(o.token_ids) == 6 for o in outs if o.config in ("bare", "raw") and o.phase != "warmup")


def _verified_outcomes(verified_s: float, exact: bool, sampled_shift: bool, audit_s: float = 0.404) -> list[Outcome]:
    """fp32 alone: 10 tokens a request, 2 s a window at c1 and 0.5 s at c8; verified: `verified_s`;
    vLLM: 1 s at c8; INT4 0.4 s at c8, with the audit `audit_s`."""
    outs = [Outcome("bench-verified", "fp32-naive", f"n-qa-{k:03d}", "qa", "normal", phase="reference",
                    window="reference", token_ids=list(range(100, 110))) for k in range(4)]
    spans = {"fp32": {1: 2.0, 8: 0.5}, "verified": {1: verified_s, 8: verified_s / 3}, "vllm-fp32": {1: 2.0, 8: 1.0},
             "int4": {1: 1.0, 8: 0.4}, "int4-audit": {1: 1.0, 8: audit_s}}
    steps = {"fp32": [20.0] * 9, "int4": [2.0] * 9}  # c = 0.1: one draft step over one verify pass
    for r in range(6):
        for config, by_c in spans.items():
            for c, span in by_c.items():
                for k in range(4):
                    ids = list(range(100, 110)) if exact or k else [*range(100, 109), 7]
                    o = Outcome("bench-verified", config, f"n-qa-{k:03d}", "qa", "normal", round=r, phase="greedy",
                                concurrency=c, window=f"{config}/c{c}/r{r}", start_s=0.0, end_s=span,
                                latency_ms=span * 1e3, token_ids=ids, step_ms=steps.get(config, []))
                    if config == "verified":
                        o.verify_windows, o.verify_drafts, o.verify_kept = 2, 12, 9
                    outs.append(o)
    for config in ("verified", "fp32"):
        for s in range(200):
            tok = (s % 4) if config == "fp32" or not sampled_shift else (s % 2)
            outs.append(Outcome("bench-verified", config, "sampled-000", "chat", "normal", phase="sampled",
                                concurrency=8, window=f"sampled/{config}", token_ids=[tok, 5, s % 3]))
    return outs


def test_verified_figures_and_check_verified(tmp_path):
    good = figures(_verified_outcomes(0.5, True, False), "bench-verified")
    assert good["ratios"]["verified_over_fp32_c1"]["value"] == pytest.approx(4.0)
    assert good["ratios"]["verified_over_vllm_fp32_c8"]["value"] == pytest.approx(6.0)
    assert good["ratios"]["fp32_c8_over_c1"]["value"] == pytest.approx(4.0)
    b = good["bound"]  # alpha 9/12, k 12/2, c 2/20
    assert (b["alpha"], b["k"], b["c"]) == (pytest.approx(0.75), pytest.approx(6.0), pytest.approx(0.1))
    assert b["bound"] == pytest.approx((1 - 0.75 ** 7) / (0.25 * 1.6))
    assert good["verdicts"][0]["limit"] == pytest.approx(0.8 * b["bound"])
    assert good["exactness"]["share"] == 1.0 and good["acceptance"]["qa"]["acceptance"] == pytest.approx(0.75)
    assert good["acceptance"]["qa"]["tokens_per_window"] == pytest.approx(5.5)
    assert all(v["p"] > 0.5 for v in good["sampled"].values())
    assert good["verdict"] == "pass", [v for v in good["verdicts"] if v["status"] != "pass"]
    assert _check("check_verified.py", _folder(tmp_path, _verified_outcomes(0.5, True, False), "bench-verified",
                                               name="good")).returncode == 0
    for i, outs in enumerate((_verified_outcomes(1.5, True, False),  # 1.33x fp32 at c1: under 0.8 of the bound
                              _verified_outcomes(0.5, False, False),  # one answer differs
                              _verified_outcomes(0.5, True, True),  # another distribution
                              _verified_outcomes(0.5, True, False, audit_s=0.44))):  # the audit costs 9%
        assert figures(outs, "bench-verified")["verdict"] == "fail"
        res = _check("check_verified.py", _folder(tmp_path, outs, "bench-verified", name=f"bad{i}"))
        assert res.returncode == 1 and "FAIL" in res.stdout
