"""Where a new request starts: the INT4 pool, or the full-precision standby.

    route = router.route(fingerprint, standby_free=stats_say_so)

In order:
1. A quarantined prompt (it caused a hazard on INT4 within the TTL) starts on the standby.
2. Otherwise the pools' weights pick one, by smooth weighted round-robin (deterministic: over any
   window of W requests, each pool gets its weight's share, without randomness in tests).
   A weight-routed request goes to the standby only while the standby has a free session: its
   capacity is reserved for handoffs and quarantined prompts first.
3. A pool the engine reports down (`down`: a remote server that stopped answering, until its
   /health answers again) is passed over without asking its breaker, so no half-open probe is
   spent on a server that is known to be away.
4. The chosen pool's breaker may refuse (open, or half-open with its probes out): the request
   goes to the next pool that admits it. No pool admits: `AllPoolsOpen` (the server answers 503).

One lock guards the round-robin credits; breakers and quarantine have their own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from qladder.errors import AllPoolsOpen
from qladder.server.breaker import Breaker
from qladder.server.quarantine import Quarantine
from qladder.server.topology import PoolConfig


@dataclass(frozen=True)
class Route:
    pool: str
    start_rung: int  # index into the engine's ladder: 0 = INT4, 1 = the standby's first rung
    reason: str  # weight | quarantine | breaker:<pool> | down:<pool> (the pool passed over)


class Router:
    def __init__(self, pools: tuple[PoolConfig, ...], breakers: dict[str, Breaker], quarantine: Quarantine):
        self.pools = [p for p in pools if p.kind == "int4"] + [p for p in pools if p.kind == "standby"]
        self.start_rung = {p.name: (0 if p.kind == "int4" else 1) for p in self.pools}
        self.breakers = breakers
        self.quarantine = quarantine
        self._credit = dict.fromkeys(self.start_rung, 0.0)
        self._lock = threading.Lock()

    def _by_weight(self, standby_free: bool) -> PoolConfig:
        with self._lock:
            eligible = [p for p in self.pools if p.weight > 0 and (p.kind == "int4" or standby_free)]
            if not eligible:
                return self.pools[0]
            total = sum(p.weight for p in eligible)
            for p in eligible:
                self._credit[p.name] += p.weight
            best = max(eligible, key=lambda p: self._credit[p.name])
            self._credit[best.name] -= total
            return best

    def route(self, fingerprint: str, standby_free: bool, down: frozenset[str] = frozenset()) -> Route:
        standby = next((p for p in self.pools if p.kind == "standby"), None)
        if standby is not None and self.quarantine.contains(fingerprint):
            first, reason = standby, "quarantine"
        else:
            first, reason = self._by_weight(standby_free), "weight"
        order = [first, *(p for p in self.pools if p is not first)]
        refused: list[str] = []
        for p in order:
            if p.name in down and p is not order[-1]:
                refused.append(f"down:{p.name}")
                continue
            if self.breakers[p.name].allow():
                if not refused:
                    return Route(p.name, self.start_rung[p.name], reason)
                first_out = refused[0]
                why = first_out if first_out.startswith("down:") else f"breaker:{first_out}"
                return Route(p.name, self.start_rung[p.name], why)
            refused.append(p.name)
        raise AllPoolsOpen(f"every pool's circuit breaker is open ({', '.join(refused)})")
