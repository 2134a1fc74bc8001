"""Incident records in SQLite: every hazard, with the offending prompt for offline replay.

    store = IncidentStore(path, redact=False)    WAL mode: readers never block the writer; a committed
                                                 row survives a kill -9 of the process
    writer = IncidentWriter(store)               the sink a server hands its engines: enqueue only,
                                                 one writer thread commits (off the decode loop)
    store.rows(), store.get(id), store.count()   what `qladder incidents list|show|replay` reads

The drift audit's records (qladder.audit: INT4's agreement with full precision per answer) go to
a table of their own beside them, `audits` (`record_audits`, `audits()`; `qladder incidents audits`).

With `redact`, only the prompt's fingerprint is kept (no text, no token ids): such a row cannot be
replayed. The fingerprint is the hash of the sanitized, templated token ids (`prompt_hash`).
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qladder.audit import AuditRecord
from qladder.incident_schema import (
    ADDED,
    AUDIT_COLUMNS,
    AUDIT_WIDTH,
    INCIDENT_COLUMNS,
    INCIDENT_WIDTH,
    Incident,
    IncidentBackend,
    IncidentSink,
    audit_row,
    column_ddl,
    ddl,
    incident_row,
    prompt_hash,
    storable,
)

__all__ = ["Incident", "IncidentBackend", "IncidentSink", "IncidentStore", "IncidentWriter", "is_postgres_url",
           "open_incident_store", "prompt_hash"]

_log = logging.getLogger("qladder.incidents")


def is_postgres_url(target: str | Path) -> bool:
    return str(target).startswith(("postgresql://", "postgres://"))


def open_incident_store(target: str | Path, redact: bool = False) -> IncidentBackend:
    """A PostgreSQL URL (postgresql://user@host:port/db) or a SQLite file's path."""
    if is_postgres_url(target):
        from qladder.incidents_pg import PostgresIncidentStore

        return PostgresIncidentStore(str(target), redact=redact)
    return IncidentStore(target, redact=redact)


class IncidentStore:
    """An append-only SQLite table (WAL mode); one connection, shared between threads under a lock."""

    def __init__(self, path: str | Path = ":memory:", redact: bool = False):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.redact = redact
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed row survives a process crash
        self._db.executescript(ddl("sqlite"))
        for table, column in ADDED:
            if column not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:  # a store from before it
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column_ddl(table, column, 'sqlite')}")
        self._lock = threading.Lock()

    def __call__(self, incident: Incident) -> None:
        self.record(incident)

    def record(self, inc: Incident) -> None:
        self.record_many([inc])

    def record_many(self, incidents: Sequence[Incident]) -> None:
        """Insert the rows in one transaction (committed together, or not at all)."""
        rows = [self._row(inc) for inc in incidents]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    f"INSERT INTO incidents ({INCIDENT_COLUMNS}) VALUES ({', '.join('?' * INCIDENT_WIDTH)})", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _row(self, inc: Incident) -> tuple[Any, ...]:
        return incident_row(inc, self.redact, storable, _finite)

    def record_audits(self, records: Sequence[AuditRecord]) -> None:
        rows = [audit_row(a, storable, _finite) for a in records]
        with self._lock:
            self._db.executemany(f"INSERT INTO audits ({AUDIT_COLUMNS}) VALUES ({', '.join('?' * AUDIT_WIDTH)})", rows)

    def audits(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]:
        """The newest `limit` audit rows (at or after `since`), newest first."""
        with self._lock:
            cur = self._db.execute("SELECT * FROM audits WHERE ts >= ? ORDER BY id DESC LIMIT ?",
                                   (since if since is not None else float("-inf"), limit))
            names = [c[0] for c in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0])

    def rows(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]:
        """The newest `limit` rows (at or after `since`, a Unix time), newest first."""
        with self._lock:
            cur = self._db.execute("SELECT * FROM incidents WHERE ts >= ? ORDER BY id DESC LIMIT ?",
                                   (since if since is not None else float("-inf"), limit))
            names = [c[0] for c in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def get(self, incident_id: int) -> dict[str, Any] | None:
        with self._lock:
            cur = self._db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,))
            names = [c[0] for c in cur.description]
            row = cur.fetchone()
        return dict(zip(names, row, strict=True)) if row is not None else None

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _finite(x: float | None) -> float | str | None:
    """SQLite stores NaN as NULL; keep non-finite values readable as text."""
    if x is None:
        return None
    return x if x == x and abs(x) != float("inf") else str(x)


class IncidentWriter:
    """The incident sink of a server: `__call__` only enqueues (the engine's threads never wait
    on the disk); one writer thread commits what has queued up, a transaction per batch. A full
    queue or a failing disk never loses an incident silently: it goes to the log as JSON and is
    counted in `dropped`."""

    def __init__(self, store: IncidentBackend, max_queue: int = 10_000,
                 on_commit: Callable[[int], None] | None = None):
        self.store = store
        self.on_commit = on_commit  # called with each batch's size after its commit (metrics)
        self._q: queue.Queue[Incident | AuditRecord | None] = queue.Queue(maxsize=max_queue)
        self.committed = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="qladder-incidents", daemon=True)
        self._thread.start()

    def __call__(self, inc: Incident) -> None:
        try:
            self._q.put_nowait(inc)
        except queue.Full:
            self._lose([inc], "the incident queue is full")

    def audit(self, record: AuditRecord) -> None:
        """A drift audit's record, enqueued like an incident (written beside them)."""
        try:
            self._q.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            _log.error("the incident queue is full; the audit: %s", json.dumps(record.to_dict(), default=str))

    def _run(self) -> None:
        while True:
            first = self._q.get()
            batch = [first]
            while len(batch) < 256:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            audits = [a for a in batch if isinstance(a, AuditRecord)]
            if audits:
                try:
                    self.store.record_audits(audits)
                except Exception:
                    _log.exception("the incident store failed to keep %d audit(s)", len(audits))
            incs = [i for i in batch if isinstance(i, Incident)]
            if incs:
                try:
                    self.store.record_many(incs)
                except Exception as exc:
                    self._lose(incs, f"the incident store failed: {exc!r}")
                else:
                    self.committed += len(incs)
                    if self.on_commit is not None:
                        self.on_commit(len(incs))
            if stop:
                return

    def _lose(self, incs: Sequence[Incident], why: str) -> None:
        self.dropped += len(incs)
        for inc in incs:
            _log.error("%s; the incident: %s", why, json.dumps(inc.to_dict(), default=str, ensure_ascii=True))

    @property
    def pending(self) -> int:
        return self._q.qsize()

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, then stop the thread (the store stays open: its owner closes it)."""
        self._q.put(None)
        self._thread.join(timeout_s)
