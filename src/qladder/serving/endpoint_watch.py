"""The audit's verdict on each endpoint that writes INT4 answers: one `Cusum` (health/detector.py)
per endpoint, fed the audit's records, read by whoever routes requests there.

    record(AuditRecord)   the auditor's observer (the standby's thread): the record's endpoint
                          (`AuditRecord.pool`) takes its score (`excess`; an answer of fewer
                          than MIN_TOKENS tokens is not evidence either way); an alarm or a return
                          is announced to the observers, outside the lock
    audit_all(endpoint)   suspect (the test has not decided) or probing: audit every answer
    ejected(endpoint)     the test decided it is broken and no clean probes brought it back
    probe_due(endpoint)   ejected, and no probe answer out for `probe_every_s` (injected clock):
                          the caller sends one (an answer nobody is shown, audited), `probed` it

Each endpoint's statistic, state and the evidence since its statistic last left 0 (the audited
request ids and their scores) are kept together behind one lock; the observers get an `Alarm`
(an incident, a metric, a log line are theirs to write).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qladder.audit import AuditRecord
from qladder.health.detector import MIN_TOKENS, Cusum, State, Thresholds


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


@dataclass
class _Endpoint:
    test: Cusum
    evidence: list[tuple[str, float]] = field(default_factory=list)
    probe_at: float = float("-inf")  # when the last probe went out


class EndpointWatch:
    def __init__(self, thresholds: Thresholds, probe_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.t = thresholds
        self.probe_every_s = probe_every_s
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._endpoints: dict[str, _Endpoint] = {}
        self.observers: list[Callable[[Alarm], None]] = []

    def _get(self, endpoint: str) -> _Endpoint:
        e = self._endpoints.get(endpoint)
        if e is None:
            e = self._endpoints[endpoint] = _Endpoint(Cusum(self.t))
        return e

    def record(self, r: AuditRecord) -> Alarm | None:
        """One audited answer of endpoint `r.pool`. Returns (and announces) an alarm or a return."""
        if r.excess is None or r.tokens < MIN_TOKENS:  # unscorable, or too short to be evidence
            return None
        with self._lock:
            e = self._get(r.pool)
            before = e.test.state
            after = e.test.observe(r.excess)
            out = before in (State.EJECTED, State.PROBING)
            if not out:
                e.evidence = [*e.evidence, (r.request_id, r.excess)] if e.test.s > 0 else []
            alarm = None
            if after is State.EJECTED and not out:
                alarm = Alarm(r.pool, False, e.test.s, self.t.h, e.test.answers, tuple(e.evidence), self.wall())
            elif out and after is State.WATCHED:
                alarm = Alarm(r.pool, True, 0.0, self.t.h, e.test.answers, (), self.wall())
                e.evidence = []
        if alarm is not None:
            for observe in tuple(self.observers):
                observe(alarm)
        return alarm

    def audit_all(self, endpoint: str) -> bool:
        with self._lock:
            e = self._endpoints.get(endpoint)
            return e is not None and e.test.audit_every_answer

    def ejected(self, endpoint: str) -> bool:
        with self._lock:
            e = self._endpoints.get(endpoint)
            return e is not None and e.test.state in (State.EJECTED, State.PROBING)

    def probe_due(self, endpoint: str) -> bool:
        """Ejected and no probe sent for `probe_every_s`: marks one sent (the caller sends it)."""
        now = self.clock()
        with self._lock:
            e = self._endpoints.get(endpoint)
            if e is None or e.test.state not in (State.EJECTED, State.PROBING) or now - e.probe_at < self.probe_every_s:
                return False
            e.probe_at = now
            return True

    def snapshot(self) -> dict[str, dict[str, float | str]]:
        """Each endpoint's state, statistic, audited answers and alarms."""
        with self._lock:
            return {k: {"state": e.test.state.value, "statistic": e.test.s, "answers": e.test.answers,
                        "alarms": e.test.alarms} for k, e in self._endpoints.items()}
