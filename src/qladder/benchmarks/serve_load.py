"""`qladder bench serve`: a load test of the HTTP server, against llama.cpp's own server.

Three servers run as child processes on 127.0.0.1, each with the INT4 work on `threads` thread(s):
    guarded       `qladder serve` (default guard, fp32 standby, faults allowed for this benchmark)
    bare          `qladder serve` with the guard off (server.guard = "off": no checks, no handoffs)
    llama_server  llama.cpp's C++ server (-np = qladder's INT4 slots, -t/-tb = the same threads)
Only one is under load at a time; an idle server sleeps (no CPU).

Phases, one run:
1. faulted: `clients` streaming clients, closed-loop, for `duration_s` against `guarded`, with
   `fault_share` of the prompts hazardous (each carries a fault: nan/inf/zero at a seeded step;
   a repeat of such a prompt is quarantined and starts on fp32). Checked: no 5xx, every request
   answered or told 429, incident rows == hazards counted by /metrics.
2. burst: every request faulted for `burst_s`, then clean traffic until the INT4 breaker closed
   again (at most `recover_s`); the breaker's mode is sampled from /readyz all along.
3. compare: the same clients and prompts, unfaulted, `rounds` rounds of one `window_s` window per
   server, the order rotated each round (interleaved). Aggregate tok/s per window = completion
   tokens / (last answer done - first request sent); latency percentiles pooled over rounds.
   Ratios: guarded over llama_server (tok/s: median of the per-round ratios; P99 end-to-end:
   pooled P99 over pooled P99).
Completion tokens are counted the same way for every server: the answer text tokenized with the
model's vocabulary (llama-server's usage also counts the end-of-sequence token; qladder's not).
Greedy (temperature 0), `max_tokens` per answer, streaming with include_usage.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from qladder.benchmarks.common import cpu, percentile, versions
from qladder.peers.llama_server import LlamaServer
from qladder.peers.process import free_port, stop, wait_ready

MODEL = "smollm2-135m-instruct"
FAULT_KINDS = ("nan", "inf", "zero")


@dataclass
class Sample:
    status: int
    started: float
    done: float
    ttft_s: float | None
    text: str = ""
    ext: dict[str, Any] | None = None
    faulted: bool = False
    error: str | None = None


@dataclass
class QladderProcess:
    name: str
    config: str
    args: list[str]
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 180.0) -> None:
        cfg = self.workdir / f"{self.name}.toml"
        cfg.write_text(self.config)
        log = open(self.workdir / f"{self.name}.log", "wb")  # noqa: SIM115 (the child owns it)
        exe = Path(sys.executable).with_name("qladder")
        self.proc = subprocess.Popen([str(exe), "serve", "--config", str(cfg), "--port", str(self.port),
                                      "--log-level", "warning", *self.args], stdout=log, stderr=log)
        log.close()
        why = wait_ready(self.proc, f"{self.base_url}/readyz", ready_timeout_s, poll_s=0.2)
        if why is not None:
            raise RuntimeError(f"{self.name} {why}: {(self.workdir / f'{self.name}.log').read_text()}")

    def stop(self) -> None:
        stop(self.proc, timeout_s=60.0)


# -- the clients ------------------------------------------------------------------------------------------

async def _one(h: httpx.AsyncClient, url: str, body: dict[str, Any], faulted: bool) -> Sample:
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    ext: dict[str, Any] | None = None
    try:
        async with h.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Sample(r.status_code, t0, time.perf_counter(), None, faulted=faulted, error=r.text[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(502, t0, time.perf_counter(), ttft, "".join(parts), faulted=faulted,
                                  error=str(chunk["error"])[:200])
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(piece)
                if "qladder" in chunk:
                    ext = chunk["qladder"]
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        return Sample(-1, t0, time.perf_counter(), ttft, "".join(parts), faulted=faulted, error=repr(exc)[:200])
    return Sample(200, t0, time.perf_counter(), ttft, "".join(parts), ext, faulted)


async def _closed_loop(base_url: str, jobs: list[tuple[str, list[str]]], clients: int, seconds: float,
                       max_tokens: int, start_at: int = 0) -> list[Sample]:
    """`clients` clients, each sending its next job when its last answer is done, for `seconds`."""
    url = f"{base_url}/v1/chat/completions"
    out: list[Sample] = []
    counter = iter(range(start_at, 10**9))
    end = time.perf_counter() + seconds
    # A connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few
    # requests, and a request sent on one just closed fails unanswered; the same for every server.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as h:
        async def client() -> None:
            while time.perf_counter() < end:
                prompt, faults = jobs[next(counter) % len(jobs)]
                body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
                if faults:
                    body["qladder"] = {"faults": faults}
                out.append(await _one(h, url, body, bool(faults)))

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


# -- summaries -------------------------------------------------------------------------------------------

def _summary(samples: list[Sample], count: Any) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    tokens = sum(count(s.text) for s in ok)
    span = (max(s.done for s in samples) - min(s.started for s in samples)) if samples else float("nan")
    e2e = [s.done - s.started for s in ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    return {"requests": len(samples), "statuses": statuses, "tokens": tokens, "span_s": span,
            "tok_s": tokens / span if span > 0 else float("nan"),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
            "errors": [s.error for s in samples if s.error][:5]}


def _scrape(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def _jobs(n_prompts: int, fault_share: float, max_tokens: int, seed: int) -> tuple[list[tuple[str, list[str]]], int]:
    from qladder.validate.corpora import normal_prompts

    prompts = [p.prompt for p in normal_prompts(n_per_class=max(1, n_prompts // 4)) if isinstance(p.prompt, str)]
    r = random.Random(seed)
    n_faulted = round(len(prompts) * fault_share)
    faulted = set(r.sample(range(len(prompts)), n_faulted))
    jobs = [(p, [f"{FAULT_KINDS[k % 3]}@step={r.randint(1, max(1, max_tokens // 2))}"] if k in faulted else [])
            for k, p in enumerate(prompts)]
    return jobs, n_faulted


def run_serve_bench(duration_s: float = 120.0, window_s: float = 60.0, rounds: int = 2, clients: int = 16,
                    fault_share: float = 0.1, max_tokens: int = 64, slots: int = 8, threads: int = 1,
                    burst_s: float = 30.0, recover_s: float = 120.0, n_prompts: int = 64, seed: int = 0,
                    log: Any = None) -> dict[str, Any]:
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.model import inspect_model

    say = log or (lambda _m: None)
    info = inspect_model()
    vocab = LlamaVocab(info)

    def count(text: str) -> int:
        return len(vocab.tokenize(text, False))

    jobs, n_faulted = _jobs(n_prompts, fault_share, max_tokens, seed)
    clean = [(p, []) for p, _ in jobs]
    work = Path(tempfile.mkdtemp(prefix="qladder-bench-serve-"))
    pools = (f'[[pools]]\nname = "int4"\nrungs = ["int4"]\nslots = {slots}\nthreads = {threads}\nmax_queue = 64\n'
             f'weight = 1.0\nhandoff_to = "standby"\n[[pools]]\nname = "standby"\nrungs = ["fp32"]\nthreads = 1\n'
             f'sessions = 4\n')
    db = work / "incidents.sqlite3"
    guarded = QladderProcess("guarded", f'[server]\ndefault_max_tokens = {max_tokens}\nincidents = "{db}"\n' + pools,
                             ["--allow-faults"], work)
    bare = QladderProcess("bare", f'[server]\nguard = "off"\nincidents = "{work / "bare.sqlite3"}"\n' + pools, [], work)
    peer = LlamaServer(info.path, n_parallel=slots, threads=threads, n_ctx_per_slot=2048)
    out: dict[str, Any] = {
        "benchmark": "qladder bench serve", "model": str(info.path.name),
        "config": {"duration_s": duration_s, "window_s": window_s, "rounds": rounds, "clients": clients,
                   "fault_share": fault_share, "faulted_prompts": n_faulted, "prompts": len(jobs),
                   "max_tokens": max_tokens, "slots": slots, "int4_threads": threads, "standby_threads": 1,
                   "burst_s": burst_s, "seed": seed, "temperature": 0, "streaming": True,
                   "llama_server_args": peer.args[1:]},
        "versions": {**versions(), "llama_server": peer.version()}, "cpu": cpu(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workdir": str(work)}
    try:
        say("starting the servers")
        guarded.start()
        bare.start()
        peer.start()
        servers = {"guarded": guarded.base_url, "bare": bare.base_url, "llama_server": peer.base_url}
        say("warm-up")
        for url in servers.values():
            asyncio.run(_closed_loop(url, clean, min(clients, slots), 3.0, 16))
        out["faulted"] = _faulted_phase(guarded.base_url, db, jobs, clients, duration_s, max_tokens, count, say)
        out["burst"] = _burst_phase(guarded.base_url, clean, clients, burst_s, recover_s, max_tokens, say)
        out["compare"], out["ratios"] = _compare(servers, clean, clients, window_s, rounds, max_tokens, count, say)
    finally:
        guarded.stop()
        bare.stop()
        peer.stop()
        vocab.close()
    return out


def _faulted_phase(url: str, db: Path, jobs: list[tuple[str, list[str]]], clients: int, seconds: float,
                   max_tokens: int, count: Any, say: Any) -> dict[str, Any]:
    say(f"faulted load: {clients} clients, {seconds:.0f} s")
    before = _scrape(url)
    samples = asyncio.run(_closed_loop(url, jobs, clients, seconds, max_tokens))
    time.sleep(1.0)  # the incident writer commits off the decode loop
    after = _scrape(url)
    rows = sqlite3.connect(db).execute("SELECT COUNT(*) FROM incidents").fetchone()[0]
    hazards = _sum(after, "qladder_hazards_total{")
    def bad(s: Sample) -> bool:
        return "\ufffd" in s.text or not s.text.strip()

    garbage = [s for s in samples if s.status == 200 and bad(s)]
    fs = [s for s in samples if s.faulted and s.status == 200]
    return {**_summary(samples, count), "faulted_requests": sum(s.faulted for s in samples),
            "faulted_answered_clean": sum(1 for s in fs if not bad(s)),
            "faulted_handed_off": sum(1 for s in fs if s.ext and s.ext["handoffs"]),
            "faulted_started_on_standby": sum(1 for s in fs if s.ext and s.ext["pool"] == "standby"),
            "answers_empty_or_replacement_char": len(garbage),
            "five_xx": sum(1 for s in samples if s.status >= 500 or s.status < 0),
            "answered_or_429": all(s.status in (200, 429) for s in samples),
            "hazards_metrics": hazards - _sum(before, "qladder_hazards_total{"), "hazards_metrics_total": hazards,
            "incident_rows": rows, "incident_rows_equal_hazards": rows == hazards,
            "handoffs": _sum(after, "qladder_handoffs_total{") - _sum(before, "qladder_handoffs_total{"),
            "handoff_latency_mean_ms": 1e3 * _sum(after, "qladder_handoff_latency_seconds_sum") /
            max(1.0, _sum(after, "qladder_handoff_latency_seconds_count")),
            "quarantine_size": after.get("qladder_quarantine_size", 0.0),
            "tokens_by_rung": {k.split('"')[1]: v for k, v in after.items() if k.startswith("qladder_tokens_total{")}}


def _burst_phase(url: str, clean: list[tuple[str, list[str]]], clients: int, burst_s: float, recover_s: float,
                 max_tokens: int, say: Any) -> dict[str, Any]:
    say(f"fault burst: {burst_s:.0f} s, then clean traffic until the breaker closes")
    burst = [(f"Burst question {k}: say something about the number {k}.", ["nan@step=1"]) for k in range(10_000)]
    timeline: list[tuple[float, str]] = []
    t0 = time.perf_counter()

    async def sample_breaker(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=10) as h:
            while not stop.is_set():
                mode = (await h.get(f"{url}/readyz")).json()["breakers"]["int4"]
                if not timeline or timeline[-1][1] != mode:
                    timeline.append((round(time.perf_counter() - t0, 2), mode))
                await asyncio.sleep(0.25)

    async def run() -> tuple[list[Sample], list[Sample]]:
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(sample_breaker(stop))
        hot = await _closed_loop(url, burst, clients, burst_s, max_tokens)
        cool: list[Sample] = []
        deadline = time.perf_counter() + recover_s
        while time.perf_counter() < deadline:
            cool += await _closed_loop(url, clean, clients, 5.0, max_tokens)
            if timeline and timeline[-1][1] == "closed" and len(timeline) > 1:
                break
        stop.set()
        await watcher
        return hot, cool

    hot, cool = asyncio.run(run())
    m = _scrape(url)
    modes = [mode for _, mode in timeline]
    return {"timeline": timeline, "opened": "open" in modes, "closed_after": bool(modes) and modes[-1] == "closed",
            "burst_requests": len(hot), "recovery_requests": len(cool),
            "five_xx": sum(1 for s in hot + cool if s.status >= 500 or s.status < 0),
            "transitions": {k.split('to="')[1].rstrip('"}'): v for k, v in m.items()
                            if k.startswith('qladder_breaker_transitions_total{pool="int4"')}}


def _compare(servers: dict[str, str], clean: list[tuple[str, list[str]]], clients: int, window_s: float,
             rounds: int, max_tokens: int, count: Any, say: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    names = list(servers)
    per: dict[str, list[list[Sample]]] = {n: [] for n in names}
    windows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            say(f"round {r + 1}/{rounds}: {n}, {window_s:.0f} s")
            s = asyncio.run(_closed_loop(servers[n], clean, clients, window_s, max_tokens, start_at=r * 7))
            per[n].append(s)
            windows[n].append(_summary(s, count))
    compare: dict[str, Any] = {}
    for n in names:
        pooled = _summary([x for w in per[n] for x in w], count)
        pooled["span_s"] = sum(w["span_s"] for w in windows[n])  # the windows', not the run's
        pooled["tok_s"] = pooled["tokens"] / pooled["span_s"]
        compare[n] = {"windows": windows[n], "tok_s_median": statistics.median(w["tok_s"] for w in windows[n]),
                      "pooled": pooled}
    g, ls, b = "guarded", "llama_server", "bare"
    ratios = {
        "guarded_over_llama_server_tok_s": statistics.median(
            wg["tok_s"] / wl["tok_s"] for wg, wl in zip(windows[g], windows[ls], strict=True)),
        "guarded_over_llama_server_p99": compare[g]["pooled"]["e2e_p99_s"] / compare[ls]["pooled"]["e2e_p99_s"],
        "guarded_over_llama_server_ttft_p99": compare[g]["pooled"]["ttft_p99_s"] / compare[ls]["pooled"]["ttft_p99_s"],
        "guarded_over_bare_tok_s": statistics.median(
            wg["tok_s"] / wb["tok_s"] for wg, wb in zip(windows[g], windows[b], strict=True)),
        "guarded_over_bare_p99": compare[g]["pooled"]["e2e_p99_s"] / compare[b]["pooled"]["e2e_p99_s"],
    }
    return compare, ratios
