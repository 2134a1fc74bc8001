"""What every benchmark records: versions, CPU (qladder.environment), threads, and a measured memory
bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from qladder.environment import cpu, versions


def environment(threads: int) -> dict[str, Any]:
    import torch

    return {"versions": versions(), "cpu": cpu(), "threads": threads, "torch_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def measure_read_bandwidth(size_mb: int = 512, repeats: int = 7) -> dict[str, float]:
    """Single-thread read bandwidth: numpy sum over an array far larger than any cache. Median."""
    a = np.ones(size_mb * (1 << 20) // 8, dtype=np.float64)
    a.sum()  # warm-up: fault the pages in
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"read_gb_s": a.nbytes / med / 1e9, "array_mb": float(size_mb), "repeats": float(repeats)}


def percentile(xs: list[float], q: float) -> float:
    """`qladder.percentiles.percentile` (linear interpolation), NaN for no values (JSON-friendly
    in the benchmarks' arithmetic)."""
    from qladder.percentiles import percentile as pct

    v = pct(xs, q)
    return float("nan") if v is None else v
