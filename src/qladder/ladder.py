"""The guarded decode loop: hazards caught before emission, rollback, mid-generation handoff.

    open rung 0 (prefill)
    loop: push the last accepted token        (deferred to here: a finished answer never pays
                                               a forward pass whose row nobody reads)
          row     = session.logits()          the step's logits, (V,) float32
          hazard  = guard.check(row, ...)     one host sync
          ok     -> sample, accept             the token is emitted only now
          hazard -> drop the step, record an incident, ask the policy:
                    Handoff(j): close (or roll back) this rung's session, open rung j with
                                prompt ids + accepted ids (token ids, never text), go on there
                    Stop:       the model's own loop, or no rung left: the safe fallback answer

A bad row is never sampled and never healed (`nan_to_num` on an all-NaN row is a uniform
distribution: silent garbage). Poisoned KV is never reused: the rung that failed is closed, or,
when the policy may return to it, rolled back past the step that produced the bad row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from qladder.engines import instrument
from qladder.engines.base import Engine, Session, check_handoff
from qladder.errors import EngineError, InputError
from qladder.faults import Fault, FaultySession, engine_faults
from qladder.health.guard import StepGuard
from qladder.health.repetition import loop_start
from qladder.incidents import Incident, IncidentSink, prompt_hash
from qladder.machine import LadderConfig
from qladder.model import ModelInfo
from qladder.policy import Handoff as HandoffAction
from qladder.policy import Stop
from qladder.sampling import Sampler, SamplingParams
from qladder.shadow import WarmShadow
from qladder.types import FALLBACK_TEXT, FinishReason, GenerationResult, Handoff, Hazard

_log = logging.getLogger("qladder.incidents")


class Ladder:
    """Ordered rungs, cheapest first. Every rung must share rung 0's tokenizer."""

    def __init__(self, engines: Sequence[Engine], config: LadderConfig | None = None,
                 incidents: IncidentSink | None = None, clock: Callable[[], float] = time.perf_counter,
                 model_key: str | None = None):
        """model_key: the model's identity (ModelInfo.identity; default: rung 0's model, when it
        has one), which selects the guard's calibrated bounds."""
        if not engines:
            raise ValueError("a ladder needs at least one rung")
        for e in engines[1:]:
            check_handoff(engines[0], e)
        self.engines = list(engines)
        self.config = config or LadderConfig()
        if model_key is None:
            info = getattr(engines[0], "info", None)
            model_key = info.identity if isinstance(info, ModelInfo) else None
        self.guard = StepGuard(self.config.guard, model_key)
        self.incidents = incidents
        self.clock = clock

    def _set_monitors(self) -> None:
        """Engines may be shared between ladders: each request sets the monitors it needs."""
        for e in self.engines:
            instrument(e, self.config.guard.check_activations, self.config.guard.check_logits)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 faults: Sequence[Fault] = (), prompt_text: str | None = None,
                 request_id: str | None = None) -> GenerationResult:
        """Generate an answer. Never raises for a failing engine: hazards end in a handoff or in
        the safe fallback answer. Raises InputError only for a prompt no rung can take."""
        if not prompt_ids:
            raise InputError("empty prompt")
        if len(prompt_ids) >= self.engines[0].n_ctx:
            raise InputError(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                             f"{self.engines[0].n_ctx}; truncate it (qladder.sanitize) or raise n_ctx")
        self._set_monitors()
        run = _Run(self, list(prompt_ids), params or SamplingParams(), list(faults),
                   prompt_text, request_id or uuid.uuid4().hex[:12])
        with engine_faults(self.engines[0], [f for f in faults if f.kind == "gain"]):
            try:
                return run.loop()
            finally:
                run.cleanup()


