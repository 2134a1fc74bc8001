"""Settings read from the environment, in one place. Tests pass their own values instead."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # dequantized weights and tokenizer files for the torch rungs
    n_threads: int  # per engine; on 2 shared cores one thread each is fastest
    n_ctx: int
    int4_monitor: bool = True  # build llama.cpp's C activation monitor for the int4 rung

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        base = e.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return cls(
            cache_dir=Path(e.get("QLADDER_CACHE_DIR") or Path(base) / "qladder"),
            n_threads=int(e.get("QLADDER_THREADS", "1")),
            n_ctx=int(e.get("QLADDER_N_CTX", "2048")),
            int4_monitor=e.get("QLADDER_INT4_MONITOR", "1") not in ("0", "false", "no"),
        )
