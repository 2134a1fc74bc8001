"""Settings read from the environment, in one place, and the `knob` every config field is declared
with (its one-line doc, which docs/CONFIG.md and the CLI's help are generated from:
qladder.server.config_reference). Tests pass their own values instead of the environment.

Every `QLADDER_*` variable any module reads is a field of `Settings` (its `env` metadata names it);
tests/test_config_reference.py fails on a variable read anywhere else."""

from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def knob(default: T, doc: str, **metadata: Any) -> T:
    """A dataclass field with its default and its one-line doc (what it is, and what it trades)."""
    return field(default=default, metadata={"doc": doc, **metadata})


def doc_of(cls: type, name: str) -> str:
    """The doc a config field was declared with (KeyError: a field without one)."""
    f = {f.name: f for f in fields(cls)}[name]
    return str(f.metadata["doc"])


def default_of(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Settings:
    """The process's environment: where caches and peer servers are, threads, context."""

    cache_dir: Path = knob(Path("~/.cache/qladder"),
                           "dequantized weights, tokenizer files, quantized levels and built servers "
                           "(default: $XDG_CACHE_HOME/qladder, else ~/.cache/qladder)", env="QLADDER_CACHE_DIR")
    n_threads: int = knob(1, "threads per engine for `qladder generate`, bench and validate (serve takes "
                             "[cores]); on 2 shared cores one thread each is fastest", env="QLADDER_THREADS")
    n_ctx: int = knob(2048, "the context of engines built outside serve ([model] n_ctx there)", env="QLADDER_N_CTX")
    int4_monitor: bool = knob(True, "build llama.cpp's C activation monitor for the INT4 rung (0: headroom "
                                    "is not checked, the other guards are)", env="QLADDER_INT4_MONITOR")
    llama_server: str = knob("", "the llama-server binary peers start (default: the venv's bin, where make "
                                 "install links it, then PATH)", env="QLADDER_LLAMA_SERVER")
    vllm_python: str = knob("", "the Python of vLLM's own venv (default: the one scripts/vllm.sh made under "
                                "vllm_cache)", env="QLADDER_VLLM_PYTHON")
    vllm_cache: str = knob("", "where scripts/vllm.sh builds vLLM's venv (default: ~/.cache/qladder/vllm)",
                           env="QLADDER_VLLM_CACHE")
    serve_worker: str = knob("", "set by `qladder serve --workers` for its own processes (the folder a worker "
                                 "reads what it builds from); not an operator's setting", env="QLADDER_SERVE_WORKER",
                             internal=True)
    serve_supervisor: str = knob("", "set by `qladder serve --workers` for its own processes (the supervisor's "
                                     "pid); not an operator's setting", env="QLADDER_SERVE_SUPERVISOR", internal=True)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = e.get(f.metadata["env"])
            if not raw:
                continue
            kind = type(default_of(f))
            values[f.name] = _flag(raw) if kind is bool else kind(raw)
        if "cache_dir" not in values:
            base = e.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
            values["cache_dir"] = Path(base) / "qladder"
        return cls(**values)


def env_name(name: str) -> str:
    """The environment variable behind Settings field `name`."""
    return str({f.name: f for f in fields(Settings)}[name].metadata["env"])
