"""A concurrent replay of handoffs into a real full-precision standby: the check of the queueing model.

Jobs are the replay's measured handoffs: each is the standby's share of one handed-off request
(the fp32 catch-up prefill of its context and the fp32 tokens it then served), run for real on the
fp32 engine. They arrive as a seeded Poisson stream at a rate that loads `servers` standby workers
(threads, one fp32 session each) to a target utilization, and queue FCFS for a free worker.

For each point it reports the waits measured against two predictions:
    ideal queue     the same arrivals and the same measured service times through an ideal FCFS
                    queue (`queueing.fcfs_waits`): any gap is dispatch overhead or interference
    model           the M/G/c model fed with the measured service times, as the statistic this run
                    measures (mean wait of n arrivals from an empty queue, `finite_run_waits`): the
                    replay confirms the model when its mean wait falls inside the model's 95% band
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qladder.engines.base import Engine
from qladder.percentiles import mean, percentile
from qladder.validate import queueing


@dataclass(frozen=True)
class Job:
    ids: tuple[int, ...]  # the context handed over
    tokens: int  # fp32 tokens the standby served for it


def run_job(engine: Engine, job: Job) -> None:
    """The standby's work for one handoff: catch-up prefill, then greedy decoding."""
    s = engine.open(list(job.ids))
    try:
        for _ in range(job.tokens):
            s.push(int(s.logits().argmax()))
    finally:
        s.close()


def replay_point(engine: Engine, jobs: Sequence[Job], lam: float, servers: int, seed: int,
                 work: Callable[[Engine, Job], None] = run_job,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, list[float]]:
    """Release `jobs` at Poisson times of rate `lam` to `servers` worker threads; return each job's
    arrival, start and end times (seconds from the first arrival)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in jobs:
        t += rng.expovariate(lam)
        offsets.append(t)
    pending: queue.Queue[tuple[int, Job] | None] = queue.Queue()
    starts = [0.0] * len(jobs)
    ends = [0.0] * len(jobs)
    errors: list[BaseException] = []
    t0 = clock() - offsets[0] if offsets else clock()

    def worker() -> None:
        while True:
            item = pending.get()
            if item is None:
                return
            i, job = item
            starts[i] = clock() - t0
            try:
                work(engine, job)
            except BaseException as exc:  # recorded, not lost: the point is then reported failed
                errors.append(exc)
            ends[i] = clock() - t0

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(servers)]
    for th in threads:
        th.start()
    for i, (job, at) in enumerate(zip(jobs, offsets, strict=True)):
        delay = at - (clock() - t0)
        if delay > 0:
            sleep(delay)
        offsets[i] = max(at, clock() - t0)  # the arrival as it happened
        pending.put((i, job))
    for _ in threads:
        pending.put(None)
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} standby jobs failed: {errors[0]!r}")
    return {"arrival": offsets, "start": starts, "end": ends}


def confirm(engine: Engine, jobs: Sequence[Job], utilizations: Sequence[float], servers: int,
            n_jobs: int, seed: int, tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Replay at each target utilization and compare with the ideal queue and with the model."""
    if not jobs:
        return {"error": "no handoffs were measured: nothing to replay"}
    rng = random.Random(seed)
    # Service time of each job alone, measured once, sets the rates (a short warm-up first).
    run_job(engine, jobs[0])
    alone = []
    for job in jobs:
        t = time.perf_counter()
        run_job(engine, job)
        alone.append(time.perf_counter() - t)
    s_mean = mean(alone) or 0.0
    points = []
    for k, rho in enumerate(utilizations):
        lam = rho * servers / s_mean
        batch = [jobs[rng.randrange(len(jobs))] for _ in range(n_jobs)]
        r = replay_point(engine, batch, lam, servers, seed + k)
        tick()
        services = [e - s for s, e in zip(r["start"], r["end"], strict=True)]
        waits = [s - a for a, s in zip(r["arrival"], r["start"], strict=True)]
        ideal = queueing.fcfs_waits(servers, r["arrival"], services)
        band = queueing.finite_run_waits(servers, lam, services, n_jobs, seed=seed + 100 + k)
        lo, hi = percentile(band, 2.5), percentile(band, 97.5)
        measured = mean(waits) or 0.0
        s_bar = mean(services) or 0.0
        points.append({
            "target_utilization": rho, "arrival_rate_per_s": lam, "jobs": n_jobs,
            "measured_utilization": lam * s_bar / servers,
            "service_mean_ms": s_bar * 1e3, "service_alone_mean_ms": s_mean * 1e3,
            "wait_mean_ms": measured * 1e3, "wait_p50_ms": (percentile(waits, 50) or 0.0) * 1e3,
            "wait_max_ms": max(waits) * 1e3,
            "ideal_queue_wait_mean_ms": (mean(ideal) or 0.0) * 1e3,
            "model_wait_mean_ms": (mean(band) or 0.0) * 1e3,
            "model_band_95_ms": [(lo or 0.0) * 1e3, (hi or 0.0) * 1e3],
            "steady_state_mmc_wait_ms": queueing.mmc_wait(servers, lam, s_bar) * 1e3,
            "confirmed": lo is not None and hi is not None and lo <= measured <= hi,
        })
    return {"servers": servers, "points": points, "seed": seed,
            "jobs_from": f"{len(jobs)} measured handoffs (fp32 catch-up prefill + the fp32 tokens served)",
            "note": "standby workers are threads sharing one fp32 engine, one session each; the "
                    "model band is the 2.5-97.5% range of the mean wait of the same number of "
                    "Poisson arrivals into an empty M/G/c queue with the measured service times"}
