"""The standby's drift audits (qladder.audit): jobs queued by finished INT4 answers
(serving/audit_queue.py: urgent first, then the newest), run in the turns the standby has nothing
else to do, one chunk of `chunk` tokens a turn, so a handoff that arrives meanwhile waits at most
one chunk (and, while handoffs keep it busy, in a bounded share of its turns: serving/standby.py);
an urgent job that comes while an ordinary one is under way sets it aside (its session kept) and
runs first. Owned by the standby's worker thread; `offer`, `pending` and `spent` are the calls
from other threads (the queue's lock; the chunks' core-seconds are what the engine's audit budget
reads)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from qladder.audit import AuditJob, AuditRecord, score
from qladder.engines.torch_batch import BatchedTorch, BatchedTorchSession
from qladder.errors import EngineError
from qladder.serving.audit_queue import SPENT_WINDOW_S, AuditQueue, QueuedAuditor

__all__ = ["SPENT_WINDOW_S", "Auditor"]
_log = logging.getLogger("qladder.audit")


class Auditor(QueuedAuditor):
    def __init__(self, engine: BatchedTorch, on_record: Callable[[AuditRecord], None], max_jobs: int = 64,
                 chunk: int = 64):
        self.engine, self.on_record, self.chunk = engine, on_record, chunk
        self.queue = AuditQueue(max_jobs)
        self.failed = 0  # jobs whose forward failed
        self.done = 0
        self._job: AuditJob | None = None
        self._session: BatchedTorchSession | None = None
        self._feed: list[int] = []
        self._rows: list[torch.Tensor] = []
        # an ordinary job set aside (its session kept) while an urgent one that came meanwhile runs
        self._paused: tuple[AuditJob, BatchedTorchSession, list[int], list[torch.Tensor]] | None = None
        self._delivering = False  # a scored job's record not yet with its observers (still pending)

    # -- any thread ------------------------------------------------------------------------------
    @property
    def runnable(self) -> bool:
        """A chunk can run now: a job under way, or one waiting and a free session slot for it."""
        return self._job is not None or (self.queue.waiting > 0 and self.engine.free_slots > 0)

    @property
    def urgent(self) -> bool:
        """An urgent job is under way or waiting (a suspect endpoint's answer, a probe)."""
        return self.queue.urgent_waiting or (self._job is not None and self._job.urgent)

    def charge(self, now: float, core_s: float) -> None:
        """A chunk ran until `now` (the standby's clock) on `core_s` core-seconds (its thread)."""
        self.queue.charge(now, core_s)

    @property
    def pending(self) -> int:
        return (self.queue.waiting + (self._job is not None or self._delivering)
                + (self._paused is not None))

    # -- the standby's thread --------------------------------------------------------------------
    def step(self, chunk: int | None = None) -> bool:
        """One chunk (`chunk` tokens, default the auditor's) of the current job (starting the next
        when none is current). False: no work."""
        if self._job is not None and not self._job.urgent and self._paused is None and self.engine.free_slots > 0 \
                and self.queue.urgent_waiting:  # set the ordinary job aside: the urgent one decides an alarm
            assert self._session is not None
            self._paused = (self._job, self._session, self._feed, self._rows)
            self._job, self._session, self._feed, self._rows = None, None, [], []
        if self._job is None and not self._start():
            return False
        job, s = self._job, self._session
        assert job is not None and s is not None
        n = chunk or self.chunk
        ids, self._feed = self._feed[:n], self._feed[n:]
        n_rows = min(len(ids), max(0, len(job.answer_ids) - sum(len(r) for r in self._rows)
                                   - len(self._feed)))
        try:
            self.engine.run([(s, ids, n_rows)])
            if n_rows:
                self._rows.append(s.rows().clone())
        except EngineError as exc:
            _log.warning("audit of request %s failed: %s", job.request_id, exc)
            self.failed += 1
            self._end()
            return True
        if not self._feed:
            rows = torch.cat(self._rows)
            self._delivering = True  # (pending until its observers have the record)
            try:
                self._end()  # first: a bug in scoring must not leave the job current forever
                record = score(job, rows)
                self.done += 1
                self.on_record(record)
            finally:
                self._delivering = False
        return True

    def _start(self) -> bool:
        job = self.queue.take()
        if job is None:
            return False
        try:
            self._session = self.engine.reserve(job.prompt_ids)
        except EngineError:  # no slot free: try again at the next idle turn
            self.queue.put_back(job)
            return False
        self._job = job
        self._feed = [*self._session.take_pending(), *job.answer_ids[:-1]]
        self._rows = []
        return True

    def _end(self) -> None:
        """The current job is over; a job set aside goes on."""
        if self._session is not None:
            self._session.close()
        self._job, self._session, self._feed, self._rows = None, None, [], []
        if self._paused is not None:
            (self._job, self._session, self._feed, self._rows), self._paused = self._paused, None

    def close(self) -> None:
        self._end()
        self._end()  # (and the one set aside)
