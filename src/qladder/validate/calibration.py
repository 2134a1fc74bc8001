"""The judge's implausibility threshold, derived from a run's own normal answers: never hand-set.

    python -m qladder.validate.calibration DIR            print the calibration DIR's outcomes give
    python -m qladder.validate.calibration DIR --commit   ... and write it as the committed one

The rule (fixed here, before any run): take the train half's normal answers that were scored (phase
"normal", split "train", every configuration, one per distinct prompt and answer: rounds that repeat
an answer count it once), read the QUANTILE of their fp32 mean negative log-likelihoods, and add
MARGIN nats. QUANTILE 1.0 is the largest: every train-half normal answer is clean by construction, and
the test half's normal answers judge the margin (`judge.normal_test_over_threshold` in a run's figures:
a normal test answer over it is a false garbage call, counted).

MARGIN was chosen once, with the committed full run's scores of both halves in view (train largest
0.987, test largest 1.122 nats/token, salads 1.7-4): it is a decision, written here, not a fit, and
every run reports how its test half fares against it.

A run with fewer than MIN_ANSWERS such answers (a quick run, a load benchmark, which score few or no
normal answers) is judged with the committed calibration (judge_calibration.json, the committed full
run's), and says so (`source`).

`rejudge` is the one place verdicts are set from raw scores: the harness calls it after scoring, and
`recompute` calls it again on what it reads, so a verdict stored in outcomes.jsonl is never believed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from qladder.validate.judge_calibration import COMMITTED, Calibration, committed
from qladder.validate.outcome import Outcome, read_jsonl

__all__ = ["COMMITTED", "Calibration", "calibrate", "committed", "for_run", "rejudge"]

QUANTILE = 1.0
MARGIN = 0.15  # nats per token
MIN_ANSWERS = 50


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by the nearest rank (q = 1.0: the largest), so the threshold is a score seen."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def training_scores(outcomes: Sequence[Outcome]) -> list[float]:
    """The scores of the distinct scored normal answers of the train half."""
    seen: dict[tuple[str, tuple[int, ...]], float] = {}
    for o in outcomes:
        s = o.score
        if o.phase == "normal" and o.split == "train" and o.ok and not o.fallback and s is not None:
            seen.setdefault((o.prompt_id, tuple(o.token_ids)), s)
    return list(seen.values())


def calibrate(outcomes: Sequence[Outcome], source: str = "this run") -> Calibration | None:
    """The calibration these outcomes give (None: fewer than MIN_ANSWERS scored train-half answers)."""
    scores = training_scores(outcomes)
    if len(scores) < MIN_ANSWERS:
        return None
    q = quantile(scores, QUANTILE)
    return Calibration(q + MARGIN, QUANTILE, MARGIN, len(scores), q, source)


def for_run(outcomes: Sequence[Outcome]) -> Calibration:
    return calibrate(outcomes) or committed()


def rejudge(outcomes: Sequence[Outcome]) -> Calibration:
    """Every outcome's verdict set again from its raw text, ids, prompt and score, with the run's
    calibration (returned)."""
    cal = for_run(outcomes)
    for o in outcomes:
        o.judge(o.score, o.score_failed, cal.threshold)
    return cal


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qladder.validate.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run's folder (outcomes.jsonl)")
    ap.add_argument("--commit", action="store_true", help=f"write it to {COMMITTED.name}")
    a = ap.parse_args(argv)
    cal = calibrate(read_jsonl(a.dir / "outcomes.jsonl"), source=f"{a.dir.name} (train half)")
    if cal is None:
        print(f"fewer than {MIN_ANSWERS} scored train-half normal answers in {a.dir}", file=sys.stderr)
        return 1
    print(json.dumps(cal.to_dict(), indent=2))
    if a.commit:
        COMMITTED.write_text(json.dumps(cal.to_dict(), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
