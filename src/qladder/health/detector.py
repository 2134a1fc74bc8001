"""Deciding that an endpoint is broken from its audited answers: a one-sided CUSUM (Page, 1954).

A corruption of a server's weights is persistent: every answer it writes carries it, so it need
not be caught in every answer, only found soon and for sure. Each audited answer gives one
score `x`, in nats, by its decoding mode (`Detector`, qladder.audit):

    greedy    fp32_gap: the mean over its INT4-written tokens of fp32's top logprob minus fp32's
              logprob of INT4's token. A clean greedy answer is fp32's argmax nearly everywhere
              (about 0); a broken one writes tokens fp32 would not (0.3-8 nats on the patched
              GGUFs, where the excess below stays near clean for attention-scale damage)
    sampled   excess: the mean of -log p(token) - H(p), p fp32's distribution there. A sampled
              token is judged by fp32's probability of it, not by argmax agreement: at or under
              0 on average for a clean rung, large for salad and tokens fp32 would not say

Each mode has its own test per endpoint (a greedy answer never moves the sampled test):

    S_0 = 0,  S_n = max(0, S_{n-1} + min(x_n - k, h / EVIDENCE)),  alarm when S_n >= h

`k` (the reference) is a clean answer's score that clean traffic exceeds rarely (a quantile of the
train half's clean scores of that mode): on clean traffic S drifts back to 0, and a broken
endpoint's answers, most of them over k, push it up by about their excess each, at most
h / EVIDENCE an answer, so no single answer alarms. `h` is set from a false-alarm rate chosen
before any data is seen, half of it each mode's: the smallest h for which clean traffic (the
train half's scores, drawn by a smoothed bootstrap so the tail past the largest score seen is
drawn too) raises an alarm within `horizon` audited answers with at most that probability.
`calibrate` does both; bench/calibrate_detector.py writes them, with every score they came
from, to detector_calibration.json.

While S_n > 0 the endpoint is `suspect`: its audit rate goes to every answer until the test
decides (back to 0: clean; over h: broken). An alarm ejects the endpoint; it returns after
`probes` audited probe answers in a row score under their mode's k (half-open, kept by its
watch: serving/endpoint_watch.py). Pure: no clock, no threads; the owner (one per gateway or
engine) holds the tests behind its own lock.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

# An audited answer with fewer scored tokens is not fed to the test: a mean over 1-7 tokens is too
# noisy to be evidence either way (a clean sampled 2-token answer can score +1.1), and a broken
# endpoint's salad runs long. Calibration keeps to the same answers.
MIN_TOKENS = 8
# No fewer audited answers than this can raise an alarm: each answer adds at most h / EVIDENCE to
# the statistic, so one odd answer (a clean one in a tail the calibration never saw, or one bad
# answer of a healthy server) is never enough, and a broken endpoint is out after EVIDENCE
# answers far over k.
EVIDENCE = 3


class State(enum.Enum):
    WATCHED = "watched"  # audited at the floor rate
    SUSPECT = "suspect"  # S > 0: every answer audited until the test decides
    EJECTED = "ejected"  # the test decided: broken; probe answers only
    PROBING = "probing"  # ejected, and probe answers are being audited


@dataclass(frozen=True)
class Thresholds:
    """A CUSUM's reference `k` and decision bound `h`, and what they were set from."""

    k: float
    h: float
    false_alarm: float  # the chance of an alarm on clean traffic within `horizon` audited answers
    horizon: int
    quantile: float  # k is this quantile of the clean scores
    clean_answers: int  # how many clean scores they were calibrated on
    probes: int = 3  # clean probe answers in a row that bring an ejected endpoint back
    bandwidth: float = 0.0  # the smoothed bootstrap's kernel (nats): clean scores resampled with this noise
    evidence: int = EVIDENCE  # no fewer answers than this can alarm: each adds at most h / evidence

    @property
    def cap(self) -> float:
        """The most one answer adds to the statistic (so one odd answer, clean or not, never alarms alone)."""
        return self.h / self.evidence

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def bandwidth(clean: Sequence[float] | np.ndarray) -> float:
    """Silverman's rule of thumb for a Gaussian kernel over the clean scores: the smoothed
    bootstrap then draws scores past the largest one seen (a few hundred answers do not show the
    tail a horizon of thousands meets)."""
    xs = np.asarray(clean, dtype=np.float64)
    iqr = float(np.subtract(*np.percentile(xs, [75, 25])))
    spread = min(float(xs.std(ddof=1)), iqr / 1.34) or float(xs.std(ddof=1))
    return float(0.9 * spread * len(xs) ** -0.2)


def false_alarm_rate(clean: Sequence[float] | np.ndarray, k: float, h: float, horizon: int, runs: int = 2000,
                     seed: int = 20261206, bw: float = 0.0, evidence: int = EVIDENCE) -> float:
    """The share of `runs` streams of `horizon` scores drawn from `clean` (with replacement, plus
    Gaussian noise of sd `bw`) in which the CUSUM, each step capped at h / evidence, reaches h:
    the chance of a false alarm within `horizon` clean answers."""
    rng = np.random.default_rng(seed)
    xs = np.asarray(clean, dtype=np.float64) - k
    cap = h / evidence
    s = np.zeros(runs)
    alarmed = np.zeros(runs, dtype=bool)
    for _ in range(horizon):
        x = xs[rng.integers(0, len(xs), runs)]
        if bw > 0:
            x = x + rng.normal(0.0, bw, runs)
        s = np.maximum(0.0, s + np.minimum(x, cap))
        alarmed |= s >= h
    return float(alarmed.mean())


