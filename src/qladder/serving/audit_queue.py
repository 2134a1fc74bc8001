"""The audit's jobs waiting to be scored and its recent cost, shared by both auditors (the
in-process standby's, serving/auditor.py, and a remote standby's, serving/remote_auditor.py).

Urgent jobs (an answer of an endpoint whose test has not decided, or an ejected one's probe:
what decides an alarm) go first, in order; then the newest ordinary job (under a backlog the
freshest evidence, not the oldest), an endpoint's that turned suspect since (`prefer`) first. Any
thread offers; the auditor's own thread takes. Two bounded deques and the cost window behind one
lock: a full deque drops its oldest job, counted; the cost is what the serving engine's audit
budget reads, over the last SPENT_WINDOW_S."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from qladder.audit import AuditJob

SPENT_WINDOW_S = 30.0  # the audit's recent cost is read over this window


class AuditQueue:
    def __init__(self, max_jobs: int = 64):
        self._max = max_jobs
        self._jobs: deque[AuditJob] = deque()
        self._urgent: deque[AuditJob] = deque()
        self._spent: deque[tuple[float, float]] = deque()  # (end, core-seconds), the last window's
        self._lock = threading.Lock()
        # whether an endpoint is suspect now (set by the serving engine: its watch's audit_all): an
        # ordinary job of one that turned suspect after the job was queued goes before the others
        self.prefer: Callable[[str], bool] | None = None
        self.dropped = 0  # jobs dropped from a full deque

    def offer(self, job: AuditJob) -> None:
        with self._lock:
            jobs = self._urgent if job.urgent else self._jobs
            if len(jobs) >= self._max:
                jobs.popleft()
                self.dropped += 1
            jobs.append(job)

    def take(self) -> AuditJob | None:
        """The next job to score (None: none waits)."""
        with self._lock:
            if self._urgent:
                return self._urgent.popleft()
            if not self._jobs:
                return None
            prefer = self.prefer
            job = next((j for j in reversed(self._jobs) if prefer is not None and prefer(j.pool)), self._jobs[-1])
            self._jobs.remove(job)
            return job

    def put_back(self, job: AuditJob) -> None:
        """A job taken that could not start: first again in its deque."""
        with self._lock:
            if job.urgent:
                self._urgent.appendleft(job)
            else:
                self._jobs.append(job)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._jobs) + len(self._urgent)

    @property
    def urgent_waiting(self) -> bool:
        with self._lock:
            return bool(self._urgent)

    def charge(self, now: float, core_s: float) -> None:
        """Scoring ran until `now` on `core_s` core-seconds."""
        with self._lock:
            self._spent.append((now, core_s))
            while self._spent and self._spent[0][0] < now - SPENT_WINDOW_S:
                self._spent.popleft()

    def spent(self, now: float) -> float:
        """Core-seconds the audit ran in the last SPENT_WINDOW_S."""
        with self._lock:
            return sum(c for t, c in self._spent if t >= now - SPENT_WINDOW_S)


class QueuedAuditor:
    """What both auditors show other threads of their queue: `prefer` (set by the serving engine),
    `dropped`, `offer` and `spent` (the queue's lock)."""

    queue: AuditQueue

    @property
    def prefer(self) -> Callable[[str], bool] | None:
        return self.queue.prefer

    @prefer.setter
    def prefer(self, fn: Callable[[str], bool] | None) -> None:
        self.queue.prefer = fn

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    def offer(self, job: AuditJob) -> None:
        self.queue.offer(job)

    def spent(self, now: float) -> float:
        """Core-seconds the audit ran in the last SPENT_WINDOW_S (any thread)."""
        return self.queue.spent(now)
