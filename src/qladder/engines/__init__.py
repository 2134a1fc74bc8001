"""Engines: the rungs of the ladder. `load_engine(rung)` builds one on the model file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qladder.config import Settings
from qladder.engines.base import Engine, Session, StepOutput, check_handoff, tokenizer_fingerprint
from qladder.errors import ConfigError
from qladder.model import ModelInfo, inspect_model

RUNGS = ("int4", "int8", "w4a16", "fp32", "bf16")
# llama.cpp rungs: the model file as given, or that model quantized to Q8_0 (qladder.levels) by
# llama.cpp's quantizer from its full-precision weights, made once into the cache
LLAMA_RUNGS = {"int4": None, "int8": "Q8_0"}

__all__ = ["LLAMA_RUNGS", "RUNGS", "Engine", "Session", "StepOutput", "check_handoff", "check_rungs", "instrument",
           "level_info", "load_engine", "tokenizer_fingerprint"]


def check_rungs(rungs: Sequence[str]) -> None:
    """Raise ConfigError naming the first of `rungs` that is not a rung (before any model loads)."""
    for r in rungs:
        if r not in RUNGS:
            raise ConfigError(f"unknown rung {r!r}; choose from {', '.join(RUNGS)}")


def instrument(engine: Engine, activations: bool, row_stats: bool) -> None:
    """Switch an engine's guard instruments: activation monitors, and row statistics computed with
    the logits copy (`Engine.instrument`). A single-sequence engine is used by one request at a
    time, so each (or a naive loop) sets what it needs."""
    engine.instrument(activations, row_stats)


def level_info(info: ModelInfo, rung: str, settings: Settings) -> ModelInfo:
    """The model file a llama.cpp rung loads: `info`'s own for int4, its Q8_0 level for int8."""
    level = LLAMA_RUNGS[rung]
    if level is None:
        return info
    from qladder.levels import level_gguf

    return inspect_model(level_gguf(info, level, settings.cache_dir, threads=settings.n_threads), settings.cache_dir)


def load_engine(
    rung: str, model: ModelInfo | str | Path | None = None, settings: Settings | None = None
) -> Engine:
    """Load one rung on a GGUF (default: the embedded model). Raises ConfigError or ModelError."""
    check_rungs([rung])
    s = settings or Settings.from_env()
    info = model if isinstance(model, ModelInfo) else inspect_model(model, s.cache_dir)
    # torch's intra-op pool, even when torch only runs the guard's reductions beside llama.cpp:
    # a second spinning OpenMP thread steals the core the other engine decodes on.
    import torch

    torch.set_num_threads(s.n_threads)
    if rung in LLAMA_RUNGS:
        from qladder.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(level_info(info, rung, s), n_ctx=s.n_ctx, n_threads=s.n_threads,
                              monitor_dir=s.cache_dir if s.int4_monitor else None, name=rung)
    from qladder.engines.torch_engine import TorchEngine

    return TorchEngine(info, rung, cache_dir=s.cache_dir, n_ctx=s.n_ctx, n_threads=s.n_threads)
