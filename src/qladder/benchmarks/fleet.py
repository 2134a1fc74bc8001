"""`qladder bench fleet`: two gateways sharing state in Redis, over two llama-server replicas.

On this machine, as child processes on 127.0.0.1: a Redis and a PostgreSQL server
(qladder.peers.stores), two llama-server replicas of the embedded GGUF (1 thread each), and two
`qladder serve` gateways A and B with the same topology: one INT4 pool on both replicas (`urls`),
an in-process fp32 standby, `[state] backend = "redis"`, incidents in the one PostgreSQL database
(A allows faults: the burst phase injects them there). `clients` streaming clients, half on each
gateway, greedy answers of `max_tokens`. Phases, in this order:

1. compare: `rounds` interleaved rounds of one `window_s` window each, the fleet (clients over A
   and B) and `direct` (the same clients straight at the two replicas, half each: round-robin);
   tok/s of a window = its answers' tokens over its span.
2. kill: fleet load; at `kill_at_s` one replica is killed with SIGKILL, restarted on its port
   `restart_after_s` later. Both gateways' /readyz are sampled every 50 ms: when each saw the
   replica ejected (`time_to_eject_s`: the later of the two, from the kill) and back
   (`time_to_rejoin_s`: from the restarted replica's first /health answer). The answers in flight
   at the kill are compared with their prompt's answer in the compare phase (greedy: the unbroken
   answer).
3. redis: fleet load; Redis is killed (SIGKILL) at `kill_at_s` and restarted (empty) 5 s later;
   /readyz's "state" sampled on both gateways.
4. burst: after a quiet breaker window (the earlier phases' clean outcomes have left it), every
   client at A, every request faulted (`nan@step=1`; B gets none: its clean outcomes would feed
   the same shared window); both gateways' INT4 breakers sampled every 50 ms
   (`breaker_seen_by_peer_s`: B's first "open" after A's); then a prompt A quarantined is sent,
   unfaulted, to B (its route).
5. incidents: the PostgreSQL table's rows against the hazards both gateways' /metrics counted.

Every request is a line of outcomes.jsonl; what was sampled besides is `observations`; every
figure and verdict is computed from both by `qladder.validate.fleet_figures` (`python -m
qladder.validate.recompute DIR` recomputes them; bench/check_fleet.py exits 1 on a miss).
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from qladder.benchmarks.common import judge_answers
from qladder.benchmarks.serve_load import Clock, Job, QladderProcess, _closed_loop, _jobs, _scrape, _sum, _write
from qladder.environment import cpu, versions
from qladder.peers.llama_server import LlamaServer
from qladder.peers.stores import PostgresServer, RedisServer
from qladder.server.breaker import BreakerConfig
from qladder.validate.outcome import Outcome

RUN = "bench-fleet"
BREAKER_WINDOW_S = BreakerConfig().window_s  # the gateways' (the defaults)


def _topology(urls: list[str], redis_url: str, pg_url: str, max_tokens: int, slots: int) -> str:
    quoted = ", ".join(f'"{u}"' for u in urls)
    return (f'[server]\ndefault_max_tokens = {max_tokens}\nincidents = "{pg_url}"\n'
            f'[[pools]]\nname = "edge"\nrungs = ["llama-server"]\nurls = [{quoted}]\nslots = {slots}\n'
            f'max_queue = 64\nweight = 1.0\nhandoff_to = "standby"\n'
            f'[[pools]]\nname = "standby"\nrungs = ["fp32"]\nthreads = 1\nsessions = 4\n'
            f'[state]\nbackend = "redis"\nurl = "{redis_url}"\n')


async def _readyz(h: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        body: dict[str, Any] = (await h.get(f"{url}/readyz", timeout=2.0)).json()
        return body
    except (httpx.HTTPError, ValueError):
        return None


async def _sample(urls: dict[str, str], read: Callable[[dict[str, Any]], Any], done: asyncio.Event,
                  t0: float, every_s: float = 0.05) -> dict[str, list[tuple[float, Any]]]:
    """Each gateway's /readyz, read by `read`, every `every_s` until `done`: (seconds since t0,
    value) at each change."""
    seen: dict[str, list[tuple[float, Any]]] = {name: [] for name in urls}
    async with httpx.AsyncClient() as h:
        while not done.is_set():
            for name, url in urls.items():
                body = await _readyz(h, url)
                value = read(body) if body is not None else None
                if not seen[name] or seen[name][-1][1] != value:
                    seen[name].append((round(time.perf_counter() - t0, 3), value))
            await asyncio.sleep(every_s)
    return seen


def _first(timeline: list[tuple[float, Any]], value: Any, after: float = 0.0) -> float | None:
    """When a sampled timeline (its changes) first holds `value` from `after` on: `after` itself
    when the value it held then already was `value` (it changed before `after`)."""
    then = [v for t, v in timeline if t <= after]
    if then and then[-1] == value:
        return after
    return next((t for t, v in timeline if v == value and t >= after), None)


async def _fleet_load(gateways: list[QladderProcess], phase: str, jobs: list[Job], clients: int, seconds: float,
                      max_tokens: int, clock: Clock, start_at: int = 0, rnd: int = 0) -> list[Outcome]:
    """`clients` closed-loop clients for `seconds`, half on each gateway."""
    per = [clients // 2, clients - clients // 2]
    parts = await asyncio.gather(*(
        _closed_loop(g.base_url, f"fleet_{g.name}", phase, f"{phase}/fleet/r{rnd}", rnd, jobs, n, seconds,
                     max_tokens, clock, start_at=start_at + 1000 * k)
        for k, (g, n) in enumerate(zip(gateways, per, strict=True))))
    return [o for p in parts for o in p]


async def _direct_load(replicas: list[LlamaServer], jobs: list[Job], clients: int, seconds: float, max_tokens: int,
                       clock: Clock, rnd: int) -> list[Outcome]:
    per = [clients // 2, clients - clients // 2]
    parts = await asyncio.gather(*(
        _closed_loop(r.base_url, "llama_server_direct", "compare", f"compare/direct/r{rnd}", rnd, jobs, n, seconds,
                     max_tokens, clock, start_at=rnd * 7 + 1000 * k)
        for k, (r, n) in enumerate(zip(replicas, per, strict=True))))
    return [o for p in parts for o in p]


def run_fleet_bench(window_s: float = 30.0, rounds: int = 6, clients: int = 16, max_tokens: int = 64,
                    slots: int = 8, phase_s: float = 20.0, kill_at_s: float = 5.0, restart_after_s: float = 3.0,
                    burst_s: float = 10.0, n_prompts: int = 32, seed: int = 0, log: Any = None,
                    out_dir: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; returns results.json's content (and writes outcomes.jsonl and
    results.json into `out_dir` when given)."""
    from qladder.model import inspect_model

    say = log or (lambda _m: None)
    info = inspect_model()
    jobs, _ = _jobs(n_prompts, 0.0, max_tokens, seed)
    work = Path(tempfile.mkdtemp(prefix="qladder-bench-fleet-"))
    clock = Clock()
    outcomes: list[Outcome] = []
    obs: dict[str, Any] = {}
    redis, pg = RedisServer().start(), PostgresServer().start()
    replicas = [LlamaServer(info.path, n_parallel=slots // 2, threads=1, n_ctx_per_slot=2048) for _ in range(2)]
    head: dict[str, Any] = {
        "benchmark": "qladder bench fleet", "model": str(info.path.name),
        "config": {"window_s": window_s, "rounds": rounds, "clients": clients, "max_tokens": max_tokens,
                   "slots": slots, "phase_s": phase_s, "kill_at_s": kill_at_s, "restart_after_s": restart_after_s,
                   "burst_s": burst_s, "prompts": len(jobs), "seed": seed, "temperature": 0, "streaming": True,
                   "replicas": 2, "replica_threads": 1, "replica_args": replicas[0].args[1:],
                   "gateways": 2, "standby": "in-process fp32 in each gateway, 1 thread",
                   "processes": "redis-server, postgres, 2 llama-server, 2 qladder serve; one run, phases in order"},
        "versions": {**versions(), "llama_server": replicas[0].version()}, "cpu": cpu(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workdir": str(work)}
    gateways: list[QladderProcess] = []
    try:
        for r in replicas:
            r.start()
        config = _topology([r.base_url for r in replicas], redis.url, pg.url, max_tokens, slots)
        gateways = [QladderProcess("a", config, ["--allow-faults"], work).start(),
                    QladderProcess("b", config, [], work).start()]
        urls = {g.name: g.base_url for g in gateways}
        say("warm-up")
        outcomes += asyncio.run(_fleet_load(gateways, "warmup", jobs, clients, 3.0, 16, clock))
        outcomes += asyncio.run(_direct_load(replicas, jobs, clients, 3.0, 16, clock, 0))
        for o in outcomes:
            o.phase = "warmup"
        for rnd in range(rounds):  # interleaved: fleet then direct, then direct then fleet, ...
            for side in (("fleet", "direct") if rnd % 2 == 0 else ("direct", "fleet")):
                say(f"round {rnd + 1}/{rounds}: {side}, {window_s:.0f} s")
                outcomes += asyncio.run(
                    _fleet_load(gateways, "compare", jobs, clients, window_s, max_tokens, clock, rnd * 7, rnd)
                    if side == "fleet" else _direct_load(replicas, jobs, clients, window_s, max_tokens, clock, rnd))
        outcomes += _kill_phase(gateways, replicas, urls, jobs, clients, phase_s, kill_at_s, restart_after_s,
                                max_tokens, clock, obs, say)
        outcomes += _redis_phase(gateways, redis, urls, jobs, clients, phase_s, kill_at_s, max_tokens, clock, obs,
                                 say)
        say(f"quiet for the breaker's window ({BREAKER_WINDOW_S:.0f} s): the burst's window holds the burst alone")
        time.sleep(BREAKER_WINDOW_S)
        outcomes += _burst_phase(gateways, urls, jobs, clients, burst_s, max_tokens, clock, obs, say)
        time.sleep(2.0)  # the writers commit off the decode loop
        _incidents(gateways, pg, obs)
    finally:
        for g in gateways:
            g.stop()
        for r in replicas:
            r.stop()
        redis.close()
        pg.close()
    judge_answers(outcomes, info)
    return _write({**head, "observations": obs}, outcomes, out_dir, RUN)


def _kill_phase(gateways: list[QladderProcess], replicas: list[LlamaServer], urls: dict[str, str], jobs: list[Job],
                clients: int, seconds: float, kill_at_s: float, restart_after_s: float, max_tokens: int,
                clock: Clock, obs: dict[str, Any], say: Any) -> list[Outcome]:
    say(f"kill: one replica killed at {kill_at_s:.0f} s of {seconds:.0f} s, restarted {restart_after_s:.0f} s later")
    victim = replicas[0]
    before = {g.name: _scrape(g.base_url) for g in gateways}

    async def run() -> list[Outcome]:
        done = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(_sample(urls, lambda b: b.get("stats", {}).get("int4_endpoints_healthy"),
                                                done, t0))
        load = asyncio.ensure_future(_fleet_load(gateways, "kill", jobs, clients, seconds, max_tokens, clock,
                                                 start_at=5000))
        await asyncio.sleep(kill_at_s)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        killed_at, kill_clock = time.perf_counter() - t0, clock.now()
        await asyncio.sleep(restart_after_s)
        await asyncio.to_thread(victim.stop)  # reaps it
        restart_at = time.perf_counter() - t0
        await asyncio.to_thread(victim.start)  # on its port, until its /health answers
        healthy_at = time.perf_counter() - t0
        out = await load
        await asyncio.sleep(max(0.0, healthy_at + 8.0 - (time.perf_counter() - t0)))  # room to see it rejoin
        done.set()
        seen = await sampler
        ejected = [_first(seen[n], 1, killed_at) for n in urls]
        back = [_first(seen[n], 2, healthy_at) for n in urls]
        obs["kill"] = {"killed_at_s": round(killed_at, 3), "kill_clock_s": kill_clock,
                       "restarted_at_s": round(restart_at, 3),
                       "healthy_at_s": round(healthy_at, 3), "timeline": seen,
                       "time_to_eject_s": None if None in ejected else round(max(e for e in ejected if e is not None)
                                                                             - killed_at, 3),
                       "time_to_rejoin_s": None if None in back else round(max(b for b in back if b is not None)
                                                                           - healthy_at, 3)}
        return out

    out = asyncio.run(run())
    after = {g.name: _scrape(g.base_url) for g in gateways}
    obs["kill"]["migrations"] = sum(_sum(after[n], 'qladder_endpoint_events{pool="edge",what="migrations"}')
                                    - _sum(before[n], 'qladder_endpoint_events{pool="edge",what="migrations"}')
                                    for n in after)
    return out


def _redis_phase(gateways: list[QladderProcess], redis: RedisServer, urls: dict[str, str], jobs: list[Job],
                 clients: int, seconds: float, kill_at_s: float, max_tokens: int, clock: Clock, obs: dict[str, Any],
                 say: Any) -> list[Outcome]:
    say(f"redis: killed at {kill_at_s:.0f} s of {seconds:.0f} s, restarted 5 s later")

    async def run() -> list[Outcome]:
        done = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(_sample(urls, lambda b: b.get("state", {}).get("shared"), done, t0))
        load = asyncio.ensure_future(_fleet_load(gateways, "redis", jobs, clients, seconds, max_tokens, clock,
                                                 start_at=9000))
        await asyncio.sleep(kill_at_s)
        await asyncio.to_thread(redis.stop)  # (off the loop: the load and the sampler go on)
        killed_at = time.perf_counter() - t0
        await asyncio.sleep(5.0)
        await asyncio.to_thread(redis.start)
        back_at = time.perf_counter() - t0
        out = await load
        await asyncio.sleep(1.0)
        done.set()
        seen = await sampler
        local = [_first(seen[n], False, killed_at) for n in urls]
        shared = [_first(seen[n], True, back_at) for n in urls]
        obs["redis"] = {"killed_at_s": round(killed_at, 3), "restarted_at_s": round(back_at, 3), "timeline": seen,
                        "local_view_seen": all(x is not None for x in local),
                        "rejoined_after_s": None if None in shared else round(
                            max(x for x in shared if x is not None) - back_at, 3)}
        return out

    return asyncio.run(run())


def _burst_phase(gateways: list[QladderProcess], urls: dict[str, str], jobs: list[Job], clients: int,
                 seconds: float, max_tokens: int, clock: Clock, obs: dict[str, Any], say: Any) -> list[Outcome]:
    say(f"burst: every client at gateway a, every request faulted, for {seconds:.0f} s")
    a, b = gateways
    burst: list[Job] = [(f"burst-{k}", f"Burst question {k}: say something about the number {k}.", ["nan@step=1"])
                        for k in range(10_000)]

    async def run() -> list[Outcome]:
        done = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(_sample(urls, lambda body: body.get("breakers", {}).get("edge"), done, t0))
        # every client at A (B's clean outcomes would feed the same shared window); B is watched
        out = await _closed_loop(a.base_url, "fleet_a", "burst", "burst/a", 0, burst, clients, seconds, max_tokens,
                                 clock)
        await asyncio.sleep(1.0)
        done.set()
        seen = await sampler
        opened = {n: _first(seen[n], "open") for n in urls}
        first_burst = next(o for o in out if o.config == "fleet_a")
        routes = {}
        async with httpx.AsyncClient(timeout=120) as h:  # the prompt A quarantined, unfaulted, at B (and A)
            for g in (b, a):
                r = await h.post(f"{g.base_url}/v1/chat/completions", json={
                    "model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": first_burst.prompt}]})
                routes[g.name] = (r.json().get("qladder") or {}).get("route") if r.status_code == 200 else r.status_code
        obs["burst"] = {"timeline": seen, "opened_at_s": opened,
                        "breaker_seen_by_peer_s": None if None in opened.values() else round(
                            (opened["b"] or 0.0) - (opened["a"] or 0.0), 3),
                        "quarantined_prompt": first_burst.prompt_id, "quarantined_prompt_routes": routes}
        return out

    return asyncio.run(run())


def _incidents(gateways: list[QladderProcess], pg: PostgresServer, obs: dict[str, Any]) -> None:
    import psycopg

    hazards = {g.name: _sum(_scrape(g.base_url), "qladder_hazards_total{") for g in gateways}
    with psycopg.connect(pg.url) as db:
        row = db.execute("SELECT COUNT(*) FROM incidents").fetchone()
    obs["incidents"] = {"postgres_rows": int(row[0]) if row else 0, "metrics_hazards": hazards,
                        "metrics_hazards_total": sum(hazards.values())}


def main() -> None:  # python -m qladder.benchmarks.fleet OUT
    import sys

    out = run_fleet_bench(log=lambda m: print(m, file=sys.stderr), out_dir=Path(sys.argv[1]) if len(sys.argv) > 1
                          else None)
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
