"""Incident records in PostgreSQL, for gateways that share one table (`[server] incidents =
"postgresql://user@host:port/db"`): the same columns and rows as the SQLite store, written by the
same writer thread (`IncidentWriter`, a transaction per batch) through psycopg 3.

Two gateways writing at once lose no row: each batch is one transaction, ids come from the
table's own sequence, and the schema is created under a transaction-scoped advisory lock, so two
gateways starting together do not race on CREATE TABLE. One connection, shared between the
writer thread and readers under a lock (as the SQLite store's); a broken connection is opened
again on the next call (the writer logs and counts the batch that failed, as for a full disk).

PostgreSQL differs from SQLite in two ways the rows must not show: it stores NaN and infinities
as numbers (read back here as the text SQLite keeps, "nan", "inf"), and its text cannot hold
NUL, which is kept as the escape `\\x00` (as lone surrogates are, by both stores).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from qladder.audit import AuditRecord
from qladder.errors import ConfigError
from qladder.incident_schema import (
    AUDIT_COLUMNS,
    AUDIT_WIDTH,
    INCIDENT_COLUMNS,
    INCIDENT_WIDTH,
    Incident,
    audit_row,
    ddl,
    incident_row,
    storable,
)

_SCHEMA_LOCK = 0x716C6164  # "qlad": the advisory lock two gateways creating the schema take in turn


def _text(text: str | None) -> str | None:
    stored = storable(text)
    return stored.replace("\x00", "\\x00") if stored is not None else None


def _number(x: float | None) -> float | None:
    return x  # PostgreSQL keeps NaN and infinities; `_readable` gives them back as SQLite's text


# the columns the SQLite store keeps as text when non-finite (incidents.py `_finite`); others as numbers
_AS_TEXT = frozenset({"value", "threshold", "kl_top5", "fp32_gap"})


def _readable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if k in _AS_TEXT and isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


class PostgresIncidentStore:
    """The incident and audit tables in a PostgreSQL database (IncidentBackend)."""

    STATEMENT_TIMEOUT_S = 30.0

    def __init__(self, url: str, redact: bool = False, connect_timeout_s: float = 5.0):
        self.path, self.redact, self._timeout = url, redact, connect_timeout_s
        self._lock = threading.Lock()
        self._db: psycopg.Connection[dict[str, Any]] | None = None
        with self._lock, self._conn().transaction():
            self._conn().execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            self._conn().execute(ddl("postgresql"))

    def _conn(self) -> psycopg.Connection[dict[str, Any]]:
        """The connection, opened again if the server dropped it (the caller holds the lock)."""
        if self._db is None or self._db.closed or self._db.broken:
            try:
                # bounded: a hung server fails a batch (logged and counted) instead of holding the lock
                self._db = psycopg.connect(self.path, autocommit=True, row_factory=dict_row,
                                           connect_timeout=max(1, round(self._timeout)), keepalives=1,
                                           options=f"-c statement_timeout={round(self.STATEMENT_TIMEOUT_S * 1000)}")
            except psycopg.OperationalError as exc:
                raise ConfigError(f"cannot reach the incident database {_safe(self.path)}: {exc}") from exc
        return self._db

    def record(self, inc: Incident) -> None:
        self.record_many([inc])

    def record_many(self, incidents: Sequence[Incident]) -> None:
        """Insert the rows in one transaction (committed together, or not at all)."""
        rows = [incident_row(inc, self.redact, _text, _number) for inc in incidents]
        self._write(f"INSERT INTO incidents ({INCIDENT_COLUMNS}) VALUES ({', '.join(['%s'] * INCIDENT_WIDTH)})", rows)

    def _write(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        """One transaction; a connection the server dropped since the last one (a restart) is
        opened again and the batch tried once more (nothing of it was committed)."""
        with self._lock:
            for attempt in (0, 1):
                db = self._conn()
                try:
                    with db.transaction(), db.cursor() as cur:
                        cur.executemany(sql, rows)
                    return
                except psycopg.OperationalError:
                    if attempt or not db.broken:
                        raise

    def __call__(self, incident: Incident) -> None:
        self.record(incident)

    def record_audits(self, records: Sequence[AuditRecord]) -> None:
        rows = [audit_row(a, _text, _number) for a in records]
        self._write(f"INSERT INTO audits ({AUDIT_COLUMNS}) VALUES ({', '.join(['%s'] * AUDIT_WIDTH)})", rows)

    def _select(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        with self._lock:
            return [_readable(r) for r in self._conn().execute(sql, params).fetchall()]

    def audits(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]:
        """The newest `limit` audit rows (at or after `since`), newest first."""
        return self._select("SELECT * FROM audits WHERE ts >= %s ORDER BY id DESC LIMIT %s",
                            (since if since is not None else -math.inf, limit))

    def count(self) -> int:
        return int(self._select("SELECT COUNT(*) AS n FROM incidents", ())[0]["n"])

    def rows(self, limit: int = 1000, since: float | None = None) -> list[dict[str, Any]]:
        """The newest `limit` rows (at or after `since`, a Unix time), newest first."""
        return self._select("SELECT * FROM incidents WHERE ts >= %s ORDER BY id DESC LIMIT %s",
                            (since if since is not None else -math.inf, limit))

    def get(self, incident_id: int) -> dict[str, Any] | None:
        found = self._select("SELECT * FROM incidents WHERE id = %s", (incident_id,))
        return found[0] if found else None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()


def _safe(url: str) -> str:
    """The URL without its password (for error messages and logs)."""
    try:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.password:
            return url.replace(f":{parts.password}@", ":***@", 1)
    except ValueError:
        pass
    return url
