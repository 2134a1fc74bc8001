"""Deciding that an endpoint is broken from its audited answers: a one-sided CUSUM (Page, 1954).

A corruption of a server's weights is persistent: every answer it writes carries it, so it need
not be caught in every answer, only found soon and for sure. Each audited answer gives one
score `x` (qladder.audit: the mean over its INT4-written tokens of full precision's excess
surprise, `-log p(token) - H(p)`, in nats; at or under 0 on average for clean answers, greedy or
sampled, since a clean rung writes tokens full precision finds likely; large for salad, loops of
what fp32 would not say, plausible wrong tokens). Per endpoint:

    S_0 = 0,  S_n = max(0, S_{n-1} + x_n - k),  alarm when S_n >= h

`k` (the reference) is a clean answer's score that clean traffic exceeds rarely (a quantile of the
train half's clean scores): on clean traffic S drifts back to 0, and a broken endpoint's answers,
most of them over k, push it up by about their excess each. `h` is set from a false-alarm rate
chosen before any data is seen: the smallest h for which clean traffic (the train half's scores,
resampled) raises an alarm within `horizon` audited answers with at most that probability.
`calibrate` does both; the numbers go into the result folder beside the run they judge.

While S_n > 0 the endpoint is `suspect`: its audit rate goes to every answer until the test
decides (back to 0: clean; over h: broken). An alarm ejects it; it returns after `probes`
audited probe answers in a row score under k (half-open). Pure: no clock, no threads; the
owner (one per gateway or engine) holds one `Cusum` per endpoint behind its own lock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


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

    def to_dict(self) -> dict[str, float | int]:
        return {"k": self.k, "h": self.h, "false_alarm": self.false_alarm, "horizon": self.horizon,
                "quantile": self.quantile, "clean_answers": self.clean_answers, "probes": self.probes}


def false_alarm_rate(clean: Sequence[float], k: float, h: float, horizon: int, runs: int = 2000,
                     seed: int = 20261206) -> float:
    """The share of `runs` streams of `horizon` scores drawn from `clean` (with replacement) in
    which the CUSUM reaches h: the chance of a false alarm within `horizon` clean answers."""
    rng = np.random.default_rng(seed)
    xs = np.asarray(clean, dtype=np.float64) - k
    s = np.zeros(runs)
    alarmed = np.zeros(runs, dtype=bool)
    for _ in range(horizon):
        s = np.maximum(0.0, s + xs[rng.integers(0, len(xs), runs)])
        alarmed |= s >= h
    return float(alarmed.mean())


def calibrate(clean: Sequence[float], false_alarm: float = 1e-3, horizon: int = 10_000, quantile: float = 0.95,
              runs: int = 2000, seed: int = 20261206, probes: int = 3) -> Thresholds:
    """k and h from clean answers' scores (the train half's): k their `quantile`, h the smallest
    bound (by bisection, to 1%) whose resampled false-alarm rate within `horizon` is <= `false_alarm`.
    With `runs` streams a rate under 1 / runs cannot be seen: h is then set where none of them
    alarms, and the stated rate is that bound's (the resolution is said beside it)."""
    if len(clean) < 20:
        raise ValueError(f"calibrating a detector needs >= 20 clean scores, got {len(clean)}")
    if not 0.0 < false_alarm < 1.0 or horizon < 1:
        raise ValueError("false_alarm must be in (0, 1) and horizon >= 1")
    xs = np.asarray(clean, dtype=np.float64)
    k = float(np.quantile(xs, quantile))
    lo, hi = 0.0, max(1e-6, float(np.sum(np.maximum(xs - k, 0.0))))
    while false_alarm_rate(xs, k, hi, horizon, runs, seed) > false_alarm:
        lo, hi = hi, hi * 2.0
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2.0
        if false_alarm_rate(xs, k, mid, horizon, runs, seed) > false_alarm:
            lo = mid
        else:
            hi = mid
    return Thresholds(k, hi, false_alarm, horizon, quantile, len(xs), probes)


@dataclass
class Cusum:
    """One endpoint's test. `observe` an audited answer's score; read `state`."""

    t: Thresholds
    s: float = 0.0
    state: State = State.WATCHED
    answers: int = 0  # audited answers observed
    alarms: int = 0
    clean_probes: int = 0
    evidence: list[float] = field(default_factory=list)  # the scores since S last left 0 (an alarm's)

    def observe(self, x: float) -> State:
        """One audited answer's score (a NaN, an unscorable answer, counts as far over k: the
        evidence a broken endpoint gives). Returns the new state."""
        if math.isnan(x):
            x = self.t.k + self.t.h
        self.answers += 1
        if self.state in (State.EJECTED, State.PROBING):
            self.clean_probes = self.clean_probes + 1 if x < self.t.k else 0
            self.state = State.PROBING
            if self.clean_probes >= self.t.probes:
                self.s, self.clean_probes, self.evidence, self.state = 0.0, 0, [], State.WATCHED
            return self.state
        self.s = max(0.0, self.s + x - self.t.k)
        self.evidence = [*self.evidence, x] if self.s > 0 else []
        if self.s >= self.t.h:
            self.alarms += 1
            self.state, self.clean_probes = State.EJECTED, 0
        else:
            self.state = State.SUSPECT if self.s > 0 else State.WATCHED
        return self.state

    @property
    def audit_every_answer(self) -> bool:
        """Whether every answer of this endpoint should be audited (suspect, or probing back)."""
        return self.state is not State.WATCHED
