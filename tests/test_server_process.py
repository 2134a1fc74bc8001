"""`qladder serve` as its own process: a graceful drain on SIGTERM, and an incident store that a
kill -9 in the middle of a faulted load leaves readable, with every committed row still there."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from qladder.peers.process import start_qladder_serve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    cfg = tmp_path / "qladder.toml"
    cfg.write_text("[server]\ndrain_timeout_s = 30\n")
    return start_qladder_serve(cfg, tmp_path / "serve.log", ["--log-level", "warning", *args],
                               ready_timeout_s=120)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_sigterm_stops_admitting_drains_the_open_stream_and_exits_0(tmp_path):
    proc, base = _start(tmp_path, "--incidents", str(tmp_path / "i.sqlite3"))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                "max_tokens": 96, "temperature": 0, "stream": True}
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.Client(timeout=120) as h, h.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60), "the stream sent nothing in 60 s"
        at_signal = len(lines)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the listening socket closes: nothing new is admitted
            try:
                refused = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False},
                                     timeout=5).status_code == 503  # draining, as the gateway says it
            except httpx.TransportError:
                refused = True  # as the closed socket says it
            if refused:
                break
            assert time.monotonic() < deadline, "still admitting requests 30 s after SIGTERM"
            time.sleep(0.05)
        t.join(120)
        assert not t.is_alive(), "the open stream did not end within 120 s of the drain"
        assert proc.wait(60) == 0
    finally:
        _end(proc)
    assert lines[-1] == "data: [DONE]"  # the in-flight answer was finished, not cut
    # It was still streaming when the signal came (a drain, not an answer that had already ended).
    assert len(lines) > at_signal + 8, (at_signal, len(lines))
    assert '"finish_reason":"length"' in next(x for x in reversed(lines) if "finish_reason\":\"" in x)


def test_kill_9_during_a_faulted_load_loses_no_committed_incident(tmp_path):
    db = tmp_path / "i.sqlite3"
    proc, base = _start(tmp_path, "--incidents", str(db), "--allow-faults")
    stop = threading.Event()
    errors: list[str] = []

    def load(k: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as h:
            while not stop.is_set():
                n += 1
                body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Client {k} asks question {n}."}],
                        "qladder": {"faults": ["nan@step=2"]}}
                try:
                    h.post(f"{base}/v1/chat/completions", json=body)
                except httpx.TransportError as exc:  # the kill
                    errors.append(repr(exc))
                    return

    threads = [threading.Thread(target=load, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    seen: set[int] = set()
    try:
        reader = sqlite3.connect(db, timeout=10)
        deadline = time.monotonic() + 120
        while len(seen) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
            seen |= {r[0] for r in reader.execute("SELECT id FROM incidents")}
        reader.close()
        proc.send_signal(signal.SIGKILL)  # mid-load: requests in flight, the writer thread busy
        proc.wait(30)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        _end(proc)
    assert len(seen) >= 8
    after = sqlite3.connect(db)
    assert after.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    ids = {r[0] for r in after.execute("SELECT id FROM incidents")}
    assert seen <= ids  # every row committed before the kill is still there
    checks = {r[0] for r in after.execute("SELECT check_name FROM incidents")}
    assert checks == {"nonfinite"}
