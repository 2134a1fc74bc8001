"""Child server processes (llama-server, `qladder serve` in the benchmark, the remote validation and
the tests): a free port, waiting until the server answers, stopping it, and the one way
`qladder serve` is started as a child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from qladder.errors import EngineError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, poll_s: float = 0.1) -> str | None:
    """Poll `url` until it answers 200. None when it does; else why not (the child exited, or the
    timeout passed), for the caller's own error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode} at start"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return None
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    return f"was not ready within {timeout_s:.0f} s"


def stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0, group: bool = False) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; reaped either way. group: the
    child leads a process group of its own (start_new_session) and its children are signalled too."""
    if proc is None:
        return

    def send(sig: signal.Signals) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    if proc.poll() is not None and not group:
        return
    send(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout_s)
    if group:  # the leader is gone; its children may linger
        time.sleep(0.2)
        send(signal.SIGKILL)


def start_qladder_serve(config: Path, log: Path, args: Sequence[str] = (), port: int | None = None,
                        ready_timeout_s: float = 180.0) -> tuple[subprocess.Popen[bytes], str]:
    """`qladder serve --config CONFIG` as a child of this Python on 127.0.0.1 (a free port unless
    given), its stdout and stderr in `log`; returns it and its base URL once /readyz answers 200.
    Raises EngineError (with the log's tail) when it exits or is not ready in time; it is stopped."""
    port = port or free_port()
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "qladder", "serve", "--config", str(config), "--host",
                                 "127.0.0.1", "--port", str(port), *args], stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    why = wait_ready(proc, f"{base}/readyz", ready_timeout_s, poll_s=0.2)
    if why is not None:
        stop(proc, timeout_s=30.0)
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise EngineError(f"qladder serve ({config}) {why}; its log ({log}) ends:\n{tail}")
    return proc, base
