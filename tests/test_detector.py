"""The endpoint detector (health/detector.py): a one-sided CUSUM whose bounds come from a
false-alarm rate chosen up front and clean scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qladder.audit import AuditRecord
from qladder.health.detector import (
    MIN_TOKENS,
    Cusum,
    Detector,
    State,
    Thresholds,
    bandwidth,
    calibrate,
    committed,
    false_alarm_rate,
)
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


def test_a_suspect_endpoint_is_audited_whole_until_the_test_decides_and_an_ejected_test_waits_for_its_reset():
    t = Thresholds(k=0.0, h=3.0, false_alarm=0.001, horizon=10_000, quantile=0.95, clean_answers=100, probes=3)
    c = Cusum(t)
    assert not c.audit_every_answer
    c.observe(1.0)
    assert c.state is State.SUSPECT and c.audit_every_answer
    c.observe(-2.0)  # back to 0: clean
    assert c.state is State.WATCHED and c.s == 0.0 and not c.evidence
    assert [c.observe(2.0), c.observe(2.0), c.observe(2.0)] == [State.SUSPECT] * 2 + [State.EJECTED]  # 1 each
    assert c.audit_every_answer and c.evidence == [2.0, 2.0, 2.0]
    assert c.observe(-5.0) is State.EJECTED and c.s == 3.0  # decided: only its watch's probes bring it back
    assert c.clean(-1.0) and not c.clean(0.5) and not c.clean(math.nan)
    c.reset()
    assert c.state is State.WATCHED and c.s == 0.0 and c.alarms == 1 and c.answers == 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-5, max_value=5, allow_nan=False), max_size=60),
       st.floats(min_value=-1, max_value=1), st.floats(min_value=0.1, max_value=10))
def test_the_statistic_never_goes_negative_and_the_state_says_where_it_is(xs, k, h):
    c = Cusum(Thresholds(k=k, h=h, false_alarm=0.01, horizon=100, quantile=0.9, clean_answers=100))
    for x in xs:
        was_out = c.state is State.EJECTED
        state = c.observe(x)
        assert c.s >= 0.0
        if not was_out:
            assert state is (State.EJECTED if c.s >= h else State.SUSPECT if c.s > 0 else State.WATCHED)


def _record(rid: str, pool: str, score: float | None, tokens: int = 16, greedy: bool = True,
            key: str | None = None) -> AuditRecord:
    """An audited answer whose score (a greedy one's fp32 gap, a sampled one's excess) is `score`
    (request ids "p...": a probe's; each a different answer unless `key` says otherwise)."""
    return AuditRecord(rid, "chat", pool, tokens, 1.0, None, 0.0, score if greedy else 0.0,  # type: ignore[arg-type]
                       excess=None if greedy else score, greedy=greedy, key=rid if key is None else key,
                       source="probe" if rid.startswith("p") else "audit")


def _detector(probes: int = 2) -> Detector:
    return Detector(Thresholds(k=0.0, h=3.0, false_alarm=0.0005, horizon=10_000, quantile=0.95, clean_answers=100,
                               probes=probes),
                    Thresholds(k=-0.5, h=1.5, false_alarm=0.0005, horizon=10_000, quantile=0.95, clean_answers=100,
                               probes=probes))


def test_an_answer_is_scored_by_its_mode_greedy_by_fp32s_gap_sampled_by_the_excess():
    greedy = AuditRecord("g", "chat", "int4", 16, 0.5, 3, 0.1, 0.8, excess=-0.3, greedy=True)
    sampled = AuditRecord("s", "chat", "int4", 16, 0.5, 3, 0.1, 0.8, excess=-0.3, greedy=False)
    assert greedy.score == 0.8 and sampled.score == -0.3
    d = _detector()
    assert d.of(True) is d.greedy and d.of(False) is d.sampled and d.false_alarm == pytest.approx(0.001)
    assert Detector.from_dict(d.to_dict()) == d
    c = committed()  # the committed calibration: each mode its own, half the rate each
    assert c.greedy.k != c.sampled.k
    assert c.greedy.false_alarm == c.sampled.false_alarm == pytest.approx(c.false_alarm / 2)


def test_the_endpoint_watch_keeps_a_test_per_endpoint_announces_an_ejection_with_its_evidence_and_a_return():
    now = [0.0]
    w = EndpointWatch(_detector(), probe_every_s=5.0, clock=lambda: now[0], wall=lambda: 1000.0 + now[0])
    seen: list[Alarm] = []
    w.observers.append(seen.append)
    assert w.record(_record("a0", "int4", None)) is None and w.snapshot() == {}  # unscored: no evidence either way
    assert w.record(_record("b0", "replica-b", -1.0)) is None  # another endpoint's clean answer
    assert w.record(_record("short", "int4", 9.0, tokens=MIN_TOKENS - 1)) is None  # too short to be evidence
    assert w.record(_record("a1", "int4", 2.0)) is None and w.record(_record("a2", "int4", 2.0)) is None
    assert w.audit_all("int4") and not w.ejected("int4") and not w.audit_all("replica-b")
    # a sampled answer moves the sampled test alone (its own k): a clean one leaves the greedy evidence be
    assert w.record(_record("s1", "int4", -1.0, greedy=False)) is None and w.audit_all("int4")
    alarm = w.record(_record("a3", "int4", 2.0))
    assert alarm is not None and seen == [alarm] and not alarm.returned and alarm.mode == "greedy"
    assert alarm.endpoint == "int4" and alarm.statistic == 3.0 and alarm.threshold == 3.0 and alarm.answers == 4
    assert alarm.evidence == (("a1", 2.0), ("a2", 2.0), ("a3", 2.0)) and alarm.ts == 1000.0
    assert w.ejected("int4") and not w.ejected("replica-b") and w.snapshot()["int4"]["state"] == "ejected"
    # half-open: one probe at a time, at most every probe_every_s
    assert w.probe_due("int4") and not w.probe_due("int4") and not w.probe_due("replica-b")
    now[0] = 5.0
    assert w.probe_due("int4")
    for k in range(3):  # answers begun before the ejection: neither evidence nor probes
        assert w.record(_record(f"late{k}", "int4", -1.0)) is None and w.snapshot()["int4"]["state"] == "ejected"
    assert w.record(_record("p0", "int4", -1.0)) is None and w.ejected("int4")  # one clean probe of two
    assert w.snapshot()["int4"]["state"] == "probing"
    assert w.record(_record("p1", "int4", 0.5)) is None  # over the greedy k: the count starts again
    assert w.record(_record("p2", "int4", -1.0)) is None
    back = w.record(_record("p3", "int4", -0.7, greedy=False))  # a sampled probe, under the sampled k
    assert back is not None and back.returned and seen[-1] is back and not w.ejected("int4")
    assert w.snapshot()["int4"] == {"state": "watched", "statistic": 0.0, "answers": 11, "alarms": 1}


def test_the_same_answer_audited_again_is_one_piece_of_evidence():
    """A greedy answer is its prompt's: a client that sends the same request three times gives the
    test one answer, not three (three of them over k would otherwise eject a clean endpoint)."""
    w = EndpointWatch(_detector())
    for rid in ("a", "b", "c", "d"):
        assert w.record(_record(rid, "int4", 2.0, key="same")) is None
    assert w.snapshot()["int4"]["statistic"] == pytest.approx(1 / 3) and not w.ejected("int4")
    assert w.record(_record("e", "replica-b", 2.0, key="same")) is None  # another endpoint's: its own evidence
    assert w.snapshot()["replica-b"]["statistic"] == pytest.approx(1 / 3)
    w.record(_record("f", "int4", 2.0, key="other"))
    assert w.record(_record("g", "int4", 2.0, key="third")) is not None and w.ejected("int4")


def test_the_sampled_test_ejects_on_its_own_scale_and_the_snapshot_reads_the_nearer_test():
    w = EndpointWatch(_detector())
    w.record(_record("g", "int4", 1.0))  # greedy: 1 of its bound 3
    assert w.snapshot()["int4"]["statistic"] == pytest.approx(1 / 3)
    w.record(_record("s0", "int4", 0.0, greedy=False))  # sampled: 0.5 of 1.5
    assert w.snapshot()["int4"]["statistic"] == pytest.approx(1 / 3)
    alarms = [w.record(_record(f"s{i}", "int4", 0.5, greedy=False)) for i in (1, 2)]  # +0.5 each (cap 0.5)
    assert alarms[0] is None and alarms[1] is not None and alarms[1].mode == "sampled" and w.ejected("int4")