def calibrate(clean: Sequence[float] | np.ndarray, false_alarm: float = 1e-3, horizon: int = 10_000,
              quantile: float = 0.95, runs: int = 2000, seed: int = 20261206, probes: int = 3,
              smooth: bool = True) -> Thresholds:
    """k and h from clean answers' scores (the train half's): k their `quantile`, h the smallest
    bound (by bisection, to 1%) whose false-alarm rate within `horizon`, over streams drawn by a
    smoothed bootstrap (Silverman's bandwidth; `smooth=False`: the plain one), is <= `false_alarm`.
    With `runs` streams a rate under 1 / runs cannot be seen: h is then set where none of them
    alarms, and the stated rate is that bound's (the resolution is said beside it)."""
    if len(clean) < 20:
        raise ValueError(f"calibrating a detector needs >= 20 clean scores, got {len(clean)}")
    if not 0.0 < false_alarm < 1.0 or horizon < 1:
        raise ValueError("false_alarm must be in (0, 1) and horizon >= 1")
    xs = np.asarray(clean, dtype=np.float64)
    k = float(np.quantile(xs, quantile))
    bw = bandwidth(xs) if smooth else 0.0

    def rate(h: float) -> float:
        return false_alarm_rate(xs, k, h, horizon, runs, seed, bw)

    lo, hi = 0.0, max(1e-3, float(np.sum(np.maximum(xs - k, 0.0))))
    while rate(hi) > false_alarm:
        lo, hi = hi, hi * 2.0
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2.0
        if rate(mid) > false_alarm:
            lo = mid
        else:
            hi = mid
    return Thresholds(k, hi, false_alarm, horizon, quantile, len(xs), probes, bw)


@dataclass
class Cusum:
    """One test (one endpoint, one decoding mode). `observe` an audited answer's score; read `state`
    (WATCHED, SUSPECT or EJECTED: what brings an ejected endpoint back is its watch's probes)."""

    t: Thresholds
    s: float = 0.0
    state: State = State.WATCHED
    answers: int = 0  # audited answers observed
    alarms: int = 0
    evidence: list[float] = field(default_factory=list)  # the scores since S last left 0 (an alarm's)

    def observe(self, x: float) -> State:
        """One audited answer's score (a NaN, an unscorable answer, counts as far over k: the
        evidence a broken endpoint gives; no answer adds more than `cap`). Returns the new state;
        an ejected test stays ejected until `reset`."""
        if math.isnan(x):
            x = self.t.k + self.t.cap
        self.answers += 1
        if self.state is State.EJECTED:
            return self.state
        self.s = max(0.0, self.s + min(x - self.t.k, self.t.cap))
        self.evidence = [*self.evidence, x] if self.s > 0 else []
        if self.s >= self.t.h:
            self.alarms += 1
            self.state = State.EJECTED
        else:
            self.state = State.SUSPECT if self.s > 0 else State.WATCHED
        return self.state

    def reset(self) -> None:
        """Back to 0 (its endpoint's probes brought it back), its counts kept."""
        self.s, self.evidence, self.state = 0.0, [], State.WATCHED

    def clean(self, x: float) -> bool:
        """Whether a score is a clean answer's (under k; a NaN is not): what a probe must show."""
        return not math.isnan(x) and x < self.t.k

    @property
    def audit_every_answer(self) -> bool:
        """Whether every answer of this endpoint should be audited (the test has not decided)."""
        return self.state is not State.WATCHED


@dataclass(frozen=True)
class Detector:
    """An endpoint's two tests: greedy answers scored by fp32's gap (qladder.audit: the mean of
    fp32's top logprob minus its logprob of INT4's token; about 0 for a clean greedy answer,
    which is fp32's argmax nearly everywhere), sampled answers by fp32's excess surprise (a
    sampled token is judged by fp32's probability of it: about or under 0 for a clean sampled
    answer). Each its own CUSUM, its thresholds calibrated on its mode's clean scores at half the
    false-alarm rate, so the endpoint's chance of a false alarm is at most their sum whatever the
    mix of greedy and sampled traffic."""

    greedy: Thresholds
    sampled: Thresholds

    def of(self, greedy: bool) -> Thresholds:
        return self.greedy if greedy else self.sampled

    @property
    def false_alarm(self) -> float:
        """The endpoint's false-alarm bound (the union of its two tests' within their horizons)."""
        return self.greedy.false_alarm + self.sampled.false_alarm

    @property
    def probes(self) -> int:
        return max(self.greedy.probes, self.sampled.probes)

    def to_dict(self) -> dict[str, dict[str, float | int]]:
        return {"greedy": self.greedy.to_dict(), "sampled": self.sampled.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Detector:
        def one(x: dict[str, Any]) -> Thresholds:
            return Thresholds(**{f.name: x[f.name] for f in fields(Thresholds) if f.name in x})
        return cls(one(d["greedy"]), one(d["sampled"]))


def answer_score(greedy: bool, fp32_gap: float | None, excess: float | None) -> float | None:
    """The score an audited answer gives its mode's test (None: unscorable)."""
    return fp32_gap if greedy else excess


CALIBRATION = Path(__file__).with_name("detector_calibration.json")


@functools.cache
def _calibration() -> dict[str, Any]:
    """detector_calibration.json, read once a process."""
    return dict(json.loads(CALIBRATION.read_text(encoding="utf-8")))


def committed() -> Detector:
    """The thresholds calibrated on the embedded model's train-half clean traffic
    (bench/calibrate_detector.py wrote detector_calibration.json beside this module)."""
    return Detector.from_dict(_calibration()["thresholds"])


def committed_drift_bound() -> float:
    """DriftWatch's bound calibrated beside the thresholds (qladder.audit.calibrate_drift_bound on
    the same clean greedy answers): a prompt class whose audited agreement falls under it is served
    verified."""
    return float(_calibration()["drift"]["bound"])
