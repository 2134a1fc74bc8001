"""Child server processes (llama-server, `qladder serve` in the benchmark and tests): a free port,
waiting until the server answers, and stopping it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx


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
