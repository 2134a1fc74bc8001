"""Serving: many requests at once on the INT4 pool, handoffs to a shared standby, one client API."""

from qladder.client import EngineClient
from qladder.serving.engine import ServingConfig, ServingEngine
from qladder.serving.scheduler import SchedulerConfig

__all__ = ["EngineClient", "SchedulerConfig", "ServingConfig", "ServingEngine"]
