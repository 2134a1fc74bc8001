"""The incident store's schema, once for both dialects: what an incident is, the two tables'
columns (each with one portable type, rendered per dialect), their indexes, the columns added
since the first release (migrated on open), and a row's values in column order.

    ddl("sqlite")        CREATE TABLE/INDEX statements for incidents.py's SQLite store
    ddl("postgresql")    the same for incidents_pg.py's (and its ADD COLUMN IF NOT EXISTS)
    INCIDENT_COLUMNS, AUDIT_COLUMNS    the insertable columns (all but the id), in table order
    incident_row, audit_row            a record's values in that order
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from qladder.audit import AuditRecord
from qladder.types import Hazard

# a column: (name, portable type, constraint); the types each dialect renders
TYPES = {"sqlite": {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL", "int": "INTEGER", "text": "TEXT"},
         "postgresql": {"id": "BIGSERIAL PRIMARY KEY", "real": "DOUBLE PRECISION", "int": "INTEGER",
                        "text": "TEXT"}}
TABLES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "incidents": (("id", "id", ""), ("ts", "real", "NOT NULL"), ("request_id", "text", "NOT NULL"),
                  ("prompt_hash", "text", "NOT NULL"), ("prompt_text", "text", ""), ("prompt_ids", "text", "NOT NULL"),
                  ("rung", "text", "NOT NULL"), ("step", "int", "NOT NULL"), ("check_name", "text", "NOT NULL"),
                  ("layer", "int", ""), ("value", "real", ""), ("threshold", "real", ""),
                  ("action", "text", "NOT NULL"), ("handoff_latency_ms", "real", ""), ("faults", "text", "NOT NULL"),
                  ("detail", "text", "NOT NULL")),
    "audits": (("id", "id", ""), ("ts", "real", "NOT NULL"), ("request_id", "text", "NOT NULL"),
               ("prompt_class", "text", "NOT NULL"), ("pool", "text", "NOT NULL"), ("tokens", "int", "NOT NULL"),
               ("agreement", "real", "NOT NULL"), ("first_divergence", "int", ""), ("kl_top5", "real", "NOT NULL"),
               ("fp32_gap", "real", "NOT NULL"), ("source", "text", "NOT NULL DEFAULT 'audit'"),
               ("excess", "real", "")),
}
INDEXES = (("incidents_prompt", "incidents", "prompt_hash"), ("incidents_ts", "incidents", "ts"),
           ("audits_ts", "audits", "ts"))
ADDED = (("audits", "source"), ("audits", "excess"))  # columns a store made before them lacks (migrated on open)


def _columns(table: str) -> str:
    return ", ".join(name for name, kind, _ in TABLES[table] if kind != "id")


INCIDENT_COLUMNS = _columns("incidents")
AUDIT_COLUMNS = _columns("audits")
INCIDENT_WIDTH = len(INCIDENT_COLUMNS.split(","))
AUDIT_WIDTH = len(AUDIT_COLUMNS.split(","))


def column_ddl(table: str, column: str, dialect: str) -> str:
    """`name TYPE constraint` of one column in a dialect."""
    name, kind, constraint = next(c for c in TABLES[table] if c[0] == column)
    return f"{name} {TYPES[dialect][kind]} {constraint}".strip()


def ddl(dialect: str) -> str:
    """The schema's statements in `dialect` ("sqlite" or "postgresql"), idempotent (IF NOT EXISTS)."""
    out = []
    for table, columns in TABLES.items():
        body = ",\n".join(f"    {column_ddl(table, c[0], dialect)}" for c in columns)
        out.append(f"CREATE TABLE IF NOT EXISTS {table} (\n{body}\n);")
    if dialect == "postgresql":  # (SQLite has no ADD COLUMN IF NOT EXISTS: incidents.py reads table_info)
        out += [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {column_ddl(t, c, dialect)};" for t, c in ADDED]
    out += [f"CREATE INDEX IF NOT EXISTS {name} ON {table}({column});" for name, table, column in INDEXES]
    return "\n".join(out) + "\n"


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


def storable(text: str | None) -> str | None:
    """The raw prompt is kept for replay, but SQLite takes only valid UTF-8: a lone surrogate
    (which a client can send in JSON) is stored as its escape, `\\ud800`."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
