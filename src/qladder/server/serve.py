"""Build the server from a topology and run it under uvicorn, with a graceful drain on SIGTERM.

    server = build_server(load_topology(path))    engines, gateway, incident store, the FastAPI app
    run(server, host, port)                       uvicorn; SIGTERM/SIGINT: stop admitting, drain
                                                  in-flight streams up to drain_timeout_s, exit 0
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qladder.audit import DriftWatch
from qladder.client import EngineClient
from qladder.config import Settings, env_name
from qladder.engines.endpoint_board import EndpointBoard
from qladder.engines.llamacpp import LlamaVocab
from qladder.health.detector import committed, committed_drift_bound
from qladder.health.guard import GUARD_PRESETS
from qladder.incidents import IncidentBackend, IncidentWriter, is_postgres_url, open_incident_store
from qladder.model import ModelInfo
from qladder.policy import LadderConfig
from qladder.prepare import Preparer
from qladder.sanitize import PRESETS as SANITIZE_PRESETS
from qladder.server.app import create_app
from qladder.server.breaker import Breaker
from qladder.server.gateway import Gateway
from qladder.server.metrics import ServerMetrics
from qladder.server.quarantine import Quarantine
from qladder.server.router import Router
from qladder.server.shared_state import StateSync
from qladder.server.topology import Topology
from qladder.serving.engine import ServingConfig, ServingEngine, several
from qladder.serving.remote import RemoteConfig
from qladder.serving.scheduler import SchedulerConfig

_log = logging.getLogger("qladder.server")


def serving_config(t: Topology, settings: Settings) -> ServingConfig:
    int4, standby = t.int4, t.standby
    guard = GUARD_PRESETS[t.server.guard]
    off = t.server.guard == "off"
    from qladder.policy import LadderPolicy

    ladder = LadderConfig(guard=guard, policy=LadderPolicy(fail_on_engine_error=off), record_incidents=not off)
    # [cores]: elastic INT4 leases up to every core (cores.int4_threads) beside an in-process
    # standby; N, a remote INT4 rung or a remote standby (its server's cores are not ours to
    # lease): fixed threads, no lease (a remote standby: one INT4 thread unless int4 = N)
    elastic = t.cores.int4 == "elastic" and int4.endpoints is None and (standby is None or standby.endpoints is None)
    audit = int4.audit_share(standby)
    int4_threads = t.cores.cpus if elastic else t.cores.int4 if isinstance(t.cores.int4, int) else 1
    return ServingConfig(slots=int4.slots, n_ctx=t.model.n_ctx, int4_threads=int4_threads,
                         cores=t.cores.cpus if elastic else None, cores_linger_s=t.cores.linger_s,
                         standby_threads=standby.threads if standby else 1,
                         standby_rungs=tuple(standby.rungs) if standby else (),
                         standby_sessions=standby.sessions if standby else 1,
                         standby_queue=standby.max_queue if standby else 1,
                         scheduler=SchedulerConfig(max_queue=int4.max_queue,
                                                   prompt_cache_bytes=int4.prompt_cache_mb << 20), ladder=ladder,
                         allow_faults=t.server.allow_faults, remote_url=int4.endpoints,
                         standby_url=standby.endpoints if standby else None,
                         remote=RemoteConfig(max_inflight=int4.slots + int4.max_queue
                                             + (standby.sessions + standby.max_queue if standby else 0)),
                         audit_rate=audit, audit_spare_rate=int4.audit_spare_rate if audit > 0 else 0.0,
                         audit_budget=int4.audit_budget,
                         detector=committed() if int4.detect and audit > 0 else None)


@dataclass
class Server:
    topology: Topology
    app: Any
    gateway: Gateway
    engine: ServingEngine
    store: IncidentBackend
    writer: IncidentWriter
    vocab: LlamaVocab

    def close(self) -> None:
        try:
            if self.gateway.state is not None:
                self.gateway.state.close()
            self.engine.close()
        finally:
            self.writer.close()
            self.store.close()
            self.vocab.close()


def build_server(t: Topology, settings: Settings | None = None, api_keys: Sequence[str] = (),
                 clock: Any = time.monotonic, standby_engines: Sequence[Any] | None = None) -> Server:
    """standby_engines: engines for the standby's rungs, owned by the caller (tests share theirs)."""
    settings = settings or Settings.from_env()
    metrics = ServerMetrics()
    target = t.server.incidents
    if not is_postgres_url(target):  # a SQLite file
        target = str(Path(target).expanduser()) if target else str(settings.cache_dir / "incidents.sqlite3")
    store = open_incident_store(target, redact=t.server.redact)
    writer = IncidentWriter(store, on_commit=metrics.incidents_committed.inc)
    replicas = any(several(p.endpoints) for p in t.pools)
    board = EndpointBoard() if t.state.shared and replicas else None  # replicas' health, shared with peer gateways
    engine = ServingEngine(serving_config(t, settings), model=t.model.path or None, settings=settings,
                           incidents=writer, standby_engines=standby_engines, endpoints=board)
    engine.add_audit_observer(writer.audit)  # audits are stored beside the incidents
    try:
        vocab = LlamaVocab(engine.info)
        gw, app = assemble(engine, engine.info, vocab, t, metrics, api_keys, clock, board)
    except BaseException:
        engine.close()
        writer.close()
        store.close()
        raise
    return Server(t, app, gw, engine, store, writer, vocab)


