"""qladder: a precision ladder for serving quantized LLMs safely.

Layer 1 `sanitize`, layer 2 `StepGuard` + `Ladder` (rollback and mid-generation handoff by
token ids), on engines that step one token at a time (`load_engine`: int4, w4a16, fp32, bf16);
`ServingEngine`, the continuous-batching `EngineClient` that `qladder serve` runs.

The names below load on first use (PEP 562): `import qladder.client` or `import qladder.server`
does not import every engine, and serving a request without faults never imports the fault
models (`qladder.testing.faults`, test machinery).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# `sanitize` names both a function here and a submodule: loading the submodule sets this
# attribute to the module, so the function is bound eagerly (the module needs only the standard
# library), before anything else can load it.
from qladder.sanitize import sanitize

_HOME = {
    "EngineClient": "qladder.client",
    "Request": "qladder.client",
    "RUNGS": "qladder.engines",
    "load_engine": "qladder.engines",
    "ConfigError": "qladder.errors",
    "EngineError": "qladder.errors",
    "InputError": "qladder.errors",
    "ModelError": "qladder.errors",
    "QladderError": "qladder.errors",
    "TokenizerMismatchError": "qladder.errors",
    "Fault": "qladder.testing.faults",
    "parse_fault": "qladder.testing.faults",
    "GUARD_PRESETS": "qladder.health",
    "GuardConfig": "qladder.health",
    "StepGuard": "qladder.health",
    "Incident": "qladder.incidents",
    "IncidentStore": "qladder.incidents",
    "Ladder": "qladder.ladder",
    "LadderConfig": "qladder.ladder",
    "LadderPolicy": "qladder.policy",
    "SamplingParams": "qladder.sampling",
    "SanitizeConfig": "qladder.sanitize",
    "SanitizeResult": "qladder.sanitize",
    "sanitize": "qladder.sanitize",
    "Qladder": "qladder.service",
    "ServingConfig": "qladder.serving.engine",
    "ServingEngine": "qladder.serving.engine",
    "FinishReason": "qladder.types",
    "GenerationResult": "qladder.types",
    "Handoff": "qladder.types",
    "Hazard": "qladder.types",
}

__all__ = [
    "GUARD_PRESETS",
    "RUNGS",
    "ConfigError",
    "EngineClient",
    "EngineError",
    "Fault",
    "FinishReason",
    "GenerationResult",
    "GuardConfig",
    "Handoff",
    "Hazard",
    "Incident",
    "IncidentStore",
    "InputError",
    "Ladder",
    "LadderConfig",
    "LadderPolicy",
    "ModelError",
    "Qladder",
    "QladderError",
    "Request",
    "SamplingParams",
    "SanitizeConfig",
    "SanitizeResult",
    "ServingConfig",
    "ServingEngine",
    "StepGuard",
    "TokenizerMismatchError",
    "load_engine",
    "parse_fault",
    "sanitize",
]  # the names of _HOME (tests/test_units.py keeps them equal)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'qladder' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


if TYPE_CHECKING:
    from qladder.client import EngineClient, Request
    from qladder.engines import RUNGS, load_engine
    from qladder.errors import (
        ConfigError,
        EngineError,
        InputError,
        ModelError,
        QladderError,
        TokenizerMismatchError,
    )
    from qladder.health import GUARD_PRESETS, GuardConfig, StepGuard
    from qladder.incidents import Incident, IncidentStore
    from qladder.ladder import Ladder, LadderConfig
    from qladder.policy import LadderPolicy
    from qladder.sampling import SamplingParams
    from qladder.sanitize import SanitizeConfig, SanitizeResult
    from qladder.service import Qladder
    from qladder.serving.engine import ServingConfig, ServingEngine
    from qladder.testing.faults import Fault, parse_fault
    from qladder.types import FinishReason, GenerationResult, Handoff, Hazard
