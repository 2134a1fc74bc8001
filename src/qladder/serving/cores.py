"""The machine's cores, leased per compute call by the INT4 scheduler and the standby.

    n = cores.lease(want)     blocks until at least one core is free; returns how many it got
    ... one decode / forward on n threads ...
    cores.release(n)

A caller gets what is free up to `want`, less one core for each other caller already waiting
(so a caller that gives its cores back and leases again at once never starves the one that
waited), and always at least one; callers are served in the order they asked. Leases never add
up to more than `total`: at no instant do the two pools' threads oversubscribe the cores. The
INT4 scheduler leases its fixed thread count; the standby up to all the cores: on 2 cores it
runs on both while INT4 is idle (a handoff, a request routed to it, a verification while no
draft is decoding) and on one while INT4 decodes. The lock and condition are the only shared
state; each lease's holder owns its cores until it releases them.

Why llama.cpp's threads stay fixed (measured here, libgomp, torch 2.13): both llama.cpp and
torch use OpenMP, and once one thread of the process has run a 2-thread OpenMP region, small
torch ops on 2 threads in *another* thread run ~3x slower (1,000 (1 x 576) @ (576 x 1536)
matmuls: 52 ms in a worker thread alone, 150-290 ms after the main thread ran a 2-thread
region; OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_DYNAMIC and OMP_PROC_BIND do not help). A
2-thread llama.cpp decode on the scheduler thread would slow every later standby forward
(the fp32 rung: 42 -> 120-134 ms a token). So only the standby's thread runs multi-threaded
OpenMP work, and callers keep the main thread's torch at one thread.
"""

from __future__ import annotations

import threading
from collections import deque


class Cores:
    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"cores must be >= 1, got {total}")
        self.total = total
        self._free = total
        self._queue: deque[object] = deque()
        self._cv = threading.Condition()
        self.leases = 0  # served leases (metrics)
        self.max_in_use = 0  # the most cores leased at once (a test reads it: never over total)

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