def assemble(client: EngineClient, info: ModelInfo, vocab: LlamaVocab, t: Topology, metrics: ServerMetrics,
             api_keys: Sequence[str] = (), clock: Any = time.monotonic,
             endpoints: EndpointBoard | None = None) -> tuple[Gateway, Any]:
    """The gateway and the FastAPI app over any EngineClient (the real engine, or a test's fake).
    endpoints: the board the client's replicas post to (shared through [state] with the rest)."""
    preparer = Preparer(info, vocab.tokenize, min(client.n_ctx), SANITIZE_PRESETS[t.server.sanitize])
    shared = t.state.shared
    if shared and clock is time.monotonic:  # gateways compare a shared breaker's times: wall-clock ones
        clock = time.time
    breakers = {p.name: Breaker(p.name, t.breaker, clock, on_change=metrics.on_breaker_change, shared=shared)
                for p in t.pools}
    quarantine = Quarantine(t.quarantine, clock, shared=shared)
    router = Router(t.pools, breakers, quarantine)
    standby = t.standby
    drift_bound = committed_drift_bound() if t.server.verify_below is None else t.server.verify_below
    gw = Gateway(client, preparer, vocab.detokenize_bytes, vocab.n_vocab, t.server.model_name, router, breakers,
                 quarantine, metrics, t.server.default_max_tokens, t.server.allow_faults,
                 standby.sessions if standby else 0, vocab.control_ids, t.int4.precision,
                 client.verifies, DriftWatch(drift_bound) if drift_bound > 0 else None)
    if gw.drift is not None:
        client.add_audit_observer(gw.drift.record)
    client.add_audit_observer(metrics.observe_audit)
    if isinstance(client, ServingEngine) and client.watch is not None:
        client.alarm_observers.append(metrics.on_alarm)
        metrics.watch_detector(client.stats, client.int4_endpoints)
    metrics.watch_pools(client.stats, {"int4": t.int4.name, **({"standby": standby.name} if standby else {})})
    metrics.watch_breakers(breakers)
    metrics.watch_quarantine(quarantine)
    if shared:
        metrics.state_shared.set(0)  # until the first sync reaches the store
        gw.state = StateSync(t.state, dict(breakers), quarantine, on_status=metrics.state_shared.set,
                             endpoints=endpoints).start()
        gw.state.sync_now()  # join the fleet's state before the first request (a failure: the local view)
        metrics.watch_state(gw.state)
    return gw, create_app(gw, frozenset(api_keys), t.server.max_body_bytes)


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT; then refuse new requests (503 on open connections, the socket
    closed), let in-flight answers finish for up to drain_timeout_s, close the engines, return."""
    import uvicorn

    class _Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.gateway.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn raises a caught SIGTERM again after its shutdown (the process then dies of
            # it); a drain that finished is a clean exit here: status 0, as supervisors expect.
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=max(1, round(server.topology.server.drain_timeout_s)),
                            lifespan="off")
    try:
        _Draining(config).run()
    finally:
        server.close()


WORKER_ENV = env_name("serve_worker")  # the folder (0700) where each worker reads what it builds
SUPERVISOR_ENV = env_name("serve_supervisor")  # the supervisor's pid: a retrying worker ends when it is gone
_TOPOLOGY, _FAILED = "topology.pickle", "failed.txt"  # the topology and keys (0600); a worker's start-up failure
_STARTED = "started"  # touched by each worker whose lifespan started: the gateway serves
MAX_RESTART_WAIT_S = 30.0  # a restarted worker that cannot build tries again, backing off to this


def check_workers(t: Topology, workers: int) -> str | None:
    """ConfigError unless `workers` gateway processes can serve `t`: every pool on servers (url or
    urls; an in-process rung's model belongs to one process). A warning to print, or None."""
    from qladder.errors import ConfigError

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and not all(p.endpoints is not None for p in t.pools):
        raise ConfigError("--workers > 1 needs every pool on servers (url or urls): an in-process rung holds the "
                          "model in one process; run one `qladder serve` a process instead")
    if workers > 1 and not t.state.shared:
        return (f"--workers {workers} with [state] backend = \"memory\": each worker keeps its own breakers and "
                "quarantine (share them: [state] backend = \"redis\")")
    return None


def run_workers(t: Topology, api_keys: Sequence[str], workers: int, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> None:
    """`qladder serve --workers N`: N gateway processes on one port (uvicorn's supervisor binds the
    socket once and restarts a worker that dies), each with its own engine client and state sync,
    sharing breakers and quarantine through the configured store. Remote pools only
    (`check_workers`). The workers read the topology and the API keys from a file only this user
    can read (never the environment, which `ps e` shows). A worker that cannot build its server
    (a server unreachable at start, a tokenizer refused) exits with uvicorn's STARTUP_FAILURE: the
    supervisor stops every worker, and this raises QladderError with the worker's reason (no
    restart loop, no exit 0); a worker restarted later that cannot build retries (`worker_app`).
    SIGTERM: each worker stops accepting, finishes its open answers for
    up to drain_timeout_s, then closes."""
    import os
    import pickle
    import tempfile

    import uvicorn

    from qladder.errors import QladderError

    check_workers(t, workers)
    with tempfile.TemporaryDirectory(prefix="qladder-workers-") as folder:  # 0700
        path = Path(folder) / _TOPOLOGY
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            pickle.dump((t, tuple(api_keys)), f)
        os.environ[WORKER_ENV], os.environ[SUPERVISOR_ENV] = folder, str(os.getpid())
        try:
            uvicorn.run("qladder.server.serve:worker_app", factory=True, host=host, port=port, workers=workers,
                        log_level=log_level, access_log=False, lifespan="on",
                        timeout_graceful_shutdown=max(1, round(t.server.drain_timeout_s)))
        finally:
            del os.environ[WORKER_ENV], os.environ[SUPERVISOR_ENV]
        failed = Path(folder) / _FAILED
        if failed.exists():
            why = failed.read_text(errors="replace").splitlines() or ["(no reason written)"]
            raise QladderError(f"a gateway worker could not start: {why[0]}")


def worker_app() -> Any:
    """One worker's ASGI app (uvicorn's factory, in the worker's process): the server built from
    the parent's topology, closed when uvicorn shuts the worker down (the lifespan's end). A
    failure to build it while the gateway starts is written for the parent and ends the worker
    with STARTUP_FAILURE (the command fails); once any worker has served, a worker uvicorn
    restarted (one that died) that cannot build tries again, backing off, and its siblings serve
    meanwhile: a peer down at that moment must not stop the whole gateway (`_build_retrying`).
    A worker counts as serving from its lifespan's start (the `started` marker)."""
    import os

    folder = Path(os.environ[WORKER_ENV])
    parent = int(os.environ.get(SUPERVISOR_ENV) or os.getppid())  # (getppid is 1 once it is gone)

    def stop(sig: int, frame: Any) -> None:  # uvicorn's own handler only sets a flag its loop reads
        raise SystemExit(0)

    # Until the server is built, SIGTERM/SIGINT end this worker at once: uvicorn's handler would only
    # set a flag, and a worker retrying below would never read it (the supervisor joins it forever).
    held = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # A signal between uvicorn's handlers and these (while this module was imported) only set
        # uvicorn's flag: read it, or the worker would build (and retry) past its own stop.
        if any(getattr(getattr(h, "__self__", None), "should_exit", False) for h in held.values()):
            raise SystemExit(0)
        server = _build_retrying(folder, parent)
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await server.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                (folder / _STARTED).touch()  # this worker serves: from now on, a restart retries
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                server.gateway.draining = True
                await asyncio.to_thread(server.close)
                await send({"type": "lifespan.shutdown.complete"})
                return

    return app


def _build_retrying(folder: Path, parent: int) -> Server:
    """The server from the parent's topology. At the gateway's start (no worker has served yet) a
    failure is written for the parent and ends this worker with STARTUP_FAILURE; later (a worker
    uvicorn restarted while its siblings serve, a peer down at that moment) it tries again,
    backing off to MAX_RESTART_WAIT_S, and gives up only when its parent is gone."""
    import os
    import pickle
    import sys
    import time

    from uvicorn.config import STARTUP_FAILURE

    wait = 1.0
    while True:
        try:
            with open(folder / _TOPOLOGY, "rb") as f:  # written by run_workers, this user's alone
                t, keys = pickle.load(f)
            return build_server(t, api_keys=keys)
        except Exception as exc:
            if not (folder / _STARTED).exists():  # the gateway's start: the command fails with the reason
                _log.error("this gateway worker could not start: %s", exc)
                with contextlib.suppress(OSError), open(folder / _FAILED, "a") as out:
                    out.write(f"{exc}\n")
                sys.exit(STARTUP_FAILURE)
            _log.error("this restarted gateway worker could not start (%s); trying again in %.0f s", exc, wait)
            time.sleep(wait)
            if os.getppid() != parent:  # the supervisor died (SIGKILL): nobody will stop this worker
                sys.exit(0)
            wait = min(MAX_RESTART_WAIT_S, 2 * wait)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
