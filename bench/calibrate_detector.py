"""Calibrate the endpoint detector (health/detector.py) on the train half's clean traffic.

Every normal and abnormal train prompt (rendered as qladder serve renders it: sanitized, the chat
template) is answered by the embedded INT4 rung through the serving engine, greedy and sampled
(temperature 0.8, seed = the prompt's index), ANSWER tokens at most, with every answer audited
(audit_rate 1: fp32's batched rung scores each one teacher-forced when the standby is idle). Each
audited answer's score is, greedy, its mean fp32 gap (fp32's top logprob minus its logprob of
INT4's token) and, sampled, its mean excess surprise (-log p_fp32(token) - H(p_fp32)): qladder.audit.
Each mode's k and h come from that mode's scores of answers of >= MIN_TOKENS tokens (shorter ones
carry too little evidence; the endpoint watch does not feed them to its test either) and a
false-alarm rate fixed here, before any is seen: FALSE_ALARM = 1e-3 within HORIZON = 10,000
audited answers per endpoint, half of it each mode's test, k the clean scores' 0.95 quantile, h
by a smoothed bootstrap (health/detector.py). Beside, for reading (never tuned on): the train corruptions'
answers (bench/train_populations.py: the x1000 corrupted scale, the glitch-token copy), how many
were scored (the step guard hands most of them off first) and how many the test needs to alarm.
From the same clean greedy answers, DriftWatch's bound (`[server] verify_below` unset): the
lowest class's 0.001 quantile of the agreement of 20 answers (qladder.audit.calibrate_drift_bound).

Writes OUT (default src/qladder/health/detector_calibration.json): the thresholds, every answer's
score (prompt id, class, mode, tokens, excess, fp32 gap), the environment. Usage:
    python bench/calibrate_detector.py [OUT] [--answer N] [--stride S]     (48 tokens, every prompt;
                                                                            15 minutes on 2 cores)
    python bench/calibrate_detector.py --rejudge      (the thresholds again from OUT's saved answers)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from qladder.audit import calibrate_drift_bound
from qladder.benchmarks.common import AuditLog, closed_loop
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.environment import snapshot
from qladder.health.detector import MIN_TOKENS, Cusum, Detector, State, answer_score, calibrate
from qladder.model import inspect_model
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.validate.corpora import Prompt
from train_populations import populations, train_prompts

FALSE_ALARM, HORIZON, QUANTILE = 1e-3, 10_000, 0.95
OUT = Path(__file__).resolve().parents[1] / "src/qladder/health/detector_calibration.json"
SAMPLED_T = 0.8
SCORE = ("greedy answers: mean fp32 gap (fp32's top logprob - its logprob of INT4's token); sampled: mean "
         "excess surprise of fp32 at INT4's tokens (qladder.audit.score: fp32_gap, excess)")
COMMAND = "python bench/calibrate_detector.py  (--rejudge: the thresholds again from the saved answers)"


def answer_all(se: ServingEngine, prompts: list[Prompt], ids: dict[str, list[int] | None], answer: int,
               population: str) -> list[dict[str, Any]]:
    """Every prompt greedy and sampled through `se` (8 at a time), every answer audited; the scores."""
    audits = AuditLog(se)
    jobs = [(p, mode, k) for k, p in enumerate(prompts) if ids.get(p.id) for mode in ("greedy", "sampled")]
    meta: dict[str, tuple[Prompt, str]] = {}
    lock = threading.Lock()

    def run(job: tuple[Prompt, str, int]) -> None:
        p, mode, k = job
        params = SamplingParams(max_tokens=answer) if mode == "greedy" else \
            SamplingParams(max_tokens=answer, temperature=SAMPLED_T, seed=k)
        req = se.request(ids[p.id] or [], params, prompt_text=str(p.prompt), prompt_class=p.cls)
        with lock:
            meta[req.request_id] = (p, mode)
        se.generate_sync(req)

    closed_loop(8, jobs, run)
    audits.drain(900, poll_s=0.5)  # the standby audits when idle
    out = []
    for rid, (p, mode) in meta.items():
        r = audits.get(rid)
        out.append({"population": population, "prompt_id": p.id, "class": p.cls, "split": p.split, "mode": mode,
                    "tokens": r.tokens if r else 0, "excess": r.excess if r else None,
                    "fp32_gap": r.fp32_gap if r else None,
                    "agreement": r.agreement if r else None})
    return out


def alarm_after(scores: list[float], test: Cusum) -> int | None:
    """How many of `scores`, in order, the test needs to alarm (None: it does not)."""
    for n, x in enumerate(scores, 1):
        if test.observe(x) is State.EJECTED:
            return n
    return None


def _score(r: dict[str, Any]) -> float | None:
    """A saved answer's score for its mode's test (health/detector.py: greedy fp32_gap, sampled excess)."""
    return answer_score(r["mode"] == "greedy", r.get("fp32_gap"), r["excess"])


def thresholds_from(rows: list[dict[str, Any]]) -> tuple[Detector, dict[str, Any]]:
    """Each mode's thresholds from the clean populations' scored answers of that mode and >= MIN_TOKENS
    tokens (the ones the endpoint watch feeds its test), each at half of FALSE_ALARM (the endpoint's
    chance of a false alarm is at most their sum), and, for reading, what the tests make of the others."""
    def clean(mode: str) -> list[float]:
        return [x for r in rows if r["population"].startswith("clean") and r["mode"] == mode
                and r["tokens"] >= MIN_TOKENS and (x := _score(r)) is not None]
    d = Detector(*(calibrate(clean(mode), FALSE_ALARM / 2, HORIZON, QUANTILE) for mode in ("greedy", "sampled")))
    broken: dict[str, Any] = {}
    for pop in sorted({r["population"] for r in rows if not r["population"].startswith("clean")}):
        mine = [r for r in rows if r["population"] == pop]
        for mode in ("greedy", "sampled"):
            t = d.of(mode == "greedy")
            xs = [x for r in mine if r["mode"] == mode and r["tokens"] >= MIN_TOKENS and (x := _score(r)) is not None]
            broken.setdefault(pop, {})[mode] = {
                "answers": sum(r["mode"] == mode for r in mine), "scored": len(xs), "over_k": sum(x > t.k for x in xs),
                "alarm_after": alarm_after(xs, Cusum(t)),
                "why_unscored": "handed off by the step guard before INT4 wrote MIN_TOKENS tokens "
                                "(the audit scores INT4-only answers)"}
    return d, broken


def drift_from(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """DriftWatch's bound (qladder.audit.calibrate_drift_bound) from the clean greedy answers of
    >= MIN_TOKENS tokens by prompt class: the normal corpus's classes as they are, every abnormal
    one as "abnormal" (the class the gateway gives a prompt the input defence changed)."""
    by: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["population"].startswith("clean") and r["mode"] == "greedy" and r["agreement"] is not None \
                and r["tokens"] >= MIN_TOKENS:
            cls = r["class"] if r["class"] in ("chat", "qa", "code", "math") else "abnormal"
            by.setdefault(cls, []).append((r["tokens"], r["agreement"]))
    return calibrate_drift_bound(by, min_answers=20, false_verify=FALSE_ALARM)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", type=Path, default=OUT)
    ap.add_argument("--answer", type=int, default=48)
    ap.add_argument("--stride", type=int, default=1, help="every S-th train prompt (1: all)")
    ap.add_argument("--rejudge", action="store_true", help="recompute the thresholds from OUT's saved answers "
                    "(no engines run)")
    a = ap.parse_args()
    if a.rejudge:
        out = json.loads(a.out.read_text(encoding="utf-8"))
        t, broken = thresholds_from(out["answers"])
        out.update(thresholds=t.to_dict(), train_corruptions_for_reading=broken, min_tokens=MIN_TOKENS,
                   clean_answers=t.greedy.clean_answers + t.sampled.clean_answers, command=COMMAND,
                   drift=drift_from(out["answers"]), score=SCORE)
        a.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({k: v for k, v in out.items() if k not in ("answers", "environment")}, indent=2))
        return 0
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    t0 = time.perf_counter()
    normal, abnormal, ids = train_prompts(info, a.answer)
    fp32 = load_engine("fp32", info, settings)  # the clean full-precision rung audits every population
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for name, gguf, prompts in populations(info, Path(d), normal, abnormal, a.stride):
            cfg = ServingConfig(slots=8, n_ctx=2048, int4_threads=settings.n_threads,
                                standby_threads=settings.n_threads, audit_rate=1.0, audit_queue=4096)
            se = ServingEngine(cfg, dataclasses.replace(info, path=gguf.resolve()), settings, standby_engines=[fp32])
            try:
                rows += answer_all(se, prompts, ids, a.answer, name.removesuffix("_greedy"))
            finally:
                se.close()
            print(f"{name}: {len(prompts)} prompts, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t, broken = thresholds_from(rows)
    out = {"what": "endpoint detector thresholds (health/detector.py) from the train half's clean audited answers",
           "command": COMMAND,
           "thresholds": t.to_dict(), "min_tokens": MIN_TOKENS, "drift": drift_from(rows),
           "score": SCORE,
           "answer_tokens": a.answer, "sampled_temperature": SAMPLED_T, "stride": a.stride,
           "clean_answers": t.greedy.clean_answers + t.sampled.clean_answers,
           "unscored": sum(r["excess"] is None for r in rows),
           "train_corruptions_for_reading": broken, "environment": snapshot(settings.n_threads, 2048),
           "wall_s": round(time.perf_counter() - t0, 1), "answers": rows}
    fp32.close()
    a.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in out.items() if k != "answers"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
