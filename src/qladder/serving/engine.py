"""The serving engine: the in-process implementation of the client interface (qladder.client).

    client = ServingEngine(ServingConfig(slots=8))        loads int4 (batched) + the standby
    async for event in client.generate(request): ...       TokenEvent* (HazardEvent|HandoffEvent)* FinalEvent
    client.abort(request_id)                               frees the slot at the next step
    result = client.generate_sync(request)                 the same, blocking (the CLI)

`qladder.client.EngineClient` is the protocol (the shape of vLLM's `EngineClient`: generate as an
async iterator, abort by id); `ServingEngine` implements it in-process over the INT4 scheduler and the standby
pool. A generator that is closed before its final event (a client that went away) aborts its
request, so a disconnected client never keeps decoding.

Fault injection is test machinery: a request that carries faults is refused unless the operator
built the engine with `allow_faults=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from qladder.actions import MoveTo
from qladder.audit import AuditJob, AuditRecord, AuditTrail, selected
from qladder.classify import classify
from qladder.client import AsyncEvents, Request
from qladder.config import Settings
from qladder.engines.base import Engine, check_handoff
from qladder.engines.endpoint_board import EndpointBoard
from qladder.engines.llamacpp_batch import BatchedLlamaCpp
from qladder.engines.remote import RemoteRung
from qladder.engines.remote_llama import LlamaServerRung
from qladder.engines.remote_vllm import VllmRung
from qladder.engines.replicas import Replicas
from qladder.engines.torch_batch import BatchedTorch
from qladder.errors import ConfigError, InputError, QueueFullError, check_prompt_fits
from qladder.health.detector import Detector
from qladder.health.guard import StepGuard
from qladder.incidents import Incident, IncidentSink
from qladder.machine import RequestMachine
from qladder.model import ModelInfo, inspect_model, user_prompt_ids
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.serving.aborts import AbortRegistry
from qladder.serving.audit_queue import SPENT_WINDOW_S
from qladder.serving.auditor import Auditor
from qladder.serving.cores import Cores
from qladder.serving.drafts import should_draft
from qladder.serving.endpoint_watch import Alarm, EndpointWatch
from qladder.serving.handoffs import Handoffs
from qladder.serving.remote import RemoteConfig, RemotePool
from qladder.serving.remote_auditor import RemoteAuditor, charge_for, scores_top
from qladder.serving.remote_probe import probe_answer
from qladder.serving.scheduler import Int4Scheduler, SchedulerConfig
from qladder.serving.standby import StandbyPool
from qladder.types import Event, FinalEvent, GenerationResult, Hazard

if TYPE_CHECKING:
    from qladder.testing.faults import Fault

_log = logging.getLogger("qladder.serving")
# The remote rungs this engine drives from its remote pool (a ladder's rungs are sorted by type:
# any other rung is an in-process Engine on the standby's thread).
Remote = LlamaServerRung | VllmRung | Replicas
Urls = str | tuple[str, ...]  # one server, or replicas of it (a pool of endpoints: engines/replicas.py)


def several(urls: Urls | None) -> bool:
    """Whether a pool's `url`/`urls` name replicas (a Replicas rung), not one server (None: in-process)."""
    return urls is not None and not isinstance(urls, str) and len(urls) != 1


def remote_rung(cls: type[LlamaServerRung] | type[VllmRung], info: ModelInfo, urls: Urls,
                board: EndpointBoard | None = None) -> Remote:
    """The rung on one server, or on replicas of it (each tokenizer-probed; one that fails closes
    those already open). board: endpoint health shared with peer gateways (replicas only)."""
    if not several(urls):
        return cls(info, urls if isinstance(urls, str) else urls[0])
    opened: list[LlamaServerRung | VllmRung] = []
    try:
        for url in urls:
            opened.append(cls(info, url))
        return Replicas(opened, board=board)
    except BaseException:
        for e in opened:
            e.close()
        raise


