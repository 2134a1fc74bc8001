"""`qladder bench serve`: a load test of the HTTP server, against llama.cpp's own server.

Servers run as child processes on 127.0.0.1, each with the INT4 work on `threads` thread(s), and
each phase gets fresh ones (nothing a phase did, a quarantined prompt or an open breaker, carries
into the next):
    guarded         `qladder serve` (default guard, fp32 standby, faults allowed for this benchmark)
    bare            `qladder serve` with the guard off (server.guard = "off": no checks, no handoffs)
    llama_server    llama.cpp's C++ server (-np = qladder's INT4 slots, -t/-tb = the same threads)
    llama_server_aa a second, identical llama-server: the A/A pair of the latency verdict
Only one is under load at a time; an idle server sleeps (no CPU).

With --box, qladder's servers run on their default cores (elastic INT4) and llama-servers on every
core.

Phases, one run:
1. faulted: `clients` streaming clients, closed-loop, for `duration_s` against a guarded server,
   with `fault_share` of the prompts hazardous (each carries a fault: nan/inf/zero at a seeded step;
   a repeat of such a prompt is quarantined and starts on fp32). Checked: no 5xx, every request
   answered or told 429, every faulted request answered clean (the judge: symptoms and the fp32
   likelihood, scored after the run by a local fp32 engine), incident rows == the hazards the
   answers report.
2. burst: on a fresh guarded server, every request faulted for `burst_s`, then clean traffic until
   the INT4 breaker closed again (at most `recover_s`); the breaker's mode sampled from /readyz.
3. compare: fresh servers, the same clients and prompts, unfaulted, `rounds` rounds of one
   `window_s` window per server, the order rotated each round (interleaved).
Every request is one line of outcomes.jsonl; the breaker samples, incident rows and /metrics
totals are `observations` in results.json. Every figure (tok/s of a window = its answers' tokens
over its span; the latency verdict per prompt and pooled, beside the A/A pair) is computed from
them by `qladder.validate.recompute` (`figures(outcomes, "bench-serve", observations)`).
Answer ids: qladder's own (the "qladder" extension); llama-server's chat stream gives none, so its
answers are re-tokenized from the text for the judge (flagged `retokenized`), while tok/s counts
each server's own count (llama-server's usage less the end-of-sequence token it includes).
Greedy (temperature 0), `max_tokens` per answer, streaming.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from qladder.benchmarks.common import judge_answers
from qladder.environment import cpu, versions
from qladder.peers.llama_server import LlamaServer
from qladder.peers.process import free_port, start_qladder_serve, stop
from qladder.server.topology import CoresSettings
from qladder.validate.outcome import Outcome

RUN = "bench-serve"
MODEL = "smollm2-135m-instruct"
FAULT_KINDS = ("nan", "inf", "zero")
Job = tuple[str, str, list[str]]  # prompt id, text, fault specs


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

    def start(self, ready_timeout_s: float = 180.0) -> QladderProcess:
        cfg = self.workdir / f"{self.name}.toml"
        cfg.write_text(self.config)
        self.proc, _ = start_qladder_serve(cfg, self.workdir / f"{self.name}.log",
                                           ["--log-level", "warning", *self.args], self.port, ready_timeout_s)
        return self

    def stop(self) -> None:
        stop(self.proc, timeout_s=60.0)


# -- the clients ------------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def _one(h: httpx.AsyncClient, url: str, body: dict[str, Any], o: Outcome, clock: Clock) -> Outcome:
    o.start_s = clock.now()
    parts: list[str] = []
    ext: dict[str, Any] = {}
    try:
        async with h.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                o.status, o.error = r.status_code, r.text[:200]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        o.status, o.error = "error", str(chunk["error"])[:200]
                        break
                    if chunk.get("usage"):  # the server's own count of the answer's tokens
                        o.completion_tokens = int(chunk["usage"]["completion_tokens"])
                    for c in chunk.get("choices") or []:
                        piece = (c.get("delta") or {}).get("content") or ""
                        if piece:
                            if o.ttft_ms is None:
                                o.ttft_ms = (clock.now() - o.start_s) * 1e3
                            parts.append(piece)
                        o.finish_reason = c.get("finish_reason") or o.finish_reason
                    ext = chunk.get("qladder") or ext
    except httpx.TimeoutException as exc:
        o.status, o.error = "timeout", repr(exc)[:200]
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        o.status, o.error = "error", repr(exc)[:200]
    o.end_s = clock.now()
    o.latency_ms = (o.end_s - o.start_s) * 1e3
    o.text = "".join(parts)
    if o.ok and o.config.startswith("llama_server") and o.completion_tokens is not None \
            and o.finish_reason == "stop":
        o.completion_tokens -= 1  # llama-server counts the end-of-sequence token; qladder's ids do not
    if o.ok and not o.config.startswith("llama_server") and not ext:
        o.status, o.error = "error", "the answer's last chunk carried no qladder extension"
    if ext:
        o.token_ids, o.rungs = [int(t) for t in ext.get("token_ids", [])], [str(x) for x in ext.get("token_rungs", [])]
        o.token_ids_source = "server"
        o.completion_tokens = len(o.token_ids)
        o.finish_reason = ext.get("finish_reason", o.finish_reason)
        o.fallback = bool(ext.get("fallback"))
        o.hazards = [h["check"] for h in ext.get("hazards", [])]
        o.handoff_ms = [float(h["latency_ms"]) for h in ext.get("handoffs", [])]
        o.migrations = int(ext.get("timings", {}).get("migrations", 0)) if "timings" in ext else None
    return o


async def _closed_loop(base_url: str, config: str, phase: str, window: str, rnd: int, jobs: list[Job], clients: int,
                       seconds: float, max_tokens: int, clock: Clock, start_at: int = 0) -> list[Outcome]:
    """`clients` clients, each sending its next job when its last answer is done, for `seconds`."""
    url = f"{base_url}/v1/chat/completions"
    out: list[Outcome] = []
    counter = iter(range(start_at, 10**9))
    end = time.perf_counter() + seconds
    # A connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few
    # requests, and a request sent on one just closed fails unanswered; the same for every server.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as h:
        async def client() -> None:
            while time.perf_counter() < end:
                pid, prompt, faults = jobs[next(counter) % len(jobs)]
                body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
                if not config.startswith("llama_server"):
                    body["qladder"] = {"return_token_ids": True, **({"faults": faults} if faults else {})}
                o = Outcome(RUN, config, pid, "normal", "normal", fault=",".join(faults) or None, round=rnd,
                            phase=phase, prompt=prompt, concurrency=clients, window=window)
                out.append(await _one(h, url, body, o, clock))

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


# -- observations --------------------------------------------------------------------------------------

def _scrape(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def _jobs(n_prompts: int, fault_share: float, max_tokens: int, seed: int) -> tuple[list[Job], int]:
    from qladder.validate.corpora import normal_prompts

    prompts = [p for p in normal_prompts(n_per_class=max(1, n_prompts // 4)) if isinstance(p.prompt, str)]
    r = random.Random(seed)
    n_faulted = round(len(prompts) * fault_share)
    faulted = set(r.sample(range(len(prompts)), n_faulted))
    jobs = [(p.id, str(p.prompt), [f"{FAULT_KINDS[k % 3]}@step={r.randint(1, max(1, max_tokens // 2))}"]
             if k in faulted else []) for k, p in enumerate(prompts)]
    return jobs, n_faulted


def _pools(slots: int, threads: int | None) -> str:
    """The pools of every qladder server here; threads None: the INT4 pool's threads are the
    server's default ([cores] int4 = "elastic": every core the standby is not using)."""
    fixed = f"threads = {threads}\n" if threads is not None else ""
    return (f'[[pools]]\nname = "int4"\nrungs = ["int4"]\nslots = {slots}\n{fixed}max_queue = 64\n'
            f'weight = 1.0\nhandoff_to = "standby"\n[[pools]]\nname = "standby"\nrungs = ["fp32"]\nthreads = 1\n'
            f'sessions = 4\n')


