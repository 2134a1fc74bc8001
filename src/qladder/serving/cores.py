"""The machine's cores, leased per compute call by the INT4 scheduler and the standby.

    n = cores.lease(want)     blocks until at least one core is free; returns how many it got
    ... one decode / forward on n threads ...
    cores.release(n)

A caller gets what is free up to `want`, less one core for each other caller already waiting
(so a caller that gives its cores back and leases again at once never starves the one that
waited), and always at least one; callers are served in the order they asked. Leases never add
up to more than `total`: at no instant do the two pools' threads oversubscribe the cores.

Elastic INT4 (`[cores] int4 = "elastic"`, the server's default): the INT4 scheduler asks, before
each decode, for what `int4_threads` gives: every core while the standby has had no work for
`linger_s`, the cores the standby leaves (`total - standby threads`) while it works or just
served requests. The standby reports each turn (`standby_turn(busy, now, requests)`): busy with a
handoff, a quarantined request, a verified window or an audit; the linger follows requests' work
only (the next token of a handoff comes within milliseconds; an audit done is done, and a core
left idle for linger_s after each one cost INT4 ~10% of its tokens on 2 cores). A handoff that
arrives while INT4 decodes on every core waits for that one decode (the lease queue), then both
run side by side. The standby's torch threads stay
fixed (its `threads`); only llama.cpp's change, per decode (`llama_set_n_threads`).

Why torch's threads stay fixed (measured here, libgomp, torch 2.13): both llama.cpp and torch
use OpenMP, and once one thread of the process has run a 2-thread OpenMP region, small torch
ops on 2 threads in *another* thread run ~3x slower (1,000 (1 x 576) @ (576 x 1536) matmuls:
52 ms in a worker thread alone, 150-290 ms after the main thread ran a 2-thread region;
OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_DYNAMIC and OMP_PROC_BIND do not help). One torch thread
runs no OpenMP region at all, so llama.cpp may take every core between its decodes (measured:
bench/results/bench-serving-2026-12-04-elastic, where the standby scored every greedy answer's
drift windows at c8 (a mode since retired) and keeps pace as well beside a 2-thread INT4 pool as beside a 1-thread one:
time to first token P50 1,697 against 1,628 ms, tok/s 82.2 against 74.6; a 3x slower fp32
forward would show there). A standby on more than one thread beside elastic INT4 meets the
interaction above. The opposite arrangement (the standby up to all cores, INT4 fixed: `qladder bench
verified`, a standby on 2 threads only while INT4 runs 1) stays available.
"""

from __future__ import annotations

import threading
from collections import deque


def int4_threads(total: int, cap: int, standby: int, standby_busy: bool, idle_for_s: float,
                 linger_s: float) -> int:
    """The INT4 pool's threads for its next decode (pure): up to `cap`, every core while the
    standby has been idle for `linger_s`, else the `total - standby` cores it leaves (at least 1)."""
    if standby_busy or idle_for_s < linger_s:
        return max(1, min(cap, total - standby))
    return max(1, min(cap, total))


class Cores:
    def __init__(self, total: int, linger_s: float = 0.25):
        if total < 1:
            raise ValueError(f"cores must be >= 1, got {total}")
        self.total = total
        self.linger_s = linger_s
        self._free = total
        self._queue: deque[object] = deque()
        self._cv = threading.Condition()
        self.leases = 0  # served leases (metrics)
        self.max_in_use = 0  # the most cores leased at once (a test reads it: never over total)
        self._standby_busy = False  # the standby's last report (standby_turn), behind _cv
        self._standby_requests = False  # ...and whether requests (not only an audit) kept it busy
        self._standby_at = float("-inf")  # when it last had work, on its clock
        self.int4_by_threads: dict[int, int] = {}  # INT4 decodes by threads asked (metrics, tests)

    def standby_turn(self, busy: bool, now: float, requests: bool | None = None) -> None:
        """The standby's worker, each turn: whether it has work (handoffs, windows, an audit), and
        whether requests are among it (None: it is all requests'): the linger follows those alone."""
        requests = busy if requests is None else requests
        with self._cv:
            if requests or self._standby_requests:  # serving, or it just stopped: the linger runs from here
                self._standby_at = now
            self._standby_busy, self._standby_requests = busy, requests

    def int4_want(self, cap: int, standby: int, now: float) -> int:
        """What the INT4 scheduler asks for its next decode (`int4_threads` on the last report)."""
        with self._cv:
            n = int4_threads(self.total, cap, standby, self._standby_busy, now - self._standby_at, self.linger_s)
            self.int4_by_threads[n] = self.int4_by_threads.get(n, 0) + 1
            return n

    def lease(self, want: int) -> int:
        ticket = object()
        with self._cv:
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self._free < 1:
                self._cv.wait()
            self._queue.popleft()
            n = max(1, min(want, self._free - len(self._queue)))
            self._free -= n
            self.leases += 1
            self.max_in_use = max(self.max_in_use, self.total - self._free)
            self._cv.notify_all()  # the next in line may take what is left
            return n

    def release(self, n: int) -> None:
        with self._cv:
            self._free += n
            if self._free > self.total:
                raise RuntimeError(f"released more cores than leased ({self._free} of {self.total})")
            self._cv.notify_all()

    @property
    def free(self) -> int:
        with self._cv:
            return self._free
