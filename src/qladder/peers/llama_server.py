"""llama.cpp's C++ `llama-server`, built by scripts/llama_server.sh from the llama.cpp sources
vendored in the llama-cpp-python sdist of the wheel's version, started as a child process.

    with LlamaServer(model_path, n_parallel=8, threads=1, n_ctx_per_slot=2048) as ls:
        httpx.post(f"{ls.base_url}/v1/chat/completions", json=...)

Thread counts are explicit (`-t`/`-tb`): on 2 cores llama.cpp is fastest with one thread a process
when another process is busy. `-c` is the total context, split across the `-np` slots.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from qladder.config import Settings
from qladder.errors import ConfigError, EngineError
from qladder.peers import process
from qladder.peers.process import free_port, wait_ready


def find_llama_server() -> Path:
    """$QLADDER_LLAMA_SERVER, else the venv's bin (make install links it there), else PATH."""
    env = Settings.from_env().llama_server
    candidates = [Path(env)] if env else []
    candidates.append(Path(sys.executable).with_name("llama-server"))
    found = shutil.which("llama-server")
    if found:
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ConfigError("llama-server is not built: run `make install` (scripts/llama_server.sh builds it) "
                      "or set QLADDER_LLAMA_SERVER")


class LlamaServer:
    def __init__(self, model_path: str | Path, n_parallel: int = 8, threads: int = 1, n_ctx_per_slot: int = 2048,
                 port: int | None = None, binary: Path | None = None, ready_timeout_s: float = 120.0):
        self.binary = binary or find_llama_server()
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(n_parallel), "-c", str(n_ctx_per_slot * n_parallel), "-t", str(threads),
                     "-tb", str(threads), "--no-webui"]
        self.n_parallel = n_parallel
        self.threads = threads
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def version(self) -> str:
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else "?"

    def start(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        why = wait_ready(self.proc, f"{self.base_url}/health", self.ready_timeout_s)
        if why is not None:
            self.stop()
            raise EngineError(f"llama-server {why} ({' '.join(self.args)})")
        return self

    def stop(self) -> None:
        process.stop(self.proc)
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
