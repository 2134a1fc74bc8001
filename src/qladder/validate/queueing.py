"""The availability boundary: how much abnormal traffic the full-precision standby can absorb.

Topology (the write-up's 80/20): `servers` single-core engine workers, a share of them
(`standby_share`, default 20%) running the fp32 standby, the rest the int4 pool. The int4 pool is
loaded to `primary_util` of its capacity; every abnormal request that trips the guard hands its
tail to the standby, which then serves for `s_standby` seconds (measured: handoff catch-up plus
the fp32 decode of the rest of the answer).

The standby is an M/M/c queue with c standby workers fed at rate (abnormal share) x (arrival rate).
It saturates at utilization 1:

    arrival rate      lam   = primary_util * c_primary / s_primary
    standby load      a     = share * lam * s_standby              (Erlangs)
    saturation share  share* = c_standby / (lam * s_standby)
    wait probability  Erlang C(c, a);  mean wait  Wq = C(c, a) * s_standby / (c - a)

`simulate` replays the same queue as an M/G/c with service times drawn from the measured ones
(seeded), a check of the formula that does not assume exponential service. Everything here is
pure: no clock, no engine.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = lam * s (Erlangs).
    1.0 when the queue is unstable (a >= c)."""
    if c < 1:
        raise ValueError("c must be >= 1")
    if a < 0:
        raise ValueError("offered load must be >= 0")
    if a >= c:
        return 1.0
    if a == 0:
        return 0.0
    # Erlang B by the stable recurrence, then C = B / (1 - rho (1 - B)).
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho * (1.0 - b))


def mmc_wait(c: int, lam: float, s: float) -> float:
    """Mean time in queue (seconds) of an M/M/c queue; inf when unstable."""
    a = lam * s
    if a >= c:
        return math.inf
    return erlang_c(c, a) * s / (c - a)


@dataclass(frozen=True)
class StandbyModel:
    s_primary: float  # mean seconds of one request on the int4 pool
    s_standby: float  # mean seconds of standby work per handed-off request
    servers: int = 10
    standby_share: float = 0.2
    primary_util: float = 0.7

    @property
    def c_standby(self) -> int:
        return max(1, round(self.servers * self.standby_share))

    @property
    def c_primary(self) -> int:
        return max(1, self.servers - self.c_standby)

    @property
    def arrival_rate(self) -> float:
        """Requests per second that load the int4 pool to `primary_util`."""
        return self.primary_util * self.c_primary / self.s_primary

    @property
    def saturation_share(self) -> float:
        """Share of requests that hand off at which the standby reaches utilization 1."""
        return self.c_standby / (self.arrival_rate * self.s_standby)

    @property
    def saturation_rate(self) -> float:
        """Handoffs per second that saturate the standby."""
        return self.c_standby / self.s_standby

    def point(self, share: float) -> dict[str, float]:
        lam_h = share * self.arrival_rate
        a = lam_h * self.s_standby
        wq = mmc_wait(self.c_standby, lam_h, self.s_standby)
        return {"share": share, "handoff_rate": lam_h, "utilization": a / self.c_standby,
                "p_wait": erlang_c(self.c_standby, a), "wait_ms": wq * 1e3}

    def share_at_wait(self, budget_s: float) -> float:
        """The abnormal share at which the mean standby queueing wait reaches `budget_s`."""
        lo, hi = 0.0, self.saturation_share
        for _ in range(60):
            mid = (lo + hi) / 2
            if mmc_wait(self.c_standby, mid * self.arrival_rate, self.s_standby) < budget_s:
                lo = mid
            else:
                hi = mid
        return lo

    def to_dict(self) -> dict[str, float | int]:
        return {"servers": self.servers, "standby_share": self.standby_share, "c_standby": self.c_standby,
                "c_primary": self.c_primary, "primary_util": self.primary_util,
                "s_primary_ms": self.s_primary * 1e3, "s_standby_ms": self.s_standby * 1e3,
                "arrival_rate_rps": self.arrival_rate, "saturation_share": self.saturation_share,
                "saturation_handoffs_per_s": self.saturation_rate}


def simulate(c: int, lam: float, services: Sequence[float], n: int = 20_000, seed: int = 0) -> float:
    """Mean queueing wait (seconds) of a FCFS M/G/c queue: Poisson arrivals at `lam`, service times
    drawn with replacement from `services`. The first 10% of arrivals are a warm-up, not counted."""
    if not services:
        raise ValueError("no service times")
    rng = random.Random(seed)
    free = [0.0] * c  # when each server is next free (a heap)
    heapq.heapify(free)
    t = 0.0
    waits = []
    for i in range(n):
        t += rng.expovariate(lam)
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + rng.choice(services))
        if i >= n // 10:
            waits.append(start - t)
    return sum(waits) / len(waits)


def fcfs_waits(c: int, arrivals: Sequence[float], services: Sequence[float]) -> list[float]:
    """Queueing wait of each job of a FCFS queue with c servers, given its arrival times (sorted)
    and service times: what an ideal queue does with exactly these jobs."""
    free = [0.0] * c
    heapq.heapify(free)
    waits = []
    for t, s in zip(arrivals, services, strict=True):
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + s)
        waits.append(start - t)
    return waits


def finite_run_waits(c: int, lam: float, services: Sequence[float], n: int, reps: int = 2000,
                     seed: int = 0) -> list[float]:
    """The model's prediction for a short replay: the mean wait of n Poisson arrivals into an empty
    M/G/c queue (service times drawn from `services`), for each of `reps` seeded repetitions. A
    short run from empty waits less than the steady state; this is the distribution of the statistic
    a replay of n jobs measures."""
    if not services:
        raise ValueError("no service times")
    rng = random.Random(seed)
    out = []
    for _ in range(reps):
        t, arrivals = 0.0, []
        for _ in range(n):
            t += rng.expovariate(lam)
            arrivals.append(t)
        w = fcfs_waits(c, arrivals, [rng.choice(services) for _ in range(n)])
        out.append(sum(w) / n)
    return out
