"""The endpoint detector (health/detector.py): a one-sided CUSUM whose bounds come from a
false-alarm rate chosen up front and clean scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qladder.health.detector import Cusum, State, Thresholds, calibrate, false_alarm_rate

CLEAN = np.random.default_rng(7).normal(-0.4, 0.25, 400).tolist()  # a clean rung's per-answer scores


def test_calibrated_bounds_hold_their_false_alarm_rate_on_fresh_resamples_and_are_the_smallest_that_do():
    t = calibrate(CLEAN, false_alarm=0.01, horizon=2000, runs=1000)
    assert t.k == pytest.approx(float(np.quantile(CLEAN, 0.95)))
    assert t.clean_answers == 400 and t.false_alarm == 0.01 and t.horizon == 2000
    # other streams than the calibration's (another seed): the rate holds, within resampling noise
    assert false_alarm_rate(CLEAN, t.k, t.h, 2000, runs=1000, seed=1) <= 0.03
    # and it is tight: a bound 10% lower alarms more often than the target on the calibration's streams
    assert false_alarm_rate(CLEAN, t.k, 0.9 * t.h, 2000, runs=1000) > 0.01
    with pytest.raises(ValueError, match=">= 20 clean scores"):
        calibrate(CLEAN[:5])


def test_a_broken_endpoint_alarms_after_about_h_over_its_excess_and_clean_traffic_does_not():
    t = Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100)
    clean = Cusum(t)
    for x in CLEAN:
        assert clean.observe(x - float(np.quantile(CLEAN, 0.95))) is not State.EJECTED
    assert clean.alarms == 0
    broken = Cusum(t)
    states = [broken.observe(1.1) for _ in range(3)]  # 1.1 over k each: S = 1.1, 2.2, 3.3
    assert states == [State.SUSPECT, State.SUSPECT, State.EJECTED] and broken.alarms == 1
    assert broken.evidence == [1.1, 1.1, 1.1]
    assert Cusum(t).observe(math.nan) is State.EJECTED  # an answer that could not be scored is evidence


def test_a_suspect_endpoint_is_audited_whole_until_the_test_decides_and_returns_after_clean_probes():
    t = Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100, probes=3)
    c = Cusum(t)
    assert not c.audit_every_answer
    c.observe(1.0)
    assert c.state is State.SUSPECT and c.audit_every_answer
    c.observe(-2.0)  # back to 0: clean
    assert c.state is State.WATCHED and c.s == 0.0 and not c.evidence
    assert [c.observe(2.0), c.observe(2.0)] == [State.SUSPECT, State.EJECTED]  # S = 2, then 4 >= 3
    assert c.audit_every_answer and c.evidence == [2.0, 2.0]
    for x, want in ((-1.0, State.PROBING), (-1.0, State.PROBING), (0.5, State.PROBING),  # a bad probe resets
                    (-1.0, State.PROBING), (-1.0, State.PROBING), (-1.0, State.WATCHED)):
        assert c.observe(x) is want
    assert c.s == 0.0 and c.alarms == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-5, max_value=5, allow_nan=False), max_size=60),
       st.floats(min_value=-1, max_value=1), st.floats(min_value=0.1, max_value=10))
def test_the_statistic_never_goes_negative_and_the_state_says_where_it_is(xs, k, h):
    c = Cusum(Thresholds(k=k, h=h, false_alarm=0.01, horizon=100, quantile=0.9, clean_answers=100))
    for x in xs:
        was_out = c.state in (State.EJECTED, State.PROBING)
        state = c.observe(x)
        assert c.s >= 0.0
        if not was_out:
            assert state is (State.EJECTED if c.s >= h else State.SUSPECT if c.s > 0 else State.WATCHED)
