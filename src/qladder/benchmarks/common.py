"""What every benchmark records: versions, CPU (qladder.environment), threads, and a measured memory
bandwidth."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from qladder.environment import cpu, versions

if TYPE_CHECKING:
    from qladder.model import ModelInfo
    from qladder.validate.outcome import Outcome

J = TypeVar("J")


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


class OutcomeLog:
    """A load benchmark's outcomes, appended by client threads under one lock; times from one clock."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.t0 = clock()
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return self.clock() - self.t0

    def add(self, o: Outcome) -> None:
        with self._lock:
            self.outcomes.append(o)


class AuditLog:
    """A serving engine's audit records by request id: its audit observer (the standby's thread),
    read by the benchmark's threads, behind one lock."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._lock = threading.Lock()
        self._records: dict[str, Any] = {}
        self._arrived: dict[str, float] = {}  # time.monotonic() when each record came
        engine.add_audit_observer(self._keep)

    def _keep(self, record: Any) -> None:
        with self._lock:
            self._records[record.request_id] = record
            self._arrived[record.request_id] = time.monotonic()

    def arrived(self, request_id: str) -> float | None:
        """When the request's record came (time.monotonic(); None: not audited, or not yet)."""
        with self._lock:
            return self._arrived.get(request_id)

    def get(self, request_id: str) -> Any:
        """The request's AuditRecord (None: not audited, or not yet)."""
        with self._lock:
            return self._records.get(request_id)

    def drain(self, timeout_s: float, poll_s: float = 0.02) -> None:
        """Wait until the engine has no audit pending (the standby audits in its idle turns), or timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.engine.stats().get("audits_pending", 0) and time.monotonic() < deadline:
            time.sleep(poll_s)


def closed_loop(n_clients: int, jobs: Sequence[J], run: Callable[[J], None]) -> None:
    """`n_clients` threads, each taking the next job when its last one is done, until none is left."""
    lock = threading.Lock()
    todo = list(jobs)

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop(0)
            run(job)

    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def judge_answers(outcomes: Sequence[Outcome], info: ModelInfo) -> None:
    """Every answer judged on its ids and text. The gateways give their ids; llama-server's chat
    stream gives none, so its answers are re-tokenized (flagged `retokenized`). Used by every
    benchmark that serves chat answers (serve_load, fleet)."""
    from qladder.engines.llamacpp import LlamaVocab

    vocab = LlamaVocab(info)
    try:
        for o in outcomes:
            if o.ok and o.config.startswith("llama_server"):
                o.token_ids, o.token_ids_source = vocab.tokenize(o.text, False) if o.text else [], "retokenized"
                o.rungs = ["llama-server"] * len(o.token_ids)
            o.judge()
    finally:
        vocab.close()


def recompute_figures(folder: Path, figures: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> int:
    """A bench folder's figures again from its outcomes.jsonl by `figures`, compared with its
    results.json: prints {"reproduced", "verdict"}; 0 only when they match and the verdict is PASS."""
    rows = [json.loads(line) for line in (folder / "outcomes.jsonl").read_text().splitlines() if line]
    saved = json.loads((folder / "results.json").read_text())
    again = figures(rows)
    same = json.dumps(again, sort_keys=True) == json.dumps(saved["figures"], sort_keys=True)
    print(json.dumps({"reproduced": same, "verdict": again["verdict"]}))
    return 0 if same and again["verdict"] == "PASS" else 1