@dataclass(frozen=True)
class ServingConfig:
    slots: int = 8  # INT4 sequences decoded together (llama.cpp n_seq_max)
    n_ctx: int = 2048  # per slot
    int4_threads: int = 1  # 2 cores: one for the INT4 pool...
    standby_threads: int = 1  # ...one for the standby
    # Shared cores: the pools lease the machine's `cores` per compute call (serving/cores.py), each
    # up to its threads above: the standby always its own, INT4 every core while the standby has
    # been idle for `cores_linger_s`, the rest while it works (elastic INT4: int4_threads = cores,
    # the server's default). None: the fixed counts above, no lease.
    cores: int | None = None
    cores_linger_s: float = 0.25
    standby_rungs: tuple[str, ...] = ("fp32",)
    standby_sessions: int = 4  # handoffs stepped at once; more wait in a FIFO queue
    standby_queue: int = 256
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    allow_faults: bool = False  # operators and test harnesses only; a client can never switch it on
    prefix_cache: bool = True  # prefill the chat template's system turn once; slots copy its KV
    remote_url: Urls | None = None  # rung 0 on a llama-server at this URL (or replicas) instead of in-process int4
    standby_url: Urls | None = None  # the server(s) of a remote standby rung (standby_rungs = ("vllm",))
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    # Verified requests that draft on INT4 at once (with the standby's handoffs counted in); the
    # others are answered by the full-precision rung alone (drafts.should_draft).
    verify_drafting: int = 1
    # The audit (qladder.audit): this share of INT4 answers scored teacher-forced by the standby's
    # first rung in the background, in its turns with nothing else to do (0: none), at most
    # `audit_queue` waiting; `audit_spare_rate` (if higher) while the INT4 pool has a free slot
    # and nothing queued, the audit's core-time over the last 30 s is under `audit_budget` of the
    # box's (`cores`, else every CPU) and its queue is short: the floor always runs (alone at full
    # load), the rest within the budget.
    audit_rate: float = 0.0
    audit_spare_rate: float = 0.0
    audit_budget: float = 0.1
    audit_queue: int = 64
    # The endpoint detector (health/detector.py) on the audit's scores: None, none. With it, a
    # suspect INT4 pool has every answer audited until the test decides; an ejected one's requests
    # are the standby's from their first token, and the pool is probed (an unshown INT4 answer to
    # a real prompt, audited) at most every `probe_every_s` until clean probes bring it back.
    detector: Detector | None = None
    probe_every_s: float = 5.0


def template_prefix(info: ModelInfo, tokenize: Callable[[str, bool], list[int]]) -> list[int]:
    """The ids every chat prompt starts with: the template's rendering up to the user's content
    (SmolLM2: its default system turn, 24 tokens of a typical 40-60)."""
    a = user_prompt_ids(info.chat_template, "a", tokenize)
    b = user_prompt_ids(info.chat_template, "b", tokenize)
    n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


