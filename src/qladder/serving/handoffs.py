"""Where a request goes when it leaves a pool for rung j: the pool that owns rung j.

    handoffs = Handoffs({1: standby_pool, 2: remote_pool})
    handoffs.submit(m, MoveTo(2))      the machine now belongs to that pool (its handoff's latency
                                       runs from m.left_at)

Every pool that runs rungs (the INT4 scheduler, the in-process standby, the remote pool) sends
its leavers here, so a ladder can mix in-process and remote rungs in any order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from qladder.actions import Leave
from qladder.errors import ConfigError
from qladder.machine import RequestMachine


class RungPool(Protocol):
    def submit(self, m: RequestMachine, action: Leave) -> None:
        """Take over the request (the caller gives it up); QueueFullError when full."""
        ...


class Handoffs:
    def __init__(self, pools: Mapping[int, RungPool]):
        self.pools = dict(pools)

    def submit(self, m: RequestMachine, action: Leave) -> None:
        pool = self.pools.get(action.rung)
        if pool is None:
            raise ConfigError(f"no pool runs rung {action.rung} ({m.rungs})")
        pool.submit(m, action)
