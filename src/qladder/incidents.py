"""Incident records in SQLite: every hazard, with the offending prompt for offline replay."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
"""


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


@dataclass
class Incident:
    request_id: str
    prompt_hash: str
    prompt_ids: list[int]
    prompt_text: str | None
    hazard: Hazard
    action: str  # handoff:<rung> | stop:<reason>
    handoff_latency_ms: float | None
    faults: list[str]
    ts: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hazard"] = self.hazard.to_dict()
        return d


IncidentSink = Callable[[Incident], None]


class IncidentStore:
    """An append-only SQLite table; safe to share between threads."""

    def __init__(self, path: str | Path = ":memory:"):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def __call__(self, incident: Incident) -> None:
        self.record(incident)

    def record(self, inc: Incident) -> None:
        h = inc.hazard
        row = (inc.ts or time.time(), _storable(inc.request_id), inc.prompt_hash, _storable(inc.prompt_text),
               json.dumps(inc.prompt_ids), h.rung, h.step, h.check, h.layer, _finite(h.value),
               _finite(h.threshold), inc.action, inc.handoff_latency_ms, json.dumps(inc.faults), _storable(h.detail))
        with self._lock:
            self._db.execute(
                "INSERT INTO incidents (ts, request_id, prompt_hash, prompt_text, prompt_ids, rung, step,"
                " check_name, layer, value, threshold, action, handoff_latency_ms, faults, detail)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", row)

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0])

    def rows(self, limit: int = 1000) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._db.execute("SELECT * FROM incidents ORDER BY id DESC LIMIT ?", (limit,))
            names = [c[0] for c in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._db.close()


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
