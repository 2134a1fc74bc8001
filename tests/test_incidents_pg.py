"""The incident store's two backends on one contract: SQLite (the default) and a real PostgreSQL
server started for these tests (qladder/peers/stores.py). Both keep the same rows; two gateways'
writers on one PostgreSQL table lose none."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from qladder.audit import AuditRecord
from qladder.incident_schema import ADDED, AUDIT_COLUMNS, TABLES, column_ddl
from qladder.incidents import Incident, IncidentStore, IncidentWriter, open_incident_store
from qladder.peers.stores import PostgresServer
from qladder.types import Hazard


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer().start()
    yield server
    server.close()


def _fresh(postgres: PostgresServer, name: str) -> str:
    """A database of this test's own on the module's server (the tables start empty)."""
    import psycopg

    with psycopg.connect(postgres.url, autocommit=True) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}"')
        db.execute(f'CREATE DATABASE "{name}"')
    return postgres.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path, postgres):
    if request.param == "sqlite":
        return str(tmp_path / "incidents.sqlite3")
    return _fresh(postgres, f"contract_{abs(hash(request.node.name)) % 10**8}")


def _incident(k: int, ts: float, text: str = "hello", value: float = float("nan"), gateway: str = "a") -> Incident:
    return Incident(f"{gateway}-{k}", f"fp{k % 7}", [1, 2, k], text,
                    Hazard("nonfinite", "int4", k, value, float("inf"), layer=3, detail=f"row {k}"),
                    "handoff:fp32", 3.5, ["nan@step=1"], ts)


def test_both_stores_keep_the_same_rows(store_target, tmp_path):
    """The contract: what one backend gives back, the other does (every column but the prompt's
    text, which differs only in a NUL: PostgreSQL's text cannot hold one), NaN and inf as text in
    the columns SQLite keeps so, a lone surrogate escaped, a redacted store keeping only the
    fingerprint."""
    t0 = 1_700_000_000.0
    odd = "a\x00b \ud800 \u00e9"
    incs = [_incident(0, t0), _incident(1, t0 + 1, odd, float("-inf")), _incident(2, t0 + 2, value=2.5)]
    store = open_incident_store(store_target)
    store.record_many(incs)
    store.record_audits([AuditRecord("r0", "normal", "int4", 32, 0.875, 28, 0.01, -0.5, ts=t0, excess=0.75)])
    rows = store.rows()
    assert store.count() == 3 and [r["request_id"] for r in rows] == ["a-2", "a-1", "a-0"]
    assert rows[2]["value"] == "nan" and rows[2]["threshold"] == "inf" and rows[1]["value"] == "-inf"
    assert rows[0]["value"] == 2.5 and rows[0]["layer"] == 3 and json.loads(rows[0]["prompt_ids"]) == [1, 2, 2]
    # a lone surrogate kept as its escape by both; a NUL kept as is by SQLite, as `\\x00` by PostgreSQL
    nul = "\\x00" if store_target.startswith("postgresql://") else "\x00"
    assert rows[1]["prompt_text"] == f"a{nul}b \\ud800 \u00e9"
    assert store.get(rows[1]["id"]) == rows[1] and store.get(10**9) is None
    assert [r["request_id"] for r in store.rows(limit=5, since=t0 + 1)] == ["a-2", "a-1"]
    (audit,) = store.audits()
    assert audit["agreement"] == 0.875 and audit["first_divergence"] == 28 and audit["source"] == "audit"
    assert audit["excess"] == 0.75
    store.close()
    # the same through the other backend
    other = IncidentStore(tmp_path / "other.sqlite3")
    other.record_many(incs)
    strip = [{k: v for k, v in r.items() if k != "prompt_text"} for r in other.rows()]
    assert strip == [{k: v for k, v in r.items() if k != "prompt_text"} for r in rows]
    other.close()
    redacted = open_incident_store(store_target, redact=True)
    redacted.record_many([_incident(9, t0 + 9)])
    row = redacted.rows(1)[0]
    assert row["prompt_text"] is None and row["prompt_ids"] == "null" and row["prompt_hash"] == "fp2"
    redacted.close()


def test_postgres_keeps_a_nul_as_its_escape(postgres):
    store = open_incident_store(_fresh(postgres, "nul"))
    store.record_many([_incident(0, time.time(), "x\x00y")])
    assert store.rows()[0]["prompt_text"] == "x\\x00y"
    store.close()


def test_two_gateways_writing_at_once_lose_no_row(postgres):
    """Two writers (two gateways' stores and writer threads), started together on a new database
    (both create the schema), 400 incidents each enqueued from 4 threads: all 800 rows are there,
    each once, and each writer counts what it committed."""
    url = _fresh(postgres, "two_writers")
    stores: list = [None, None]

    def open_store(k: int) -> None:
        stores[k] = open_incident_store(url)

    openers = [threading.Thread(target=open_store, args=(k,)) for k in range(2)]
    for th in openers:
        th.start()
    for th in openers:
        th.join(30)
    writers = [IncidentWriter(s) for s in stores]

    def send(w: IncidentWriter, gateway: str, start: int) -> None:
        for k in range(start, start + 100):
            w(_incident(k, time.time(), gateway=gateway))

    senders = [threading.Thread(target=send, args=(writers[g], "ab"[g], 100 * j)) for g in range(2) for j in range(4)]
    for th in senders:
        th.start()
    for th in senders:
        th.join(60)
    for w in writers:
        w.close(60)
    assert [w.dropped for w in writers] == [0, 0] and [w.committed for w in writers] == [400, 400]
    rows = stores[0].rows(limit=10_000)
    ids = sorted(r["request_id"] for r in rows)
    assert len(rows) == 800 and ids == sorted(f"{g}-{k}" for g in "ab" for k in range(400))
    assert len({r["id"] for r in rows}) == 800
    for s in stores:
        s.close()


def test_the_incidents_cli_reads_postgres(postgres):
    from qladder.cli import app

    url = _fresh(postgres, "cli")
    store = open_incident_store(url)
    store.record_many([_incident(k, 1_700_000_000.0 + k) for k in range(3)])
    store.close()
    runner = CliRunner()
    listed = runner.invoke(app, ["incidents", "list", "--db", url, "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["request_id"] for r in rows] == ["a-2", "a-1", "a-0"]
    shown = runner.invoke(app, ["incidents", "show", str(rows[0]["id"]), "--db", url])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["detail"] == "row 2"
    missing = runner.invoke(app, ["incidents", "list", "--db", "postgresql://qladder@127.0.0.1:1/none"])
    assert missing.exit_code != 0 and "cannot reach the incident database" in missing.stderr


def test_a_batch_after_a_postgres_restart_is_written_on_a_new_connection():
    """The server restarted between two batches: the writer's connection is dead, the batch is
    tried again on a new one (nothing of it had been committed), and no row is lost."""
    server = PostgresServer().start()
    try:
        store = open_incident_store(server.url)
        store.record_many([_incident(0, time.time())])
        server.stop()
        server.start()
        store.record_many([_incident(1, time.time())])
        assert sorted(r["request_id"] for r in store.rows()) == ["a-0", "a-1"]
        store.close()
    finally:
        server.close()


def test_a_store_made_before_the_added_columns_is_migrated_on_open(store_target):
    """One schema for both dialects (incident_schema.py): a store whose audits table predates the
    columns added since (source, excess) gains them on open, and both stores end with the
    schema's columns in its order."""
    dialect = "postgresql" if store_target.startswith("postgresql") else "sqlite"
    kept = [c[0] for c in TABLES["audits"] if ("audits", c[0]) not in ADDED]
    old = f"CREATE TABLE audits ({', '.join(column_ddl('audits', c, dialect) for c in kept)})"
    if dialect == "sqlite":
        import sqlite3

        with sqlite3.connect(store_target) as db:
            db.execute(old)
    else:
        import psycopg

        with psycopg.connect(store_target, autocommit=True) as db:
            db.execute(old)
    store = open_incident_store(store_target)
    try:
        store.record_audits([AuditRecord("r1", "qa", "int4", 8, 0.875, 3, 0.01, 0.2, 1.0, excess=-0.5)])
        (row,) = store.audits()
    finally:
        store.close()
    assert list(row) == ["id", *AUDIT_COLUMNS.split(", ")]
    assert row["source"] == "audit" and row["excess"] == -0.5 and row["agreement"] == 0.875
