"""A remote standby's drift audits: the INT4 answers a vLLM standby scores teacher-forced through
`prompt_logprobs` (engines/remote_vllm.py `score_top`: each answer token's logprob and rank, and
fp32's top k there), turned into the same records as the in-process auditor's (audit.score_top:
agreement, first divergence and fp32_gap exact, the excess bounded so the detector's calibrated
false-alarm rate holds).

Jobs wait in an AuditQueue (urgent first, then the newest) and are scored on the remote pool's
loop one at a time: an ordinary job waits while the standby is continuing handoffs (its spare
capacity only; an urgent one, what decides an alarm, does not), and the time each call is in
flight is charged to the audit's budget: as the box's cores where the standby is served from this
machine (it then holds cores INT4 decodes without), else as one core's (`charge_for`).
`offer` and `pending` are called from any thread; everything else runs on the loop's thread."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import TypeGuard

import httpx

from qladder.audit import AuditJob, AuditRecord, score_top
from qladder.engines.remote_vllm import VllmRung
from qladder.engines.replicas import Replicas
from qladder.errors import RemoteStreamError, RemoteTransportError
from qladder.serving.audit_queue import AuditQueue, QueuedAuditor

_log = logging.getLogger("qladder.audit")
TOP_K = 20  # fp32's top entries a position asks for (vLLM's --max-logprobs caps them: qladder starts it at 20)
IDLE_POLL_S = 0.05  # how often an ordinary job waiting for the standby's spare capacity looks again


def on_this_machine(url: str) -> bool:
    """Whether a server's URL is this machine's loopback (its host, a loopback address or name)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def charge_for(rung: VllmRung | Replicas, box_cores: int) -> float:
    """The cores a second of an audit call in flight costs INT4. A standby served from this
    machine (every endpoint on loopback) shares its cores with the INT4 servers: vLLM's engine and
    its API server (prompt logprobs: the top k of every position, detokenized) hold more than one
    core while a call is in flight, and every core they hold is one INT4 decodes without, so a
    second is charged as the box's cores. Elsewhere, one core's (its own machine's; the budget
    then bounds the audit's share of the standby)."""
    urls = [e.base_url for e in rung.endpoints] if isinstance(rung, Replicas) else [rung.base_url]
    return float(box_cores) if all(on_this_machine(u) for u in urls) else 1.0


def scores_top(rung: object) -> TypeGuard[VllmRung | Replicas]:
    """Whether a remote rung can score an audited answer's rows: a vLLM server, or replicas of one."""
    if isinstance(rung, Replicas):
        return all(isinstance(e, VllmRung) for e in rung.endpoints)
    return isinstance(rung, VllmRung)


class RemoteAuditor(QueuedAuditor):
    def __init__(self, rung: VllmRung | Replicas, n_vocab: int, on_record: Callable[[AuditRecord], None],
                 spawn: Callable[[Callable[[httpx.AsyncClient], Coroutine[object, object, None]]], None],
                 call_soon: Callable[..., None], busy: Callable[[], bool], max_jobs: int = 64,
                 k: int = TOP_K, clock: Callable[[], float] = time.monotonic, charge_cores: float = 1.0):
        """spawn/call_soon: the remote pool's (work on its loop); busy: whether the standby is
        continuing handoffs now (read on the loop); charge_cores: the cores a second of a call in
        flight is charged as (`charge_for`)."""
        self.rung, self.n_vocab, self.on_record, self.k = rung, n_vocab, on_record, k
        self.charge_cores = charge_cores
        self._spawn, self._call_soon, self._busy, self.clock = spawn, call_soon, busy, clock
        self.queue = AuditQueue(max_jobs)
        self.done = 0
        self.failed = 0  # jobs whose call failed (the server's error, or its answer malformed)
        self._running = False  # a drain is on the loop (loop thread)
        self._current = 0  # a job taken and not yet delivered (loop thread; read for `pending`)

    # -- any thread ------------------------------------------------------------------------------
    def offer(self, job: AuditJob) -> None:
        super().offer(job)
        self._call_soon(self._kick)

    @property
    def pending(self) -> int:
        return self.queue.waiting + self._current

    # -- the loop's thread -----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._running:
            self._running = True
            self._spawn(self._drain)

    async def _drain(self, client: httpx.AsyncClient) -> None:
        try:
            while True:
                self._current = 1  # (before the take: `pending` may count one too many, never one too few)
                job = self.queue.take()
                if job is None:
                    self._current = 0
                    break
                try:
                    while not job.urgent and self._busy() and not self.queue.urgent_waiting:
                        await asyncio.sleep(IDLE_POLL_S)  # the standby's spare capacity only
                    if not job.urgent and self.queue.urgent_waiting:  # one came meanwhile: it goes first
                        self.queue.put_back(job)
                        continue
                    await self._score(client, job)
                finally:
                    self._current = 0
        finally:
            self._running = False

    async def _score(self, client: httpx.AsyncClient, job: AuditJob) -> None:
        t0 = self.clock()
        try:
            rows = await self.rung.score_top(client, list(job.prompt_ids), list(job.answer_ids), self.k)
        except (RemoteStreamError, RemoteTransportError, httpx.HTTPError) as exc:
            _log.warning("audit of request %s failed at the standby: %s", job.request_id, exc)
            self.failed += 1
            return
        finally:
            now = self.clock()
            self.queue.charge(now, (now - t0) * self.charge_cores)
        record = score_top(job, rows, self.n_vocab)
        self.done += 1
        self.on_record(record)
