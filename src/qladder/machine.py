"""One request's ladder logic as a state machine, stepped by whoever owns the engine it is on.

Every driver that holds a row (the INT4 scheduler, a standby worker, the in-process ladder) calls
`step(m, StepOutput | StepFailed, took_s)`: deadline, guard -> a token accepted | `m.on_hazard` ->
policy. The remote pool, whose server samples, judges a streamed token in its own room and calls
`m.accept_token` or `m.on_hazard`. The machine keeps the ladder state (rung, accepted ids, text
stream, hazards, a pending verification), records through its Recorder (`m.rec`) and emits the
request's events; it never touches an engine, so it can move between threads (an ownership
transfer, never shared). Actions are in `actions.py`; the policy stays pure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from qladder.actions import Action, Confirm, Continue, Done, Move, MoveTo, StepFailed, Verify
from qladder.audit import AuditTrail
from qladder.client import Request
from qladder.engines.base import StepOutput
from qladder.health.guard import StepGuard
from qladder.incidents import IncidentSink
from qladder.policy import Handoff as HandoffAction
from qladder.policy import LadderConfig, Stop
from qladder.recorder import Recorder
from qladder.sampling import Sampler, token_logprob
from qladder.stream import TextStream, TokenBytes
from qladder.types import (
    FALLBACK_TEXT,
    Event,
    FinalEvent,
    FinishReason,
    GenerationResult,
    Hazard,
    HazardEvent,
    TokenEvent,
    TokenLogprob,
)


def step(m: RequestMachine, out: StepOutput | StepFailed, took_s: float,
         native_argmax: Callable[[], int] | None = None) -> Action:
    """One step, the same for every driver that holds a row: judge what the engine gave (the step
    deadline, then the guard), then accept a token (sampled, or for a greedy request the engine's
    own `native_argmax`, which a driver passes only for a row no fault replaced) or act on the
    hazard. `took_s`: the step's time as the driver measured it (0.0 where a watchdog keeps the
    deadline). A request's injected faults are the driver's: they reach here as the rows they make."""
    name, deadline = m.rungs[m.rung], m.config.guard.step_deadline_s
    if isinstance(out, StepFailed):
        return m.on_hazard(Hazard("engine_error", name, m.step, detail=out.error), None)
    if took_s > deadline:
        hazard: Hazard | None = Hazard("deadline", name, m.step, took_s, deadline,
                                       detail=f"step took {took_s * 1e3:.0f} ms")
    else:
        hazard = m.guard.check(out.row, m.accepted, name, out.peaks, out.activation_limit, out.rest_peaks, out.stats)
    if hazard is not None:
        return m.on_hazard(hazard, out.row)
    token = native_argmax() if native_argmax is not None and m.params.greedy else m.sampler.sample(out.row, m.step)
    if m.audit is not None and m.rung == 0:  # a drift audit's: INT4's top 5 here
        m.audit.add(out.row)
    k = m.params.logprobs
    return m.accept_token(int(token), token_logprob(out.row, int(token), k) if k is not None else None)


# Hazards that say nothing about the INT4 endpoint's weights (a stall, a failed call, the audit's
# own ejection, a draft the rung above refused): their answers' audits are not made urgent.
NOT_EVIDENCE = frozenset({"deadline", "engine_error", "audit", "verify"})


# What a driver may use of a machine, only to read or call (no driver assigns through `m`):
# tests/test_driver_views.py reads every driver's source and holds it to this list.
DRIVER_VIEW = frozenset({
    # read
    "request_id", "req", "params", "config", "guard", "rungs", "rung", "prompt", "context", "accepted",
    "step", "unchecked", "left_at", "rec", "done", "eos_ids", "n_ctx", "audit", "released",
    # call
    "on_hazard", "on_verify", "moved", "finish", "accept_token", "hold", "decided_by", "served_by",
})


class RequestMachine:
    """The state of one request on the ladder. Owned by one thread at a time."""

    def __init__(self, request: Request, rungs: Sequence[str], n_ctx: Sequence[int], eos_ids: frozenset[int],
                 token_bytes: TokenBytes, config: LadderConfig, guard: StepGuard,
                 incidents: IncidentSink | None = None, emit: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, audit: AuditTrail | None = None):
        self.req, self.request_id, self.params = request, request.request_id, request.params
        self.prompt, self.rungs, self.n_ctx = list(request.prompt_ids), list(rungs), list(n_ctx)
        self.eos_ids, self.config, self.guard, self.clock = eos_ids, config, guard, clock
        self.emit = emit or (lambda _e: None)
        self.rec = Recorder(request.request_id, incidents if config.record_incidents else None, self.emit, clock)
        self.sampler = Sampler(request.params, coupled=request.verified)  # see Sampler
        # each accepted token's tag: its rung, its log-probability (when the request asked for them)
        period = config.guard.repetition_max_period if config.guard.check_repetition else 0
        self.stream: TextStream[tuple[str, TokenLogprob | None]] = TextStream(token_bytes, request.params.stop, period)
        self.stream.whole = not request.streamed  # (the client reads the answer whole, at its end)
        self.hazards: list[Hazard] = []
        self.rung, self.streak = request.start_rung, 0
        self.unchecked = False  # the answer's first tokens await the standby's check: none released
        self.pending: tuple[Hazard, int] | None = None  # a repetition hazard awaiting verification, its argmax
        self.done: GenerationResult | None = None
        self.audit: AuditTrail | None = audit  # the drift audit's record of INT4's rows (qladder.audit)
        self.left_at = self.rec.t0  # when the last hazard (or policy move) decided to leave the rung

    # -- what drivers read ---------------------------------------------------------------------
    @property
    def accepted(self) -> list[int]:
        return self.stream.ids

    @property
    def step(self) -> int:
        """The index of the token about to be produced."""
        return len(self.stream.ids)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.stream.ids

    @property
    def released(self) -> int:  # the answer's tokens a client has been sent
        return self.stream.released

    @property
    def token_rungs(self) -> list[str]:
        return [rung for rung, _ in self.stream.tags]

    # -- one step --------------------------------------------------------------------------------
    def hold(self, n: int, check: bool = False) -> None:
        """Keep the last `n` accepted tokens unreleased (a window a later check may roll back
        whole), releasing what is past it. `check`: the answer's first `n` tokens await a check
        by the rung above, none released until the next `hold`; an answer that would end first
        ends in `Confirm` (the driver checks, then finishes)."""
        self.unchecked = check
        self.stream.hold = max(self.stream.hold, n) if check else n
        if not check:
            self._release()
            if self.stream.stopped_at is not None:  # what it released completed a stop string
                self.finish(FinishReason.STOP)

    def served_by(self, endpoint: str) -> None:
        """A pool of replicas names the endpoint whose rung-0 tokens follow (the answer's record,
        and an audited answer's endpoint)."""
        self.rec.served_by(endpoint)
        if self.audit is not None:
            self.audit.at(endpoint)

    def accept_token(self, token: int, lp: TokenLogprob | None = None,
                     top: Sequence[tuple[int, float | None]] | None = None) -> Action:
        """Accept a healthy token (a row's, or one a remote rung sampled: no row here; `top`: the
        top-k its server streamed, which an audited answer's trail keeps on rung 0)."""
        if top is not None and self.audit is not None and self.rung == 0:
            self.audit.add_top(token, top)
        now = self.clock()
        self.rec.first_output(now)
        self.rec.close_handoff(now, self.step)
        if token in self.eos_ids and not self.params.ignore_eos:
            return self._end(FinishReason.STOP)
        self.rec.token(now)
        if self.params.logprobs is not None and lp is None:
            lp = TokenLogprob(token, float("nan"))
        self.stream.push(int(token), (self.rungs[self.rung], lp))
        self.streak += 1
        self._release()
        if self.stream.stopped_at is not None:
            return Done(self.finish(FinishReason.STOP))
        if self.step >= self.params.max_tokens or len(self.context) >= self.n_ctx[self.rung]:
            return self._end(FinishReason.LENGTH)
        action = self.config.policy.on_token(self.rung, self.streak, len(self.rec.handoffs))
        if isinstance(action, HandoffAction) and not self.req.verified:  # a verified answer stays fp32's
            self.left_at = self.clock()
            return MoveTo(action.to, poisoned=False)
        return Continue()

    def _int4_part(self, ids: Sequence[int], rungs: Sequence[str]) -> list[int]:
        """The answer's start rung 0 wrote (up to the first token of another rung): what is audited."""
        return list(ids[:next((k for k, r in enumerate(rungs) if r != self.rungs[0]), len(ids))])

    def _end(self, reason: FinishReason) -> Action:  # unless its first tokens still await the standby's check
        return Confirm(reason) if self.unchecked else Done(self.finish(reason))

    def _release(self, final: bool = False) -> None:
        start = self.stream.released
        n, text = self.stream.release(final)
        if n:
            if text:
                self.rec.first_text(self.clock(), len(self.stream.ids))
            ids, tags = self.stream.ids[start:start + n], self.stream.tags[start:start + n]
            self.emit(TokenEvent(self.request_id, ids, [r for r, _ in tags], text, self._lps(tags)))

    def _lps(self, tags: Sequence[tuple[str, TokenLogprob | None]]) -> list[TokenLogprob] | None:
        return [lp for _, lp in tags if lp is not None] if self.params.logprobs is not None else None

    def on_hazard(self, hazard: Hazard, row: torch.Tensor | int | None) -> Move:
        """Drop the step; record the hazard; ask the policy (a repetition first asks the next rung
        whether it would take the row's argmax, `row` or the row itself, too)."""
        self.left_at = now = self.clock()  # the handoff's latency counts from here
        self.rec.close_handoff(now, self.step)  # a handoff whose new rung failed before its first token
        if self.audit is not None and self.rung == 0 and hazard.check not in NOT_EVIDENCE:
            # in-band suspicion: what INT4 wrote up to its hazard is audited first (rolled back or not)
            self.audit.done(self.prompt, self._int4_part(self.stream.ids, self.token_rungs), suspicious=True)
        if hazard.check == "verify":  # the standby refused token `step`: continue from the ones before it
            self.stream.truncate(hazard.step)  # (never below what was released)
        elif hazard.check == "audit" and self.stream.whole:  # the audit ejected the endpoint writing it:
            self.stream.withdraw()  # none of it was sent (its client reads it whole); it starts again above
            self.rec.withdrawn()
        elif hazard.check in ("diffuse", "audit") or self.unchecked:  # suspect, or never checked: roll back
            self.stream.truncate(0)  # what was held
        self.unchecked, self.streak = False, 0
        self._note(hazard)
        if hazard.check == "repetition" and row is not None and self.rung + 1 < len(self.rungs):
            self.pending = hazard, row if isinstance(row, int) else int(row.argmax())
            return Verify(self.rung + 1)
        return self._decide(hazard, None)

    def on_verify(self, next_argmax: int | None) -> Move:
        """The next rung's greedy token on the same context (None: it failed to say)."""
        assert self.pending is not None
        (hazard, argmax), self.pending = self.pending, None
        reproduced = None if next_argmax is None else next_argmax == argmax
        return self._decide(hazard, reproduced)

    def _decide(self, hazard: Hazard, reproduced: bool | None) -> MoveTo | Done:
        action = self.config.policy.on_hazard(hazard, self.rung, len(self.rungs), len(self.rec.handoffs), reproduced)
        label = (f"handoff:{self.rungs[action.to]}" if isinstance(action, HandoffAction)
                 else f"stop:{action.reason}")
        self.rec.incident(self.req, self.prompt, hazard, label)
        if isinstance(action, Stop):
            return Done(self.finish(action.reason, fallback=action.fallback))
        return MoveTo(action.to, poisoned=True)

    def moved(self, to: int, caught: int, warm: bool) -> None:
        """The driver carried out a move: rung `to` holds the context (it evaluated `caught` ids).
        The handoff's latency runs from `left_at` (the hazard's or the policy's moment)."""
        self.rec.open_handoff(self.left_at, self.rungs[self.rung], self.rungs[to], caught, warm)
        self.rung, self.streak, self.unchecked = to, 0, False
        self.stream.hold = 0

    def decided_by(self, to: int, hazard: Hazard | None) -> None:
        """Verified decoding: rung `to` decides every token from here (no handoff: rung 0 only
        drafts; back to 0 when the request leaves verified decoding); `hazard`, a drafted row the
        guard refused: that draft ends there, recorded."""
        self.rung = to
        if hazard is not None:
            self._note(hazard)
            self.rec.incident(self.req, self.prompt, hazard, f"verify:{self.rungs[to]}")

    def _note(self, hazard: Hazard) -> None:
        self.hazards.append(hazard)
        self.emit(HazardEvent(self.request_id, hazard))

    # -- endings ---------------------------------------------------------------------------------
    def finish(self, reason: FinishReason, fallback: bool = False) -> GenerationResult:
        """End the request: release what is left (never a partial character), flush incidents,
        emit the final event. An answer that ends on a repetition hazard keeps one copy of the
        repeated pattern. Idempotent."""
        if self.done is not None:
            return self.done
        self.rec.close_handoff(self.clock(), self.step)
        h = self.hazards[-1] if self.hazards else None
        if (h is not None and h.check == "repetition" and h.value is not None and h.step == self.step
                and self.stream.tags and h.rung == self.stream.tags[-1][0]):  # not a rejected draft's (verified)
            self.stream.keep_one_period(int(h.value))
        self._release(final=True)
        ids, rungs = self.stream.final_ids, self.token_rungs[:len(self.stream.final_ids)]
        self.rec.total()
        self.rec.flush(None)
        if self.audit is not None:  # the answer's INT4-written start, to be re-scored in the background
            self.audit.done(self.prompt, self._int4_part(ids, rungs))
        self.done = GenerationResult(text=FALLBACK_TEXT if fallback and not ids else self.stream.text,
                                     token_ids=list(ids), token_rungs=rungs, finish_reason=reason,
                                     prompt_tokens=len(self.prompt), hazards=list(self.hazards),
                                     handoffs=list(self.rec.handoffs), fallback=fallback,
                                     timings=dict(self.rec.timings), step_ms=self.rec.step_ms,
                                     logprobs=self._lps(self.stream.tags[:len(ids)]),
                                     endpoints=list(self.rec.endpoints))
        self.emit(FinalEvent(self.request_id, self.done))
        return self.done
