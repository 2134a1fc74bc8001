"""What every validation run and benchmark records about the machine and the software it ran on:
one `versions()` (with the commit of the qladder checkout that ran, when it is one) and one `cpu()`."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PACKAGES = ("qladder", "torch", "transformers", "llama_cpp_python", "gguf", "numpy", "matplotlib")


def versions() -> dict[str, str | None]:
    """Python's and each package's version (None: not installed), and `qladder_commit`."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["qladder_commit"] = source_commit()
    return out


def source_commit() -> str | None:
    """The git commit of the checkout qladder runs from (`-dirty` when tracked files differ from it),
    or None when it is not run from a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return f"{commit}-dirty" if dirty else commit


def cpu() -> dict[str, Any]:
    """CPU model and counts: py-cpuinfo when installed, else /proc/cpuinfo, else platform."""
    info: dict[str, Any] = {"machine": platform.machine(), "platform": platform.platform(),
                            "logical_cpus": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        info["usable_cpus"] = os.cpu_count()
    try:
        import cpuinfo

        info["model"] = cpuinfo.get_cpu_info().get("brand_raw")
        info["source"] = "py-cpuinfo"
        return info
    except ImportError:
        pass
    proc = Path("/proc/cpuinfo")
    if proc.is_file():
        for line in proc.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                info["model"] = value.strip()
                break
        flags = next((ln for ln in proc.read_text(errors="replace").splitlines() if ln.startswith("flags")), "")
        info["avx512"] = "avx512f" in flags
        info["avx2"] = "avx2" in flags
        info["source"] = "/proc/cpuinfo"
    else:
        info["model"] = platform.processor() or None
        info["source"] = "platform"
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def peak_rss_mb() -> float:
    """The process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def snapshot(threads: int, n_ctx: int) -> dict[str, Any]:
    import torch

    return {"versions": versions(), "cpu": cpu(), "engine_threads": threads,
            "torch_threads": torch.get_num_threads(), "n_ctx": n_ctx, "load_average_start": load_average(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("QLADDER_")}}
