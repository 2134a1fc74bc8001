"""Engines: the rungs of the ladder. `load_engine(rung)` builds one on the model file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qladder.config import Settings
from qladder.engines.base import Engine, Session, StepOutput, check_handoff, tokenizer_fingerprint
from qladder.errors import ConfigError
from qladder.model import ModelInfo, inspect_model

RUNGS = ("int4", "w4a16", "fp32", "bf16")

__all__ = ["RUNGS", "Engine", "Session", "StepOutput", "check_handoff", "check_rungs", "instrument", "load_engine",
           "tokenizer_fingerprint"]


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
    if rung == "int4":
        from qladder.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(info, n_ctx=s.n_ctx, n_threads=s.n_threads,
                              monitor_dir=s.cache_dir if s.int4_monitor else None)
    from qladder.engines.torch_engine import TorchEngine

    return TorchEngine(info, rung, cache_dir=s.cache_dir, n_ctx=s.n_ctx, n_threads=s.n_threads)
