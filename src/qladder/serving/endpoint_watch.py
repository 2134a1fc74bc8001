"""The audit's verdict on each endpoint that writes INT4 answers: two `Cusum`s (health/detector.py)
per endpoint, one a decoding mode (greedy answers scored by fp32's gap, sampled by the excess:
`Detector`), fed the audit's records, read by whoever routes requests there.

    record(AuditRecord)   the auditor's observer (the standby's thread): the record's endpoint
                          (`AuditRecord.pool`) takes its score in its mode's test (an answer of
                          fewer than MIN_TOKENS tokens is not evidence either way, nor is an
                          answer the test has already seen: the same prompt's greedy answer sent
                          again is one piece of evidence, not several); an alarm or a return is
                          announced to the observers, outside the lock
    audit_all(endpoint)   suspect (a test has not decided) or ejected: audit every answer
    ejected(endpoint)     a test decided it is broken and no clean probes brought it back
    probe_due(endpoint)   ejected, and no probe answer out for `probe_every_s` (injected clock):
                          the caller sends one (an answer nobody is shown, audited), `probed` it

An ejected endpoint comes back after `probes` audited probe answers in a row (whatever their
mode) score under their mode's k: both tests start again from 0. While it is out, the records
of answers that are not probes (begun before the ejection, or the kept part of a withdrawn
stream) are neither evidence against it nor for its return. Each endpoint's tests, state
and the evidence since the ejecting test's statistic last left 0 (the audited request ids and
their scores) are kept together behind one lock; the observers get an `Alarm` (an incident, a
metric, a log line are theirs to write).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from qladder.audit import AuditRecord
from qladder.health.detector import MIN_TOKENS, Cusum, Detector, State

SEEN = 4096  # the answers (prompt and answer digests) an endpoint's tests remember, newest kept


@dataclass(frozen=True)
class Alarm:
    """An endpoint's test reached its bound (`returned`: False), or its probes brought it back (True)."""

    endpoint: str
    returned: bool
    statistic: float
    threshold: float
    answers: int  # audited answers of the endpoint so far
    evidence: tuple[tuple[str, float], ...]  # (request id, score) since the statistic last left 0
    ts: float
    mode: str = ""  # the test that decided ("greedy" or "sampled"; "" for a return)


@dataclass
class _Endpoint:
    tests: dict[bool, Cusum]  # greedy?: its test
    evidence: dict[bool, list[tuple[str, float]]] = field(default_factory=lambda: {True: [], False: []})
    out: bool = False  # ejected (a test decided), until clean probes bring it back
    probing: bool = False  # out, and a probe answer has been audited
    clean_probes: int = 0
    answers: int = 0
    alarms: int = 0
    probe_at: float = float("-inf")  # when the last probe went out
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)  # answer keys fed to the tests

    def first_time(self, key: str) -> bool:
        """Whether an answer (its `AuditRecord.key`; "" : unknown, always new) is new to the tests."""
        if not key:
            return True
        if key in self.seen:
            self.seen.move_to_end(key)
            return False
        self.seen[key] = None
        if len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        return True


class EndpointWatch:
    def __init__(self, detector: Detector, probe_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.detector = detector
        self.probe_every_s = probe_every_s
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._endpoints: dict[str, _Endpoint] = {}
        self.observers: list[Callable[[Alarm], None]] = []

    def _get(self, endpoint: str) -> _Endpoint:
        e = self._endpoints.get(endpoint)
        if e is None:
            e = self._endpoints[endpoint] = _Endpoint({g: Cusum(self.detector.of(g)) for g in (True, False)})
        return e

    def record(self, r: AuditRecord) -> Alarm | None:
        """One audited answer of endpoint `r.pool`. Returns (and announces) an alarm or a return."""
        x = r.score
        if x is None or r.tokens < MIN_TOKENS:  # unscorable, or too short to be evidence
            return None
        with self._lock:
            e = self._get(r.pool)
            e.answers += 1
            test = e.tests[r.greedy]
            alarm = None
            if e.out:  # probes: clean ones bring it back
                if r.source != "probe":  # begun before the ejection, or a withdrawn stream's kept part
                    return None
                e.probing = True
                e.clean_probes = e.clean_probes + 1 if test.clean(x) else 0
                if e.clean_probes >= self.detector.probes:
                    for t in e.tests.values():
                        t.reset()
                    e.out, e.probing, e.clean_probes = False, False, 0
                    e.evidence, e.seen = {True: [], False: []}, OrderedDict()
                    alarm = Alarm(r.pool, True, 0.0, test.t.h, e.answers, (), self.wall())
            elif not e.first_time(r.key):  # the same answer again: no new evidence
                return None
            else:
                test.observe(x)
                e.evidence[r.greedy] = [*e.evidence[r.greedy], (r.request_id, x)] if test.s > 0 else []
                if test.state is State.EJECTED:
                    e.out, e.alarms = True, e.alarms + 1
                    alarm = Alarm(r.pool, False, test.s, test.t.h, e.answers, tuple(e.evidence[r.greedy]),
                                  self.wall(), "greedy" if r.greedy else "sampled")
        if alarm is not None:
            for observe in tuple(self.observers):
                observe(alarm)
        return alarm

    def audit_all(self, endpoint: str) -> bool:
        with self._lock:
            e = self._endpoints.get(endpoint)
            return e is not None and (e.out or any(t.audit_every_answer for t in e.tests.values()))

    def ejected(self, endpoint: str) -> bool:
        with self._lock:
            e = self._endpoints.get(endpoint)
            return e is not None and e.out

    def probe_due(self, endpoint: str) -> bool:
        """Ejected and no probe sent for `probe_every_s`: marks one sent (the caller sends it)."""
        now = self.clock()
        with self._lock:
            e = self._endpoints.get(endpoint)
            if e is None or not e.out or now - e.probe_at < self.probe_every_s:
                return False
            e.probe_at = now
            return True

    def snapshot(self) -> dict[str, dict[str, float | str]]:
        """Each endpoint's state, statistic (the nearer of its two tests to its bound, as a share
        of it: 1 ejects), audited answers and alarms."""
        with self._lock:
            return {k: {"state": self._state(e).value, "statistic": max(t.s / t.t.h for t in e.tests.values()),
                        "answers": e.answers, "alarms": e.alarms} for k, e in self._endpoints.items()}

    @staticmethod
    def _state(e: _Endpoint) -> State:
        if e.out:
            return State.PROBING if e.probing else State.EJECTED
        return State.SUSPECT if any(t.audit_every_answer for t in e.tests.values()) else State.WATCHED