def run_serve_bench(duration_s: float = 120.0, window_s: float = 60.0, rounds: int = 6, clients: int = 16,
                    fault_share: float = 0.1, max_tokens: int = 64, slots: int = 8, threads: int = 1,
                    burst_s: float = 30.0, recover_s: float = 120.0, n_prompts: int = 64, seed: int = 0,
                    log: Any = None, out_dir: Path | None = None, box: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns results.json's content (and, with `out_dir`, writes outcomes.jsonl
    and results.json there). `box`: the whole machine, as a user compares it: qladder's servers on
    their default cores (elastic INT4, standby 1 thread), llama-servers on every core (`threads`
    is then ignored)."""
    from qladder.model import inspect_model

    say = log or (lambda _m: None)
    info = inspect_model()
    jobs, n_faulted = _jobs(n_prompts, fault_share, max_tokens, seed)
    clean: list[Job] = [(pid, p, []) for pid, p, _ in jobs]
    work = Path(tempfile.mkdtemp(prefix="qladder-bench-serve-"))
    cpus = CoresSettings().cpus
    pools = _pools(slots, None if box else threads)
    if box:
        threads = cpus  # llama-server's -t/-tb
    clock = Clock()
    outcomes: list[Outcome] = []
    obs: dict[str, Any] = {}

    def guarded(name: str) -> QladderProcess:
        db = work / f"{name}.sqlite3"
        return QladderProcess(name, f'[server]\ndefault_max_tokens = {max_tokens}\nincidents = "{db}"\n' + pools,
                              ["--allow-faults"], work)

    peer_args = LlamaServer(info.path, n_parallel=slots, threads=threads, n_ctx_per_slot=2048)
    head: dict[str, Any] = {
        "benchmark": "qladder bench serve", "model": str(info.path.name),
        "config": {"duration_s": duration_s, "window_s": window_s, "rounds": rounds, "clients": clients,
                   "fault_share": fault_share, "faulted_prompts": n_faulted, "prompts": len(jobs),
                   "max_tokens": max_tokens, "slots": slots, "box": box, "cpus": cpus,
                   "int4_threads": f"elastic, up to {cpus}" if box else threads, "standby_threads": 1,
                   "llama_server_threads": threads,
                   "burst_s": burst_s, "seed": seed, "temperature": 0, "streaming": True,
                   "llama_server_args": peer_args.args[1:],
                   "processes": "each phase on fresh servers: faulted (guarded), burst (guarded), compare "
                                "(guarded, bare, llama_server, llama_server_aa)"},
        "versions": {**versions(), "llama_server": peer_args.version()}, "cpu": cpu(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workdir": str(work)}
    say("faulted phase: a guarded server")
    g1 = guarded("faulted").start()
    try:
        outcomes += asyncio.run(_closed_loop(g1.base_url, "guarded", "warmup", "warmup/faulted", 0, clean,
                                             min(clients, slots), 3.0, 16, clock))
        outcomes += _faulted_phase(g1, jobs, clients, duration_s, max_tokens, clock, obs, say)
    finally:
        g1.stop()
    g2 = guarded("burst").start()
    try:
        outcomes += _burst_phase(g2.base_url, clean, clients, burst_s, recover_s, max_tokens, clock, obs, say)
    finally:
        g2.stop()
    outcomes += _compare(work, pools, info.path, clean, clients, window_s, rounds, max_tokens, slots, threads,
                         clock, say, obs)
    _judge(outcomes, info, max_tokens, say)
    return _write({**head, "observations": obs}, outcomes, out_dir)


def _write(head: dict[str, Any], outcomes: list[Outcome], out_dir: Path | None, mode: str = RUN) -> dict[str, Any]:
    """results.json's content: the figures of `mode` (recompute.figures) from the outcomes as
    written to, and read back from, out_dir/outcomes.jsonl (when given)."""
    from qladder.validate.outcome import read_jsonl, write_jsonl
    from qladder.validate.recompute import figures

    if out_dir is None:
        return {**head, "figures": figures(outcomes, mode, head["observations"])}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "outcomes.jsonl", outcomes)
    results = {**head, "figures": figures(read_jsonl(out_dir / "outcomes.jsonl"), mode, head["observations"])}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def _faulted_phase(g: QladderProcess, jobs: list[Job], clients: int, seconds: float, max_tokens: int, clock: Clock,
                   obs: dict[str, Any], say: Any) -> list[Outcome]:
    say(f"faulted load: {clients} clients, {seconds:.0f} s")
    before = _scrape(g.base_url)
    out = asyncio.run(_closed_loop(g.base_url, "guarded", "faulted", "faulted", 0, jobs, clients, seconds,
                                   max_tokens, clock))
    time.sleep(1.0)  # the incident writer commits off the decode loop
    after = _scrape(g.base_url)
    db = g.workdir / f"{g.name}.sqlite3"
    with sqlite3.connect(db) as con:
        rows = int(con.execute("SELECT COUNT(*) FROM incidents").fetchone()[0])
    def delta(prefix: str) -> float:
        return _sum(after, prefix) - _sum(before, prefix)

    obs["faulted"] = {"incident_rows": rows, "metrics_hazards": delta("qladder_hazards_total{"),
                      "metrics_handoffs": delta("qladder_handoffs_total{"),
                      "quarantine_size": after.get("qladder_quarantine_size", 0.0)}
    return out


def _burst_phase(url: str, clean: list[Job], clients: int, burst_s: float, recover_s: float, max_tokens: int,
                 clock: Clock, obs: dict[str, Any], say: Any) -> list[Outcome]:
    say(f"fault burst: {burst_s:.0f} s, then clean traffic until the breaker closes")
    burst = [(f"burst-{k}", f"Burst question {k}: say something about the number {k}.", ["nan@step=1"])
             for k in range(10_000)]
    timeline: list[tuple[float, str]] = []
    t0 = time.perf_counter()

    async def sample_breaker(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=10) as h:
            while not done.is_set():
                mode = (await h.get(f"{url}/readyz")).json()["breakers"]["int4"]
                if not timeline or timeline[-1][1] != mode:
                    timeline.append((round(time.perf_counter() - t0, 2), mode))
                await asyncio.sleep(0.25)

    async def run() -> list[Outcome]:
        done = asyncio.Event()
        watcher = asyncio.ensure_future(sample_breaker(done))
        out = await _closed_loop(url, "guarded", "burst", "burst", 0, burst, clients, burst_s, max_tokens, clock)
        deadline = time.perf_counter() + recover_s
        k = 0
        while time.perf_counter() < deadline:
            out += await _closed_loop(url, "guarded", "recovery", f"recovery/{k}", 0, clean, clients, 5.0,
                                      max_tokens, clock)
            k += 1
            if len(timeline) > 1 and timeline[-1][1] == "closed":
                break
        done.set()
        await watcher
        return out

    out = asyncio.run(run())
    m = _scrape(url)
    obs["burst"] = {"timeline": timeline,
                    "transitions": {k.split('to="')[1].rstrip('"}'): v for k, v in m.items()
                                    if k.startswith('qladder_breaker_transitions_total{pool="int4"')}}
    return out


def _compare(work: Path, pools: str, gguf: Path, clean: list[Job], clients: int, window_s: float, rounds: int,
             max_tokens: int, slots: int, threads: int, clock: Clock, say: Any,
             obs: dict[str, Any] | None = None) -> list[Outcome]:
    servers: dict[str, Any] = {
        "guarded": QladderProcess("compare-guarded", f"[server]\ndefault_max_tokens = {max_tokens}\n"
                                  f'incidents = "{work / "compare.sqlite3"}"\n' + pools, [], work),
        "bare": QladderProcess("compare-bare", f'[server]\nguard = "off"\nincidents = "{work / "bare.sqlite3"}"\n'
                               + pools, [], work),
        "llama_server": LlamaServer(gguf, n_parallel=slots, threads=threads, n_ctx_per_slot=2048),
        "llama_server_aa": LlamaServer(gguf, n_parallel=slots, threads=threads, n_ctx_per_slot=2048)}
    out: list[Outcome] = []
    try:
        for s in servers.values():
            s.start()
        say("warm-up")
        for name, s in servers.items():
            out += asyncio.run(_closed_loop(s.base_url, name, "warmup", f"warmup/{name}", 0, clean,
                                            min(clients, slots), 3.0, 16, clock))
        names = list(servers)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                say(f"round {r + 1}/{rounds}: {name}, {window_s:.0f} s")
                out += asyncio.run(_closed_loop(servers[name].base_url, name, "compare", f"compare/{name}/r{r}", r,
                                                clean, clients, window_s, max_tokens, clock, start_at=r * 7))
        if obs is not None:  # the audit's coverage: answers it scored, of the answers each qladder gave;
            # and its prompt cache's hits (the clients cycle through the same prompts; llama-server
            # caches prompts by default too, --cache-ram, which gives no count)
            scraped = {name: _scrape(servers[name].base_url) for name in ("guarded", "bare")}
            obs["audit"] = {name: {"audited": _sum(m, "qladder_audit_answers_total{"),
                                   "answers": sum(1 for o in out if o.config == name)}
                            for name, m in scraped.items()}
            obs["prompt_cache"] = {name: {what: sum(v for k, v in m.items()
                                                    if k.startswith("qladder_prompt_cache{") and f'what="{what}"' in k)
                                          for what in ("hits", "misses", "entries", "bytes")}
                                   for name, m in scraped.items()}
    finally:
        for s in servers.values():
            s.stop()
    return out


def _judge(outcomes: list[Outcome], info: Any, max_tokens: int, say: Any) -> None:
    """Every answer judged. llama-server's ids re-tokenized from its text (its chat stream gives
    none); the faulted phase's answers also scored by a local fp32 engine (the likelihood judge)."""
    from qladder.config import Settings
    from qladder.engines import load_engine
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.engines.torch_engine import TorchEngine
    from qladder.prepare import Preparer
    from qladder.validate.garbage import mean_nll

    judge_answers(outcomes, info)
    vocab = LlamaVocab(info)
    try:
        say("judging the faulted answers (fp32 likelihood)")
        fp32 = load_engine("fp32", info, Settings.from_env())
        assert isinstance(fp32, TorchEngine)  # the fp32 rung is torch's, which scores an answer
        preparer = Preparer(info, vocab.tokenize, 2048)
        try:
            for o in outcomes:
                if o.phase != "faulted" or not o.ok or o.fallback or not o.token_ids:
                    continue
                ids = preparer.encode_messages([{"role": "user", "content": o.prompt}], max_tokens)[0]
                try:
                    nll = mean_nll(fp32.score(ids, o.token_ids))
                except Exception:  # counted: unjudged unless a symptom decides
                    nll = None
                o.judge(nll, score_failed=nll is None)
        finally:
            fp32.close()
    finally:
        vocab.close()
