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

import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from qladder.audit import AuditRecord
from qladder.types import Hazard

SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    prompt_hash TEXT NOT NULL,
    prompt_text TEXT,
    prompt_ids TEXT NOT NULL,
    rung TEXT NOT NULL,
    step INTEGER NOT NULL,
    check_name TEXT NOT NULL,
    layer INTEGER,
    value REAL,
    threshold REAL,
    action TEXT NOT NULL,
    handoff_latency_ms REAL,
    faults TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_prompt ON incidents(prompt_hash);
CREATE INDEX IF NOT EXISTS incidents_ts ON incidents(ts);
CREATE TABLE IF NOT EXISTS audits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    prompt_class TEXT NOT NULL,
    pool TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    agreement REAL NOT NULL,
    first_divergence INTEGER,
    kl_top5 REAL NOT NULL,
    fp32_gap REAL NOT NULL,
    source TEXT NOT NULL DEFAULT 'audit',
    excess REAL
);
CREATE INDEX IF NOT EXISTS audits_ts ON audits(ts);
"""

_log = logging.getLogger("qladder.incidents")


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


@dataclass
class Incident:
    request_id: str
    prompt_hash: str
    prompt_ids: list[int]
    prompt_text: str | None
    hazard: Hazard
    action: str  # handoff:<rung> | stop:<reason> | eject:<endpoint> (the audit's test)
    handoff_latency_ms: float | None
    faults: list[str]
    ts: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hazard"] = self.hazard.to_dict()
        return d


IncidentSink = Callable[[Incident], None]


class IncidentBackend(Protocol):
    """What the writer and `qladder incidents` use of a store: SQLite (`IncidentStore`, the
    default) or PostgreSQL (`qladder.incidents_pg.PostgresIncidentStore`, gateways sharing one
    table). Both give the same rows: the same columns, non-finite numbers as text."""

    path: str
    redact: bool

    def record_many(self, incidents: Sequence[Incident]) -> None: ...
    def record_audits(self, records: Sequence[AuditRecord]) -> None: ...
    def audits(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]: ...
    def count(self) -> int: ...
    def rows(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]: ...
    def get(self, incident_id: int) -> dict[str, Any] | None: ...
    def close(self) -> None: ...


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
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(audits)")}
        for column, ddl in (("source", "TEXT NOT NULL DEFAULT 'audit'"), ("excess", "REAL")):
            if column not in have:  # a store from before it
                self._db.execute(f"ALTER TABLE audits ADD COLUMN {column} {ddl}")
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
                self._db.executemany(f"INSERT INTO incidents ({INCIDENT_COLUMNS}) VALUES ({', '.join('?' * 15)})",
                                     rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _row(self, inc: Incident) -> tuple[Any, ...]:
        return incident_row(inc, self.redact, _storable, _finite)

    def record_audits(self, records: Sequence[AuditRecord]) -> None:
        rows = [audit_row(a, _storable, _finite) for a in records]
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


INCIDENT_COLUMNS = ("ts, request_id, prompt_hash, prompt_text, prompt_ids, rung, step, check_name, layer, value,"
                    " threshold, action, handoff_latency_ms, faults, detail")
AUDIT_COLUMNS = ("ts, request_id, prompt_class, pool, tokens, agreement, first_divergence, kl_top5, fp32_gap, source,"
                 " excess")
AUDIT_WIDTH = len(AUDIT_COLUMNS.split(","))


def incident_row(inc: Incident, redact: bool, text: Callable[[str | None], str | None],
                 number: Callable[[float | None], Any]) -> tuple[Any, ...]:
    """An incident's values in INCIDENT_COLUMNS' order; `text` and `number` make a value storable
    in the backend (each backend's own rule for invalid UTF-8, NUL and non-finite numbers)."""
    h = inc.hazard
    prompt, ids = (None, "null") if redact else (text(inc.prompt_text), json.dumps(inc.prompt_ids))
    return (inc.ts or time.time(), text(inc.request_id), inc.prompt_hash, prompt, ids, h.rung, h.step,
            h.check, h.layer, number(h.value), number(h.threshold), inc.action, inc.handoff_latency_ms,
            json.dumps(inc.faults), text(h.detail))


def audit_row(a: AuditRecord, text: Callable[[str | None], str | None],
              number: Callable[[float | None], Any]) -> tuple[Any, ...]:
    """A drift audit's values in AUDIT_COLUMNS' order."""
    return (a.ts, text(a.request_id), a.prompt_class, a.pool, a.tokens, a.agreement, a.first_divergence,
            number(a.kl_top5), number(a.fp32_gap), a.source, number(a.excess))


def _storable(text: str | None) -> str | None:
    """The raw prompt is kept for replay, but SQLite takes only valid UTF-8: a lone surrogate
    (which a client can send in JSON) is stored as its escape, `\\ud800`."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
