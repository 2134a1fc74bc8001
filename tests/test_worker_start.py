"""A gateway worker before its server is built (server/serve.worker_app): a stop that uvicorn's
handler took while the module was imported ends it before it builds, and a worker retrying its
build ends when the supervisor named in its environment is gone. In-process, with the real signal
table; the whole command's SIGTERM and kill tests are in test_workers.py."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from qladder.server import serve


class HeldHandler:
    """Stands for uvicorn's Server: its handler only sets `should_exit`."""

    def __init__(self) -> None:
        self.should_exit = False

    def handle(self, sig: int, frame: object) -> None:
        self.should_exit = True


@pytest.fixture
def signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_stop_taken_by_uvicorns_handler_before_the_build_ends_the_worker(tmp_path, monkeypatch, signals):
    """No topology in the folder: a worker that went on to build would fail its start (exit 3);
    the flag its held handler set ends it first, with 0, and the handler is put back."""
    held = HeldHandler()
    signal.signal(signal.SIGTERM, held.handle)
    signal.signal(signal.SIGINT, held.handle)
    monkeypatch.setenv(serve.WORKER_ENV, str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        serve.worker_app()
    assert stopped.value.code == 3 and (tmp_path / "failed.txt").exists()  # not stopped: it tried
    signal.raise_signal(signal.SIGTERM)
    assert held.should_exit
    with pytest.raises(SystemExit) as stopped:
        serve.worker_app()
    assert stopped.value.code == 0
    assert signal.getsignal(signal.SIGTERM) == held.handle


def test_a_retrying_worker_ends_when_its_supervisor_is_gone(tmp_path, monkeypatch, signals):
    """After the gateway served (the started marker), a worker that cannot build retries; the
    supervisor's pid in its environment is not its parent any more: it exits 0 after one wait."""
    (tmp_path / "started").touch()
    monkeypatch.setenv(serve.WORKER_ENV, str(tmp_path))
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        if len(waits) > 3:
            raise AssertionError(f"still retrying after {waits}")

    monkeypatch.setattr(time, "sleep", sleep)
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setenv(serve.SUPERVISOR_ENV, str(gone.pid))  # a supervisor that has exited
    with pytest.raises(SystemExit) as stopped:
        serve.worker_app()
    assert stopped.value.code == 0 and waits == [1.0]
    waits.clear()
    import os

    monkeypatch.setenv(serve.SUPERVISOR_ENV, str(os.getppid()))  # the supervisor is there: it retries
    with pytest.raises(AssertionError, match="still retrying"):
        serve.worker_app()
    assert waits == [1.0, 2.0, 4.0, 8.0]
