"""What every benchmark records: versions, CPU, threads, and a measured memory bandwidth."""

from __future__ import annotations

import os
import platform
import statistics
import time
from importlib import metadata
from typing import Any

import numpy as np


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("qladder", "torch", "transformers", "llama-cpp-python", "gguf", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def cpu() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "logical_cores": os.cpu_count(), "machine": platform.machine(),
            "system": platform.system()}


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
