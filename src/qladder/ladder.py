"""The in-process guarded loop: one request at a time over the rungs' sessions.

    open rung 0 (prefill)
    loop: push the last accepted token        (deferred to here: a finished answer never pays
                                               a forward pass whose row nobody reads)
          out    = session.output()           the step's row, stats and activation peaks
          step(m, out, took)                  the request machine's verdict (deadline, guard)
          ok     -> Continue                   the token is emitted only now
          hazard -> MoveTo(j)                  close (or roll back) this rung's session, open
                                               rung j with prompt ids + accepted ids
                             Verify(j)         does rung j continue the same loop?
                             Done              the model's own loop, or the safe fallback

The request's logic is `machine.RequestMachine`, the same the serving scheduler and the standby
step; this module only drives sessions (the standby pool does the same on its worker thread).
It serves what the serving engine does not: ladders that start on a torch rung, the warm shadow,
and the validation's boundary sweeps. A bad row is never sampled and never healed. Poisoned KV
is never reused: the rung that failed is closed, or, when the policy may return to it, rolled
back past the step that produced the bad row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qladder.actions import Action, Continue, Done, MoveTo, StepFailed, Verify
from qladder.client import Request
from qladder.engines import instrument
from qladder.engines.base import Engine, Session, StepOutput, check_handoff
from qladder.errors import EngineError, check_prompt_fits
from qladder.health.guard import StepGuard
from qladder.incidents import IncidentSink
from qladder.machine import RequestMachine, step
from qladder.model import ModelInfo
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.shadow import WarmShadow
from qladder.testing import seam as fault_seam
from qladder.types import GenerationResult, Hazard

__all__ = ["Ladder", "LadderConfig"]

if TYPE_CHECKING:
    from qladder.testing.faults import Fault


class Ladder:
    """Ordered rungs, cheapest first. Every rung must share rung 0's tokenizer."""

    def __init__(self, engines: Sequence[Engine], config: LadderConfig | None = None,
                 incidents: IncidentSink | None = None, clock: Callable[[], float] = time.perf_counter,
                 model_key: str | None = None, sleep: Callable[[float], None] = time.sleep):
        """model_key: the model's identity (ModelInfo.identity; default: rung 0's model, when it
        has one), which selects the guard's calibrated bounds. `sleep` carries out stall faults."""
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
        self.sleep = sleep

    def _set_monitors(self) -> None:
        """Engines may be shared between ladders: each request sets the monitors it needs."""
        for e in self.engines:
            instrument(e, self.config.guard.check_activations, self.config.guard.check_logits)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 faults: Sequence[Fault] = (), prompt_text: str | None = None,
                 request_id: str | None = None) -> GenerationResult:
        """Generate an answer. Never raises for a failing engine: hazards end in a handoff or in
        the safe fallback answer. Raises InputError only for a prompt no rung can take."""
        check_prompt_fits(len(prompt_ids), self.engines[0].n_ctx)
        self._set_monitors()
        req = Request(request_id or uuid.uuid4().hex[:12], tuple(prompt_ids), params or SamplingParams(),
                      tuple(faults), prompt_text)
        e0 = self.engines[0]
        m = RequestMachine(req, [e.name for e in self.engines], [e.n_ctx for e in self.engines], e0.eos_ids,
                           e0.detokenize_bytes, self.config, self.guard, self.incidents, clock=self.clock)
        run = _Run(self, m)
        with fault_seam.engine_gains(e0, faults):  # the request's gain faults on rung 0, if any
            try:
                return run.loop()
            finally:
                run.cleanup()