class ServingEngine:
    """Rung 0 (the INT4 pool: batched llama.cpp on one scheduler thread, or a llama-server) and
    the standby's rungs (in-process full precision on one worker thread, or a vLLM server); the
    remote rungs share one asyncio thread (serving/remote.py)."""

    def __init__(self, config: ServingConfig | None = None, model: ModelInfo | str | None = None,
                 settings: Settings | None = None, incidents: IncidentSink | None = None,
                 standby_engines: Sequence[Engine | Remote] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 observers: Sequence[Callable[[Event], None]] = (), endpoints: EndpointBoard | None = None):
        """observers: called on the serving threads with every event of every request, whether
        or not its client still listens (metrics, breakers); each must be quick and thread-safe.
        endpoints: the replicas' health shared with peer gateways (the gateway's state sync
        carries it; None: this process alone)."""
        import torch

        self.config = c = config or ServingConfig()
        self.settings = s = settings or Settings.from_env()
        self.info = model if isinstance(model, ModelInfo) else inspect_model(model, s.cache_dir)
        self.incidents = incidents
        self.clock = clock
        self.observers = list(observers)
        self.endpoints = endpoints
        # torch runs the standby (and tiny guard ops); under a lease the standby sets its own per forward
        torch.set_num_threads(1 if c.cores is not None else c.standby_threads)
        self.int4: BatchedLlamaCpp | LlamaServerRung | Replicas
        if c.remote_url is not None:  # rung 0 is a llama-server: its tokenizer is checked here
            int4 = remote_rung(LlamaServerRung, self.info, c.remote_url, endpoints)
            assert not isinstance(int4, VllmRung)
            self.int4 = int4
        else:
            self.int4 = BatchedLlamaCpp(self.info, n_slots=c.slots, n_ctx=c.n_ctx, n_threads=c.int4_threads,
                                        native_dir=s.cache_dir if s.int4_monitor else None)
            if c.prefix_cache:  # before the scheduler thread owns the engine
                self.int4.cache_prefix(template_prefix(self.info, self.int4.tokenize))
        self._owned: list[Engine | Remote] = []
        if standby_engines is None:
            standby_engines = [self._load_standby(r, s) for r in c.standby_rungs]
            self._owned = list(standby_engines)
        for e in standby_engines:
            check_handoff(self.int4, e)
        self.standby_engines = list(standby_engines)
        self.rungs = [self.int4.name, *(e.name for e in self.standby_engines)]
        self.n_ctx = [self.int4.n_ctx, *(e.n_ctx for e in self.standby_engines)]  # per slot, or the server's
        self.cores = Cores(c.cores, c.cores_linger_s) if c.cores is not None else None
        self._guards: dict[object, StepGuard] = {c.ladder.guard: StepGuard(c.ladder.guard, self.info.identity)}
        self.aborts = AbortRegistry()
        self.audit_observers: list[Callable[[AuditRecord], object]] = []
        self.draft_limit = c.verify_drafting  # a knob: `qladder bench verified` sets it per window
        self.audit_rate = c.audit_rate  # the same (0 switches audits off; > 0 needs c.audit_rate > 0)
        self._drafting: set[str] = set()  # verified requests drafting now, behind _drafting_lock
        self._drafting_lock = threading.Lock()
        remote: dict[int, RemoteRung] = {0: self.int4} if not isinstance(self.int4, BatchedLlamaCpp) else {}
        local: dict[int, Engine] = {}
        for j, r in enumerate(standby_engines, start=1):
            if isinstance(r, LlamaServerRung | VllmRung | Replicas):
                remote[j] = r
            else:
                local[j] = r
        # Each rung's pool: in-process full precision on the standby's thread, remote ones on the
        # remote pool's loop; a request leaving any pool for rung j goes to j's (`handoffs`).
        self.handoffs = Handoffs({})
        self.standby = StandbyPool(local, self.aborts, c.standby_sessions, c.standby_queue,
                                   on_return=self._return, forward=self.handoffs.submit, clock=clock,
                                   on_checked=self._checked, verify_sessions=c.slots, cores=self.cores,
                                   threads=c.standby_threads,
                                   on_audit=self._audited if c.audit_rate > 0 or c.detector else None,
                                   audit_queue=c.audit_queue) \
            if local else None
        self.remote = RemotePool(remote, self.aborts, c.remote, forward=self.handoffs.submit, clock=clock) \
            if remote else None
        self.handoffs.pools.update({j: self.standby for j in local if self.standby is not None})
        self.handoffs.pools.update({j: self.remote for j in remote if self.remote is not None})
        # a vLLM standby scores the audited answers through its prompt logprobs, on the remote
        # pool's loop, in the turns it is not continuing handoffs (serving/remote_auditor.py)
        self.remote_auditor: RemoteAuditor | None = None
        scorer = remote.get(1)
        if (c.audit_rate > 0 or c.detector) and self.remote is not None and scores_top(scorer):
            rp = self.remote
            self.remote_auditor = RemoteAuditor(scorer, self.info.n_vocab, self._audited, rp.spawn,
                                                rp.call_soon, lambda: rp.standby_active > 0,
                                                max_jobs=c.audit_queue, clock=clock,
                                                charge_cores=charge_for(scorer, c.cores or os.cpu_count() or 1))
        # the endpoint detector: INT4's endpoints (the in-process pool, or each llama-server replica)
        # audited by the standby's first rung (in-process, or vLLM)
        self.watch: EndpointWatch | None = None
        if c.detector is not None and self.audits:
            self.watch = EndpointWatch(c.detector, c.probe_every_s)
            self.watch.observers.append(self._alarm)
            self.audit_observers.append(self.watch.record)
            assert self.auditor is not None
            self.auditor.prefer = self.watch.audit_all
        self.probes = 0  # unshown INT4 answers sent to probe an ejected pool
        self.alarm_observers: list[Callable[[Alarm], None]] = []
        self.scheduler: Int4Scheduler | RemotePool
        if self.watch is not None and self.standby is not None:  # never back to a pool the audit ejected
            watch, pool = self.watch, tuple(self.int4_endpoints)
            self.standby.may_return = lambda: not all(watch.ejected(e) for e in pool)
        if self.remote is not None and 0 in remote:
            self.scheduler = self.remote
            if self.watch is not None:  # an ejected endpoint's answers leave it at once
                watch, only = self.watch, self.int4_endpoints[0]
                self.remote.ejected = lambda e: watch.ejected(e if e is not None else only)
        else:
            assert isinstance(self.int4, BatchedLlamaCpp)
            self.scheduler = Int4Scheduler(self.int4, self.handoffs if standby_engines else None, self.aborts,
                                           c.scheduler, clock=clock, cores=self.cores)
            self.scheduler.standby_threads = c.standby_threads if self.standby is not None else 0
            if self.watch is not None:  # an ejected pool's answers leave it at once
                name, watch = self.int4.name, self.watch
                self.scheduler.ejected = lambda: watch.ejected(name)
            if self.standby is not None:
                self.scheduler.keep_drafting = self._keep_drafting
                self.scheduler.left_drafting = self._drafted
                self.standby.on_left = self._left_verification

    def _load_standby(self, rung: str, s: Settings) -> Engine | Remote:
        c = self.config
        if rung == "vllm":
            if c.standby_url is None:
                raise ConfigError("a vllm standby rung needs standby_url (the vLLM server's address)")
            return remote_rung(VllmRung, self.info, c.standby_url, self.endpoints)
        from qladder.engines import load_engine

        return load_engine(rung, self.info, Settings(s.cache_dir, c.standby_threads, c.n_ctx, s.int4_monitor))

    # -- the client interface --------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.scheduler.healthy

    def request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                request_id: str | None = None, faults: Sequence[Fault] = (), prompt_text: str | None = None,
                ladder: LadderConfig | None = None, start_rung: int = 0, flagged: bool = False,
                verified: bool = False, prompt_class: str | None = None, streamed: bool = True) -> Request:
        """A Request with a fresh id (token ids already sanitized and templated)."""
        return Request(request_id or uuid.uuid4().hex[:16], tuple(int(t) for t in prompt_ids),
                       params or SamplingParams(), tuple(faults), prompt_text, ladder, start_rung, flagged,
                       verified, prompt_class, streamed)

    def _check(self, r: Request) -> None:
        if r.faults and not self.config.allow_faults:
            raise ConfigError("fault injection is disabled on this engine (allow_faults is off)")
        if not r.prompt_ids:
            raise InputError("empty prompt")
        if not 0 <= r.start_rung < len(self.rungs):
            raise ConfigError(f"start_rung {r.start_rung} is not a rung of {self.rungs}")
        if r.verified and not self.verifies:
            raise ConfigError("verified decoding needs an int4 pool with a rung above it that decides: in-process "
                              "int4 and fp32, or llama-server and vLLM "
                              f"(this engine: {self.rungs}, int4 {'remote' if self.remote else 'in-process'})")
        check_prompt_fits(len(r.prompt_ids), min(self.n_ctx))
        if any(not 0 <= t < self.int4.n_vocab for t in r.prompt_ids):
            raise InputError(f"token ids must be in [0, {self.int4.n_vocab})")
        gains = [f for f in r.faults if f.kind == "gain"]
        if not gains:
            return
        int4 = self.int4
        if not isinstance(int4, BatchedLlamaCpp):
            raise ConfigError("gain faults need an in-process int4 rung (a remote rung's layers are out of reach)")
        if len(gains) > 1:
            raise ConfigError("the int4 pool takes one gain fault a request (one per slot)")
        if not (1 <= gains[0].layer < int4.n_layer and 0 <= gains[0].channel < int4.n_embd):
            raise ConfigError(f"gain faults apply to layers 1..{int4.n_layer - 1} and channels "
                              f"0..{int4.n_embd - 1}, not {gains[0]}")
        if not int4.has_native:
            raise ConfigError(f"gain faults need the native helpers ({int4.native_error})")

    @property
    def audits(self) -> bool:
        """Whether INT4's answers can be audited here: the standby's first rung scores them (an
        in-process one's batched forward, or a vLLM server's prompt logprobs)."""
        return self.auditor is not None

    @property
    def auditor(self) -> Auditor | RemoteAuditor | None:
        """What scores the audited answers: the in-process standby's auditor (its first
        full-precision rung), or a vLLM standby's."""
        if self.standby is not None and self.standby.auditor is not None:
            return self.standby.auditor
        return self.remote_auditor

    def _audit_sink(self, job: AuditJob) -> None:
        """Where an answer's trail hands its audit job (any thread)."""
        if self.standby is not None and self.standby.auditor is not None:
            self.standby.audit(job)  # (and wakes the standby's thread)
        elif self.remote_auditor is not None:
            self.remote_auditor.offer(job)

    @property
    def int4_endpoints(self) -> list[str]:
        """The endpoints the audit judges separately: the in-process pool (by its rung's name), or
        each llama-server replica (by its URL)."""
        if isinstance(self.int4, Replicas):
            return [e.base_url for e in self.int4.endpoints]
        return [self.int4.base_url if isinstance(self.int4, LlamaServerRung) else self.int4.name]

    def _submit(self, r: Request, emit: Callable[[Event], None]) -> None:
        self._check(r)
        if self.watch is not None and r.start_rung == 0:
            # Endpoints the audit's test found broken: a replica is condemned (its siblings answer;
            # serving/engine.py `_alarm`); a broken in-process pool, or every replica broken: the
            # standby's answer (full precision from the first token; a broken pool does not draft
            # either). At most every probe_every_s an unshown INT4 answer of each to this prompt,
            # audited, is the probe that can bring it back.
            out = [e for e in self.int4_endpoints if self.watch.ejected(e)]
            for e in out:
                if self.watch.probe_due(e):
                    self._probe(r, e)
            if out and len(out) == len(self.int4_endpoints):
                r = replace(r, start_rung=1)
        if r.start_rung == 0 and len(self.rungs) > 1 and not self.scheduler.healthy:
            r = replace(r, start_rung=1)  # the INT4 pool is unhealthy (a stall, no probe through yet)
        self.aborts.start(r.request_id)
        if r.verified and r.start_rung == 0 and (not r.params.greedy if self._remote_verifies else not self._drafts(r)):
            r = replace(r, start_rung=1)  # the full-precision rung alone: the same answer (sooner, or sampled)
        observers = tuple(self.observers)

        def deliver(ev: Event) -> None:
            if isinstance(ev, FinalEvent):
                self.aborts.end(r.request_id)
                self._drafted(r.request_id)
            for observe in observers:
                try:
                    observe(ev)
                except Exception:  # an observer's bug must not take the request down with it
                    _log.exception("an event observer failed on request %s", r.request_id)
            emit(ev)

        m = self._machine(r, deliver)
        try:
            if r.start_rung == 0:
                self.scheduler.submit(m)
            else:  # routed to the standby from the start: a quarantined prompt, an open breaker
                self.handoffs.submit(m, MoveTo(r.start_rung, poisoned=False))
        except BaseException:
            self.aborts.end(r.request_id)
            self._drafted(r.request_id)
            raise

    def _probe(self, r: Request, endpoint: str) -> None:
        """An INT4 answer of `endpoint` to `r`'s prompt that nobody is shown, audited: the ejected
        endpoint's probe (in-process: a machine on the pool; a replica: asked of it alone,
        serving/remote_probe.py)."""
        probe = Request(f"probe-{uuid.uuid4().hex[:12]}", r.prompt_ids, SamplingParams(max_tokens=min(
            r.params.max_tokens, 64)), prompt_text=r.prompt_text, prompt_class=r.prompt_class, probe=True)
        if not isinstance(self.int4, BatchedLlamaCpp):
            assert self.remote is not None
            rung = self.int4.endpoint(endpoint) if isinstance(self.int4, Replicas) else self.int4
            trail = AuditTrail(probe.request_id, r.prompt_class or classify(r.prompt_text), endpoint,
                               self._audit_sink, probe=True)
            self.remote.spawn(functools.partial(probe_answer, rung, probe, trail))
            self.probes += 1
            return
        self.aborts.start(probe.request_id)

        def ended(ev: Event) -> None:
            if isinstance(ev, FinalEvent):
                self.aborts.end(probe.request_id)

        try:
            self.scheduler.submit(self._machine(probe, ended, probe=True))
        except QueueFullError:  # no room: the next request's probe
            self.aborts.end(probe.request_id)
            return
        self.probes += 1

    def _alarm(self, a: Alarm) -> None:
        """The endpoint detector decided (the standby's thread): a log line, an incident with the
        audited evidence, and the alarm observers (metrics)."""
        if a.returned:
            _log.warning("endpoint %s is back: %d clean probe answers in a row (after %d audited answers)",
                         a.endpoint, self.watch.detector.probes if self.watch else 0, a.answers)
        else:
            _log.warning("endpoint %s ejected: the audit's %s CUSUM reached %.2f (bound %.2f) after %d audited "
                         "answers; its requests go to %s until probes pass; evidence %s",
                         a.endpoint, a.mode, a.statistic, a.threshold, a.answers,
                         "its healthy siblings (none left: the standby)" if isinstance(self.int4, Replicas)
                         else "the standby",
                         ", ".join(f"{rid} {x:+.2f}" for rid, x in a.evidence[-8:]))
            if self.incidents is not None:
                detail = json.dumps({"evidence": [[rid, x] for rid, x in a.evidence], "answers": a.answers,
                                     "test": a.mode})
                hazard = Hazard("audit", a.endpoint, 0, a.statistic, a.threshold, detail=detail)
                rid = a.evidence[-1][0] if a.evidence else "audit"
                try:
                    self.incidents(Incident(rid, "", [], None, hazard, f"eject:{a.endpoint}", None, [], a.ts))
                except Exception:  # a failing store must not stop the audits
                    _log.exception("the incident of endpoint %s's ejection was not recorded", a.endpoint)
        if isinstance(self.int4, Replicas) and self.remote is not None:  # (the replicas are the loop's)
            self.remote.call_soon(self.int4.absolve if a.returned else self.int4.condemn, a.endpoint)
        for observe in tuple(self.alarm_observers):
            try:
                observe(a)
            except Exception:
                _log.exception("an alarm observer failed on endpoint %s", a.endpoint)

    def _audit_share(self) -> float:
        """The floor rate, or the spare one while the INT4 pool has room (a free slot, nothing
        queued: at full load every core the audit holds is one INT4 decodes without, so only the
        floor runs then), the auditor keeps up (under 4 jobs waiting) and its core-time over the
        last SPENT_WINDOW_S is under `audit_budget` of the box's: the audit's cost to INT4's
        throughput is at most the budget (an in-process pool decodes on every core the audit
        does not hold; a remote one's servers may share this box's)."""
        c = self.config
        auditor = self.auditor
        if c.audit_spare_rate <= self.audit_rate or self.audit_rate <= 0 or auditor is None or auditor.pending >= 4:
            return self.audit_rate
        if self.scheduler.depth > 0 or self.scheduler.slots_in_use >= self.int4.n_slots:
            return self.audit_rate
        cores = c.cores or os.cpu_count() or 1
        under = auditor.spent(self.clock()) < c.audit_budget * cores * SPENT_WINDOW_S
        return c.audit_spare_rate if under else self.audit_rate

    def _drafts(self, r: Request) -> bool:
        """Whether this verified request drafts (counted until it ends), or goes to rung 1 alone."""
        assert self.standby is not None
        with self._drafting_lock:
            busy = self.standby.active + self.standby.depth
            if not should_draft(len(self._drafting), busy, self.draft_limit):
                return False
            self._drafting.add(r.request_id)
            return True

    def _keep_drafting(self, request_id: str) -> bool:
        """Asked by the scheduler before each window: whether the request still drafts (the same
        policy, itself not counted); when not, it is no longer counted as drafting."""
        assert self.standby is not None
        with self._drafting_lock:
            others = len(self._drafting - {request_id})
            if should_draft(others, self.standby.active + self.standby.depth, self.draft_limit):
                return True
            self._drafting.discard(request_id)
            return False

    def _left_verification(self, request_id: str) -> None:
        """A verified request went on at the standby as an ordinary handoff: its INT4 slot is
        released, and it no longer counts as drafting."""
        assert isinstance(self.scheduler, Int4Scheduler)
        self.scheduler.forget(request_id)
        self._drafted(request_id)

    def _drafted(self, request_id: str) -> None:
        with self._drafting_lock:
            self._drafting.discard(request_id)

    def _machine(self, r: Request, emit: Callable[[Event], None], probe: bool = False) -> RequestMachine:
        ladder = r.ladder or self.config.ladder
        guard = self._guards.get(ladder.guard)
        if guard is None:  # one StepGuard per guard config, made on the submitting thread
            guard = self._guards.setdefault(ladder.guard, StepGuard(ladder.guard, self.info.identity))
        audit = None
        # an endpoint in rotation is suspect (replicas: any of them; which one answers is known at
        # its first token), or this is an ejected one's probe
        w = self.watch
        under_test = probe or (w is not None and any(w.audit_all(e) and not w.ejected(e) for e in self.int4_endpoints))
        chosen = selected(r.request_id, self._audit_share())
        if self.audits and r.start_rung == 0 and not r.verified:  # (not chosen: a light trail, see AuditTrail)
            audit = AuditTrail(r.request_id, r.prompt_class or classify(r.prompt_text), self.int4_endpoints[0],
                               self._audit_sink, greedy=r.params.greedy,
                               # urgent if the endpoint that wrote it (known at its end) is suspect
                               urgent=w.audit_all if w is not None else False,
                               chosen=chosen or under_test, probe=probe)
        return RequestMachine(r, self.rungs, self.n_ctx, self.int4.eos_ids, self.int4.detokenize_bytes,
                              ladder, guard, self.incidents, emit, self.clock, audit)

    def _machine_for_test(self, r: Request) -> RequestMachine:
        """A machine as this engine builds them, not submitted anywhere (tests drive it)."""
        return self._machine(r, lambda _e: None)

    def _return(self, m: RequestMachine) -> None:
        self.scheduler.resubmit(m)

    def _checked(self, m: RequestMachine) -> None:
        """A verified request's window was decided at the standby: back to its INT4 slot."""
        assert isinstance(self.scheduler, Int4Scheduler)
        self.scheduler.resume(m)

    @property
    def verifies(self) -> bool:
        """Whether this engine serves verified requests: an in-process INT4 pool drafts and an
        in-process full-precision rung 1 (the standby's first) decides, or a llama-server drafts
        and vLLM decides (greedy; a sampled verified request is vLLM's alone). An int8 rung 1 does
        not verify: verified answers are full precision's."""
        in_process = isinstance(self.int4, BatchedLlamaCpp) and self.standby is not None \
            and isinstance(self.standby.engines.get(1), BatchedTorch)
        return in_process or self._remote_verifies

    @property
    def _remote_verifies(self) -> bool:
        return self.remote is not None and self.remote is self.scheduler and self.remote.verifies

    def generate(self, request: Request) -> AsyncEvents:
        """Submit now (a full queue raises QueueFullError here, before any await) and return the
        request's events; `aclose()` before its FinalEvent aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Event] = asyncio.Queue()

        def emit(ev: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the request is aborted
                loop.call_soon_threadsafe(q.put_nowait, ev)

        self._submit(request, emit)
        return AsyncEvents(request.request_id, q, self.abort)

    def stream_sync(self, request: Request) -> Iterator[Event]:
        """Submit now (a full queue raises QueueFullError here) and iterate the events; closing
        the iterator before its FinalEvent aborts the request."""
        q: queue.Queue[Event] = queue.Queue()
        self._submit(request, q.put)
        return self._events(request.request_id, q)

    def _events(self, request_id: str, q: queue.Queue[Event]) -> Iterator[Event]:
        finished = False
        try:
            while not finished:
                ev = q.get()
                finished = isinstance(ev, FinalEvent)
                yield ev
        finally:
            if not finished:
                self.abort(request_id)

    def generate_sync(self, request: Request, timeout_s: float | None = None) -> GenerationResult:
        """Submit and wait for the result. Only the final event crosses to the caller's thread:
        a caller that does not stream is not woken for every token (a thread switch each)."""
        done = threading.Event()
        box: list[GenerationResult] = []

        def emit(ev: Event) -> None:
            if isinstance(ev, FinalEvent):
                box.append(ev.result)
                done.set()

        self._submit(request, emit)
        if not done.wait(timeout_s):
            self.abort(request.request_id)
            done.wait()
        return box[0]

    def add_observer(self, observe: Callable[[Event], None]) -> None:
        self.observers.append(observe)

    def add_audit_observer(self, observe: Callable[[AuditRecord], None]) -> None:
        self.audit_observers.append(observe)

    def _audited(self, record: AuditRecord) -> None:
        for observe in tuple(self.audit_observers):
            try:
                observe(record)
            except Exception:  # an observer's bug must not stop the audits
                _log.exception("an audit observer failed on request %s", record.request_id)

    def abort(self, request_id: str) -> bool:
        found = self.aborts.abort(request_id)
        if found:
            self.scheduler.wake()
        return found

    # -- state for metrics -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {"slots": self.int4.n_slots, "slots_in_use": self.scheduler.slots_in_use,
                "queue_depth": self.scheduler.depth, "healthy": self.scheduler.healthy,
                "steps": self.scheduler.steps, "stalls": self.scheduler.stalls,
                "prefix_hits": self.scheduler.prefix_hits, **self._prompt_stats(),
                "standby_depth": self.standby.depth if self.standby else 0,
                "standby_active": (self.standby.active if self.standby else 0)
                + (self.remote.standby_active if self.remote else 0), "live": self.aborts.live,
                # answers whose first tokens the remote standby checked, refused, or could not check
                **({f"drafts_{k}": v for k, v in self.remote.checks.items()} if self.remote else {}),
                **({f"verified_{k}": v for k, v in self.remote.verified.items()} if self.remote else {}),
                **self._audit_stats(), **self._replica_stats(), **self._watch_stats()}

    def _watch_stats(self) -> dict[str, float]:
        """The endpoint detector's per-endpoint state (0 watched, 1 suspect, 2 ejected, 3 probing),
        statistic (its nearer test's, as a share of that test's bound) and alarms, the probes sent,
        and the answers withdrawn from an endpoint as it was ejected."""
        if self.watch is None:
            return {}
        codes = {"watched": 0.0, "suspect": 1.0, "ejected": 2.0, "probing": 3.0}
        out: dict[str, float] = {"probes": float(self.probes), "withdrawn": float(self.scheduler.withdrawn)}
        seen: dict[str, dict[str, float | str]] = {
            **{e: {"state": "watched", "statistic": 0.0, "alarms": 0.0} for e in self.int4_endpoints},
            **self.watch.snapshot()}
        for name, v in seen.items():
            out.update({f"detector_{name}_state": codes[str(v["state"])],
                        f"detector_{name}_statistic": float(v["statistic"]),
                        f"detector_{name}_alarms": float(v["alarms"])})
        return out

    def _replica_stats(self) -> dict[str, float]:
        """Pools of replicas (engines/replicas.py), by kind: endpoints healthy and in all,
        streams continued on a sibling, endpoints ejected (on a peer gateway's word: heard) and rejoined."""
        out: dict[str, float] = {}
        for kind, rung in (("int4", self.int4), *(("standby", e) for e in self.standby_engines)):
            if isinstance(rung, Replicas):
                out.update({f"{kind}_endpoints": len(rung.endpoints), f"{kind}_endpoints_healthy": sum(rung.healthy),
                            f"{kind}_migrations": rung.migrations, f"{kind}_ejections": rung.ejections,
                            f"{kind}_heard": rung.heard, f"{kind}_condemned": rung.condemned,
                            f"{kind}_rejoins": rung.rejoins})
        return out

    def _prompt_stats(self) -> dict[str, float]:
        """The in-process pool's prompt cache (serving/prompt_states.py): hits, misses, entries,
        bytes (plain ints the scheduler's thread writes, read here at scrape time)."""
        if not isinstance(self.scheduler, Int4Scheduler):
            return {}
        p = self.scheduler.prompts
        return {"prompt_hits": p.hits, "prompt_misses": p.misses, "prompt_entries": len(p), "prompt_bytes": p.bytes}

    def _audit_stats(self) -> dict[str, float]:
        a = self.auditor
        if a is None:
            return {}
        return {"audits_done": a.done, "audits_dropped": a.dropped, "audits_failed": a.failed,
                "audits_pending": a.pending}

    def close(self) -> None:
        """Stop the threads and free the engines; raises EngineDeadError if a serving thread hit
        a bug of our own code on the way (bugs stay bugs: they fail the tests)."""
        try:
            self.scheduler.close()
        finally:
            try:
                if self.remote is not None and self.remote is not self.scheduler:
                    self.remote.close()
                if self.standby is not None:
                    self.standby.close()
            finally:
                self.int4.close()
                for e in self._owned:  # engines passed in belong to the caller
                    e.close()

