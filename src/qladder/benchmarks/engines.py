"""`qladder bench engines`: decode and prefill speed per rung, interleaved, and the bandwidth bound.

A decode step of a memory-bound model reads every weight once (the tied embedding is read in full
as the output head), so `weight_bytes / read_bandwidth` is a floor on the step time and
`decode_tok_s * weight_bytes / bandwidth` the fraction of that bound a rung reaches. KV-cache
reads are left out (under 1 MB at these contexts). Bandwidth is measured in the same run.
"""

from __future__ import annotations

import gc
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from qladder.benchmarks.common import environment, measure_read_bandwidth
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.engines.base import Engine
from qladder.model import ModelInfo, inspect_model

TEXT = ("The history of mathematics spans many cultures, from Babylonian tablets to Greek proofs, "
        "Indian numerals, Islamic algebra and the calculus of Newton and Leibniz. ")


def weight_bytes(engine: Engine, info: ModelInfo) -> int:
    """Bytes of weights one decode step reads."""
    if engine.name == "int4":
        from gguf import GGUFReader

        return int(sum(int(t.n_bytes) for t in GGUFReader(str(info.path)).tensors))
    from qladder.engines.torch_engine import TorchEngine

    assert isinstance(engine, TorchEngine)  # every rung but int4 is a torch model
    model = engine.model
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embedding / lm_head counted once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _prompt_ids(engine: Engine, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += engine.tokenize(TEXT, False)
    return ids[:n]


def _decode_tok_s(engine: Engine, n: int) -> float:
    s = engine.open(_prompt_ids(engine, 32))
    t = time.perf_counter()
    for _ in range(n):
        s.push(int(s.logits().argmax()))
    dt = time.perf_counter() - t
    s.close()
    return n / dt


def _prefill_tok_s(engine: Engine, n: int) -> float:
    ids = _prompt_ids(engine, n)
    t = time.perf_counter()
    s = engine.open(ids)
    s.logits()
    dt = time.perf_counter() - t
    s.close()
    return n / dt


def _load(rung: str, info: ModelInfo, settings: Settings) -> tuple[Engine, float]:
    t = time.perf_counter()
    e = load_engine(rung, info, settings)
    return e, time.perf_counter() - t


FRESH_START = """
import time
t = time.perf_counter()
from qladder.engines import load_engine
for rung in {rungs!r}:
    load_engine(rung)
print(time.perf_counter() - t)
"""


def fresh_process_warm_start(rungs: list[str]) -> float:
    """Wall time for a new process to import qladder and load every rung from the warm caches."""
    proc = subprocess.run([sys.executable, "-c", FRESH_START.format(rungs=rungs)], capture_output=True,
                          text=True, timeout=600, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def run_engine_bench(rungs: list[str], decode_tokens: int = 64, rounds: int = 3,
                     prefill_lengths: tuple[int, ...] = (128, 512)) -> dict[str, Any]:
    settings = Settings.from_env()
    info = inspect_model()
    out: dict[str, Any] = {"benchmark": "engines", "model": info.name, "model_file": info.path.name,
                           "rungs": {}}
    out["bandwidth"] = measure_read_bandwidth()
    proc = psutil.Process()
    engines: dict[str, Engine] = {}
    for rung in rungs:
        entry: dict[str, Any] = {}
        if rung != "int4":  # cold: an empty on-disk cache, so the GGUF is dequantized
            with tempfile.TemporaryDirectory() as tmp:
                cold, entry["cold_load_s"] = _load(rung, info, replace(settings, cache_dir=Path(tmp)))
                cold.close()
                del cold
                gc.collect()
        rss0 = proc.memory_info().rss
        engines[rung], warm_s = _load(rung, info, settings)
        entry.setdefault("cold_load_s", warm_s)  # int4 has no cache: its first load is the cold one
        if rung == "int4":
            engines[rung].close()
            engines[rung], warm_s = _load(rung, info, settings)
        entry["warm_load_s"] = warm_s
        entry["rss_delta_mb"] = (proc.memory_info().rss - rss0) / 2**20
        entry["precision"] = engines[rung].precision
        entry["weight_bytes_per_token"] = weight_bytes(engines[rung], info)
        out["rungs"][rung] = entry
    for e in engines.values():  # warm-up: one short decode each
        _decode_tok_s(e, 8)
    decode: dict[str, list[float]] = {r: [] for r in rungs}
    for i in range(rounds):  # interleaved: each round visits every rung, order rotated
        order = rungs[i % len(rungs):] + rungs[: i % len(rungs)]
        for r in order:
            decode[r].append(_decode_tok_s(engines[r], decode_tokens))
    bw = out["bandwidth"]["read_gb_s"] * 1e9
    for r in rungs:
        entry = out["rungs"][r]
        entry["decode_tok_s_runs"] = decode[r]
        entry["decode_tok_s"] = statistics.median(decode[r])
        for n in prefill_lengths:
            entry[f"prefill_tok_s_{n}"] = _prefill_tok_s(engines[r], n)
        bound = bw / entry["weight_bytes_per_token"]
        entry["bandwidth_bound_tok_s"] = bound
        entry["bandwidth_fraction"] = entry["decode_tok_s"] / bound
    if "int4" in decode and "fp32" in decode:
        out["int4_over_fp32_decode"] = out["rungs"]["int4"]["decode_tok_s"] / out["rungs"]["fp32"]["decode_tok_s"]
    out["warm_start_all_s"] = sum(out["rungs"][r]["warm_load_s"] for r in rungs)
    out["warm_start_fresh_process_s"] = fresh_process_warm_start(rungs)  # imports included
    out["env"] = environment(settings.n_threads)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["method"] = {"decode_tokens": decode_tokens, "rounds": rounds, "warmup_tokens": 8,
                     "prompt_tokens_for_decode": 32, "prefill_lengths": list(prefill_lengths),
                     "statistic": "median over interleaved rounds"}
    for e in engines.values():
        e.close()
    return out