class _Run:
    """The sessions of one request on the ladder (the machine holds everything else)."""

    def __init__(self, ladder: Ladder, m: RequestMachine):
        self.L = ladder
        self.m = m
        self.sessions: dict[int, Session] = {}
        self.shadow: WarmShadow | None = None
        self.unpushed = False  # the last accepted token is not yet in the current rung's session
        self.monitored = ladder.config.guard.check_activations  # the last forward ran monitored

    # -- sessions --------------------------------------------------------------------------
    def open(self, j: int) -> tuple[int, bool]:
        """Make rung j's session hold the whole context: (ids it had to evaluate, warm shadow)."""
        engine = self.L.engines[j]
        ctx = self.m.context
        if j in self.sessions:  # kept from an earlier visit (or opened to verify a loop): catch up
            s = self.sessions[j]
            missing = ctx[s.n_tokens:]
            s.extend(missing)
            return len(missing), False
        if self.shadow is not None and self.shadow.engine is engine:
            shadow, self.shadow = self.shadow, None
            s, caught = shadow.take(ctx)
            self.sessions[j] = s
            return caught, True
        session = engine.open(ctx)
        if j == 0:  # the request's step faults, if any, hit rung 0's rows
            session = fault_seam.session(session, self.m.req.faults, len(self.m.prompt), self.L.sleep)
        self.sessions[j] = session
        return len(ctx), False

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
        self.m.rec.flush(None)

    def set_monitor(self, j: int, on: bool) -> None:
        on = on and self.L.config.guard.check_activations
        if on != self.monitored or j != self.m.rung:
            self.L.engines[j].instrument(on, self.L.config.guard.check_logits)
        self.monitored = on

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> GenerationResult:
        cfg, m = self.L.config, self.m
        if cfg.warm_shadow and len(self.L.engines) > 1:
            self.shadow = WarmShadow(self.L.engines[1], m.prompt, cfg.shadow_sync_every)
        t = self.L.clock()
        action: Action = Continue()
        try:
            self.open(0)
        except EngineError as exc:
            action = m.on_hazard(Hazard("engine_error", self.L.engines[0].name, 0, detail=str(exc)), None)
        m.rec.prefill((self.L.clock() - t) * 1e3)
        while not isinstance(action, Done):
            if isinstance(action, Verify):
                action = self.verify(action.rung)
            elif isinstance(action, MoveTo):
                action = self.move(action)
            else:
                action = self.step()
        return action.result

    def step(self) -> Action:
        """Push the last accepted token and take the session's output through the machine's step."""
        m = self.m
        engine = self.L.engines[m.rung]
        session = self.sessions[m.rung]
        clock = self.L.clock
        t = clock()
        out: StepOutput | StepFailed
        try:
            if self.unpushed:
                self.unpushed = False
                # Costly monitors (int4's) sample decode steps; prefill and catch-up always run monitored.
                self.set_monitor(m.rung, engine.monitor_is_cheap or m.step % self.L.config.guard.activation_every == 0)
                session.push(m.accepted[-1])
            out = session.output()  # (a faulted rung 0's hangs and rows happen inside: timed)
            if not self.monitored:
                out = dataclasses.replace(out, peaks=None)
        except EngineError as exc:
            out = StepFailed(str(exc))
        action = step(m, out, clock() - t)
        accepted = isinstance(action, Continue) or (isinstance(action, MoveTo) and not action.poisoned)
        if accepted and self.shadow is not None:
            self.shadow.feed(m.context)
        self.unpushed = isinstance(action, Continue)
        return action

    def verify(self, j: int) -> Action:
        """A repetition: does rung j, given the same context, continue with the same token?"""
        try:
            self.open(j)
            nxt: int | None = int(self.sessions[j].logits().argmax())
        except EngineError:
            nxt = None
        return self.m.on_verify(nxt)

    def move(self, a: MoveTo) -> Action:
        m = self.m
        keep = not a.poisoned or self.L.config.policy.return_after is not None
        self.drop(m.rung, keep=keep, poisoned=a.poisoned)
        self.set_monitor(a.rung, True)
        self.unpushed = False  # rung j opens on the whole context
        try:
            caught, warm = self.open(a.rung)
        except EngineError as exc:
            m.moved(a.rung, 0, False)
            return m.on_hazard(Hazard("engine_error", self.L.engines[a.rung].name, m.step, detail=str(exc)), None)
        m.moved(a.rung, caught, warm)
        return Continue()
