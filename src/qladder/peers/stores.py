"""Real Redis and PostgreSQL servers for the tests and `qladder bench fleet`: each launched from
its installed binary (`scripts/servers.sh` installs them) on a free loopback port, in a temp dir
of its own, and stopped by whoever started it. Nothing here depends on a server started by hand."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from qladder.peers.process import free_port


def _binary(name: str) -> str:
    """`name` on PATH, or in Debian's versioned PostgreSQL folder (the newest)."""
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                      key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0, reverse=True)
    found = shutil.which(name) or next(iter(versions), None)
    if found is None:
        raise RuntimeError(f"{name} is not installed: run scripts/servers.sh (make install does)")
    return found


def _wait(ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s (stopped)")


class RedisServer:
    """redis-server on a free port, no persistence; `stop()` kills it (SIGKILL: as a crash) and
    `start()` starts it again on the same port (empty, as a restarted cache would be)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="qladder-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen([_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(self._pong, f"redis-server on port {self.port}", self.proc)
        return self

    def _pong(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """A throwaway PostgreSQL cluster (initdb, trust auth on loopback, fsync off) on a free port.
    PostgreSQL refuses to run as root: as root, its files and process belong to the `postgres`
    user that Debian's package creates."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="qladder-pg-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._user: str | None = None
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._user = "postgres"

    @property
    def url(self) -> str:
        return f"postgresql://qladder@127.0.0.1:{self.port}/postgres"

    def start(self) -> PostgresServer:
        data = self.dir / "data"
        if not data.exists():
            subprocess.run([_binary("initdb"), "-D", str(data), "-U", "qladder", "--auth=trust",
                            "-E", "UTF8", "--no-locale", "--no-sync"],
                           check=True, capture_output=True, cwd=self.dir, user=self._user, group=self._user)
        self.proc = subprocess.Popen([_binary("postgres"), "-D", str(data), "-p", str(self.port),
                                      "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                                      "-c", "max_connections=50"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir,
                                     user=self._user, group=self._user)
        _wait(self._ready, f"postgres on port {self.port}", self.proc)
        return self

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # a fast shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
