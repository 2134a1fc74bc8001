"""The endpoint detector (health/detector.py): a one-sided CUSUM whose bounds come from a
false-alarm rate chosen up front and clean scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qladder.audit import AuditRecord
from qladder.health.detector import MIN_TOKENS, Cusum, State, Thresholds, bandwidth, calibrate, false_alarm_rate
from qladder.serving.endpoint_watch import Alarm, EndpointWatch

CLEAN = np.random.default_rng(7).normal(-0.4, 0.25, 400).tolist()  # a clean rung's per-answer scores


def test_calibrated_bounds_hold_their_false_alarm_rate_on_fresh_resamples_and_are_the_smallest_that_do():
    t = calibrate(CLEAN, false_alarm=0.01, horizon=2000, runs=1000)
    assert t.k == pytest.approx(float(np.quantile(CLEAN, 0.95)))
    assert t.clean_answers == 400 and t.false_alarm == 0.01 and t.horizon == 2000
    assert t.bandwidth == pytest.approx(bandwidth(CLEAN)) and 0.0 < t.bandwidth < 0.25 and t.cap == t.h / 3
    # other streams than the calibration's (another seed): the rate holds, within resampling noise
    assert false_alarm_rate(CLEAN, t.k, t.h, 2000, runs=1000, seed=1, bw=t.bandwidth) <= 0.03
    # and it is tight: a bound 10% lower alarms more often than the target on the calibration's streams
    assert false_alarm_rate(CLEAN, t.k, 0.9 * t.h, 2000, runs=1000, bw=t.bandwidth) > 0.01
    # the smoothed bootstrap draws past the largest clean score: its bound is above the plain one's
    assert calibrate(CLEAN, false_alarm=0.01, horizon=2000, runs=1000, smooth=False).h < t.h
    with pytest.raises(ValueError, match=">= 20 clean scores"):
        calibrate(CLEAN[:5])


def test_a_broken_endpoint_alarms_after_about_h_over_its_excess_and_clean_traffic_does_not():
    t = Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100)
    clean = Cusum(t)
    for x in CLEAN:
        assert clean.observe(x - float(np.quantile(CLEAN, 0.95))) is not State.EJECTED
    assert clean.alarms == 0
    broken = Cusum(t)
    states = [broken.observe(0.8) for _ in range(4)]  # 0.8 over k each: S = 0.8, 1.6, 2.4, 3.2
    assert states == [State.SUSPECT, State.SUSPECT, State.SUSPECT, State.EJECTED] and broken.alarms == 1
    assert broken.evidence == [0.8] * 4
    # no answer adds more than h / 3: however far over k, three answers at least
    far = Cusum(t)
    assert [far.observe(50.0) for _ in range(3)] == [State.SUSPECT, State.SUSPECT, State.EJECTED]
    nan = Cusum(t)  # an answer that could not be scored is evidence, a full cap's worth
    assert [nan.observe(math.nan) for _ in range(3)] == [State.SUSPECT, State.SUSPECT, State.EJECTED]


def test_a_suspect_endpoint_is_audited_whole_until_the_test_decides_and_returns_after_clean_probes():
    t = Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100, probes=3)
    c = Cusum(t)
    assert not c.audit_every_answer
    c.observe(1.0)
    assert c.state is State.SUSPECT and c.audit_every_answer
    c.observe(-2.0)  # back to 0: clean
    assert c.state is State.WATCHED and c.s == 0.0 and not c.evidence
    assert [c.observe(2.0), c.observe(2.0), c.observe(2.0)] == [State.SUSPECT] * 2 + [State.EJECTED]  # 1 each
    assert c.audit_every_answer and c.evidence == [2.0, 2.0, 2.0]
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


def _record(rid: str, pool: str, excess: float | None, tokens: int = 16) -> AuditRecord:
    return AuditRecord(rid, "chat", pool, tokens, 1.0, None, 0.0, 0.0, excess=excess)


def test_the_endpoint_watch_keeps_a_test_per_endpoint_announces_an_ejection_with_its_evidence_and_a_return():
    now = [0.0]
    w = EndpointWatch(Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100,
                                 probes=2), probe_every_s=5.0, clock=lambda: now[0], wall=lambda: 1000.0 + now[0])
    seen: list[Alarm] = []
    w.observers.append(seen.append)
    assert w.record(_record("a0", "int4", None)) is None and w.snapshot() == {}  # unscored: no evidence either way
    assert w.record(_record("b0", "replica-b", -1.0)) is None  # another endpoint's clean answer
    assert w.record(_record("short", "int4", 9.0, tokens=MIN_TOKENS - 1)) is None  # too short to be evidence
    assert w.record(_record("a1", "int4", 2.0)) is None and w.record(_record("a2", "int4", 2.0)) is None
    assert w.audit_all("int4") and not w.ejected("int4") and not w.audit_all("replica-b")
    alarm = w.record(_record("a3", "int4", 2.0))
    assert alarm is not None and seen == [alarm] and not alarm.returned
    assert alarm.endpoint == "int4" and alarm.statistic == 3.0 and alarm.threshold == 3.0 and alarm.answers == 3
    assert alarm.evidence == (("a1", 2.0), ("a2", 2.0), ("a3", 2.0)) and alarm.ts == 1000.0
    assert w.ejected("int4") and not w.ejected("replica-b")
    # half-open: one probe at a time, at most every probe_every_s
    assert w.probe_due("int4") and not w.probe_due("int4") and not w.probe_due("replica-b")
    now[0] = 5.0
    assert w.probe_due("int4")
    assert w.record(_record("p0", "int4", -1.0)) is None and w.ejected("int4")  # one clean probe of two
    back = w.record(_record("p1", "int4", -1.0))
    assert back is not None and back.returned and seen[-1] is back and not w.ejected("int4")
    assert w.snapshot()["int4"] == {"state": "watched", "statistic": 0.0, "answers": 5, "alarms": 1}