class _Run:
    """The state of one request on the ladder."""

    def __init__(self, ladder: Ladder, prompt_ids: list[int], params: SamplingParams,
                 faults: list[Fault], prompt_text: str | None, request_id: str):
        self.L = ladder
        self.prompt = prompt_ids
        self.params = params
        self.faults = faults
        self.prompt_text = prompt_text
        self.request_id = request_id
        self.sampler = Sampler(params)
        self.accepted: list[int] = []
        self.token_rungs: list[str] = []
        self.hazards: list[Hazard] = []
        self.handoffs: list[Handoff] = []
        self.rung = 0
        self.sessions: dict[int, Session] = {}
        self.shadow: WarmShadow | None = None
        self.pending: Hazard | None = None  # a failure while opening a rung, reported at the next step
        self.unpushed = False  # the last accepted token is not yet in the current rung's session
        self.pending_incidents: list[tuple[Incident, float]] = []  # waiting for handoff latency
        self.handoff_started: tuple[float, str, int, int, bool] | None = None
        self.streak = 0
        self.t0 = ladder.clock()
        self.timings: dict[str, float] = {}
        self.step_ms: list[float] = []
        self.monitored = ladder.config.guard.check_activations  # the last forward ran monitored
        self.last_accept: float | None = None

    # -- sessions --------------------------------------------------------------------------
    @property
    def context(self) -> list[int]:
        return self.prompt + self.accepted

    def open(self, j: int) -> int:
        """Make rung j's session hold the whole context. Returns the ids it had to evaluate."""
        engine = self.L.engines[j]
        ctx = self.context
        if j in self.sessions:  # kept from an earlier visit: catch up
            s = self.sessions[j]
            missing = ctx[s.n_tokens:]
            s.extend(missing)
            return len(missing)
        if self.shadow is not None and self.shadow.engine is engine:
            shadow, self.shadow = self.shadow, None
            s, caught = shadow.take(ctx)
        else:
            s, caught = engine.open(ctx), len(ctx)
        if j == 0 and self.faults:
            s = FaultySession(s, self.faults, len(self.prompt))
        self.sessions[j] = s
        return caught

    def drop(self, j: int, keep: bool, poisoned: bool) -> None:
        """Leave rung j: close its session, or keep it for a later return. A poisoned session
        (its last eval produced a bad row) is rolled back past that eval, so its KV is not reused."""
        s = self.sessions.pop(j, None)
        if s is None:
            return
        if keep:
            try:
                if poisoned:
                    s.rollback(1)
                self.sessions[j] = s
                return
            except (EngineError, ValueError):
                pass
        s.close()

    def cleanup(self) -> None:
        for s in self.sessions.values():
            with contextlib.suppress(Exception):
                s.close()
        self.sessions.clear()
        if self.shadow is not None:
            self.shadow.discard()
        self.flush_incidents(None)

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> GenerationResult:
        cfg = self.L.config
        if cfg.warm_shadow and len(self.L.engines) > 1:
            self.shadow = WarmShadow(self.L.engines[1], self.prompt, cfg.shadow_sync_every)
        t = self.L.clock()
        try:
            self.open(0)
        except EngineError as exc:
            self.pending = Hazard("engine_error", self.L.engines[0].name, 0, detail=str(exc))
        self.timings["prefill_ms"] = (self.L.clock() - t) * 1e3
        while True:
            if len(self.accepted) >= self.params.max_tokens:
                return self.finish(FinishReason.LENGTH)
            if len(self.context) >= self.L.engines[self.rung].n_ctx:
                return self.finish(FinishReason.LENGTH)
            row, hazard = self.step()
            if hazard is not None:
                stop = self.on_hazard(hazard, row)
                if stop is not None:
                    return self.finish(stop.reason, fallback=stop.fallback)
                continue
            assert row is not None
            self.note_first_token()
            token = self.sampler.sample(row)
            if token in self.L.engines[self.rung].eos_ids and not self.params.ignore_eos:
                return self.finish(FinishReason.STOP)
            self.accept(int(token))
            if self.hit_stop_string():
                return self.finish(FinishReason.STOP)

    def step(self) -> tuple[torch.Tensor | None, Hazard | None]:
        """Push the last accepted token, then the current rung's row and the guard's verdict on it."""
        engine = self.L.engines[self.rung]
        name = engine.name
        step = len(self.accepted)
        if self.pending is not None:
            hazard, self.pending = self.pending, None
            return None, hazard
        clock = self.L.clock
        t = clock()
        session = self.sessions[self.rung]
        try:
            if self.unpushed:
                self.unpushed = False
                # Costly monitors (int4's) sample decode steps; prefill and catch-up always run monitored.
                cheap = engine.monitor_is_cheap
                self.set_monitor(self.rung, cheap or step % self.L.config.guard.activation_every == 0)
                session.push(self.accepted[-1])
            out = session.output()
        except EngineError as exc:
            return None, Hazard("engine_error", name, step, detail=str(exc))
        took = clock() - t
        row = out.row
        deadline = self.L.config.guard.step_deadline_s
        if took > deadline:
            return row, Hazard("deadline", name, step, took, deadline, detail=f"step took {took * 1e3:.0f} ms")
        peaks = out.peaks if self.monitored else None
        return row, self.L.guard.check(row, self.accepted, name, peaks, out.activation_limit, out.rest_peaks,
                                       out.stats)

    def accept(self, token: int) -> None:
        now = self.L.clock()
        if self.last_accept is not None:
            self.step_ms.append((now - self.last_accept) * 1e3)
        self.last_accept = now
        self.accepted.append(token)
        self.token_rungs.append(self.L.engines[self.rung].name)
        self.streak += 1
        if self.shadow is not None:
            self.shadow.feed(self.context)
        action = self.L.config.policy.on_token(self.rung, self.streak, len(self.handoffs))
        if isinstance(action, HandoffAction):  # the new rung opens on the whole context, token included
            self.move(action.to, keep=True, poisoned=False, started=self.L.clock())
            return
        self.unpushed = True

    def on_hazard(self, hazard: Hazard, row: torch.Tensor | None) -> Stop | None:
        """Drop the step; record the hazard; carry out the policy's action."""
        detected = self.L.clock()
        self.close_handoff(detected)  # a handoff whose new rung failed before its first token
        self.hazards.append(hazard)
        self.streak = 0
        n = len(self.L.engines)
        reproduced = None
        if hazard.check == "repetition" and row is not None and self.rung + 1 < n:
            reproduced = self.reproduces(self.rung + 1, row)
        policy = self.L.config.policy
        action = policy.on_hazard(hazard, self.rung, n, len(self.handoffs), reproduced)
        label = (f"handoff:{self.L.engines[action.to].name}" if isinstance(action, HandoffAction)
                 else f"stop:{action.reason}")
        incident = Incident(self.request_id, prompt_hash(self.prompt), self.prompt, self.prompt_text,
                            hazard, label, None, [str(f) for f in self.faults], time.time())
        self.pending_incidents.append(incident)
        if isinstance(action, Stop):
            return action
        self.move(action.to, keep=policy.return_after is not None, poisoned=True, started=detected)
        return None

    def reproduces(self, j: int, row: torch.Tensor) -> bool | None:
        """Whether rung j, given the same context, continues with the same token (a model loop)."""
        try:
            self.open(j)
            return int(self.sessions[j].logits().argmax()) == int(row.argmax())
        except EngineError:
            return None

    def set_monitor(self, j: int, on: bool) -> None:
        on = on and self.L.config.guard.check_activations
        if on != self.monitored or j != self.rung:
            self.L.engines[j].instrument(on, self.L.config.guard.check_logits)
        self.monitored = on

    def move(self, j: int, keep: bool, poisoned: bool, started: float) -> None:
        from_name = self.L.engines[self.rung].name
        self.drop(self.rung, keep, poisoned)
        self.set_monitor(j, True)
        self.rung, self.streak = j, 0
        self.unpushed = False  # rung j opens on the whole context
        engine = self.L.engines[j]
        warm = j not in self.sessions and self.shadow is not None and self.shadow.engine is engine
        caught = 0
        try:
            caught = self.open(j)
        except EngineError as exc:
            self.pending = Hazard("engine_error", engine.name, len(self.accepted), detail=str(exc))
        self.handoff_started = (started, from_name, j, caught, warm)

    def close_handoff(self, now: float) -> None:
        if self.handoff_started is None:
            return
        started, from_name, j, caught, warm = self.handoff_started
        self.handoff_started = None
        latency_ms = (now - started) * 1e3
        self.handoffs.append(Handoff(from_name, self.L.engines[j].name, len(self.accepted), latency_ms,
                                     caught, warm))
        self.flush_incidents(latency_ms)

    def note_first_token(self) -> None:
        if "ttft_ms" not in self.timings:
            self.timings["ttft_ms"] = (self.L.clock() - self.t0) * 1e3
        if self.handoff_started is not None:
            self.close_handoff(self.L.clock())

    def flush_incidents(self, latency_ms: float | None) -> None:
        pending, self.pending_incidents = self.pending_incidents, []
        for inc in pending:
            inc.handoff_latency_ms = latency_ms if inc.action.startswith("handoff") else None
            if self.L.incidents is not None:
                try:
                    self.L.incidents(inc)
                except Exception:  # a failing store must not fail the answer; the log keeps the record
                    _log.exception("incident store failed; the incident: %s",
                                   json.dumps(inc.to_dict(), default=str, ensure_ascii=True))

    # -- endings -------------------------------------------------------------------------------
    def withhold_loop(self) -> None:
        """An answer that ends on a repetition hazard (the model's own loop, or no rung left) keeps
        one copy of the repeated pattern: the loop's other tokens are never part of the answer.
        A loop that a handoff broke (tokens were accepted after the hazard) is left alone."""
        h = self.hazards[-1] if self.hazards else None
        if h is None or h.check != "repetition" or h.value is None or h.step != len(self.accepted):
            return
        period = int(h.value)
        keep = loop_start(self.accepted, period) + period
        if keep < len(self.accepted):
            del self.accepted[keep:]
            del self.token_rungs[keep:]

    def hit_stop_string(self) -> bool:
        stops = self.params.stop
        if not stops:
            return False
        window = max(len(s) for s in stops) + 8  # tokens: each carries at least one byte
        tail = self.L.engines[0].detokenize(self.accepted[-window:])
        return any(s in tail for s in stops)

    def finish(self, reason: FinishReason, fallback: bool = False) -> GenerationResult:
        self.close_handoff(self.L.clock())
        self.withhold_loop()
        text = self.L.engines[0].detokenize(self.accepted)
        for s in self.params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        if fallback and not self.accepted:
            text = FALLBACK_TEXT
        self.timings["total_ms"] = (self.L.clock() - self.t0) * 1e3
        self.flush_incidents(None)
        return GenerationResult(text=text, token_ids=list(self.accepted), token_rungs=list(self.token_rungs),
                                finish_reason=reason, prompt_tokens=len(self.prompt),
                                hazards=list(self.hazards), handoffs=list(self.handoffs),
                                fallback=fallback, timings=dict(self.timings), step_ms=self.step_ms)
