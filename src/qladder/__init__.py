"""qladder: a precision ladder for serving quantized LLMs safely.

Layer 1 `sanitize`, layer 2 `StepGuard` + `Ladder` (rollback and mid-generation handoff by
token ids), on engines that step one token at a time (`load_engine`: int4, w4a16, fp32, bf16);
`ServingEngine`, the continuous-batching `EngineClient` that `qladder serve` runs.
"""

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
from qladder.faults import Fault, parse_fault
from qladder.health import GUARD_PRESETS, GuardConfig, StepGuard
from qladder.incidents import Incident, IncidentStore
from qladder.ladder import Ladder, LadderConfig
from qladder.policy import LadderPolicy
from qladder.sampling import SamplingParams
from qladder.sanitize import SanitizeConfig, SanitizeResult, sanitize
from qladder.service import Qladder
from qladder.serving.engine import ServingConfig, ServingEngine
from qladder.types import FinishReason, GenerationResult, Handoff, Hazard

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
]
