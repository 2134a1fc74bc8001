"""Layer 2 of defence: the health checks run after every decode step."""

from qladder.health.guard import GUARD_PRESETS, GuardConfig, StepGuard
from qladder.health.repetition import find_repetition

__all__ = ["GUARD_PRESETS", "GuardConfig", "StepGuard", "find_repetition"]
