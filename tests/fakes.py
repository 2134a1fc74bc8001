"""Fakes over mocks: an EngineClient that answers at once, without a model.

`FakeClient` keeps the EngineClient contract (tests/test_client_contract.py runs the same contract
suite on it and on the real ServingEngine): it answers each request with its prompt's ids in
reverse order (capped at max_tokens), one TokenEvent per token, then the FinalEvent; a prompt
with a fault spec gets a hazard and a handoff, like the real ladder; past `max_live` requests in
flight it raises QueueFullError. Tests of the HTTP layer (fuzzing, 4xx mapping) run on it fast.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence

from qladder.audit import AuditRecord
from qladder.client import AsyncEvents, Request
from qladder.errors import ConfigError, QueueFullError, check_prompt_fits
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.testing.faults import Fault
from qladder.types import (
    Event,
    FinalEvent,
    FinishReason,
    GenerationResult,
    Handoff,
    HandoffEvent,
    Hazard,
    HazardEvent,
    TokenEvent,
)


class Clock:
    """A clock that moves only when a test moves it (`clock.t += s`): breakers, quarantine and
    deadlines on it do not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeClient:
    def __init__(self, n_vocab: int = 49152, n_ctx: int = 2048, max_live: int = 1000,
                 allow_faults: bool = True, token_bytes: Callable[[Sequence[int]], bytes] | None = None):
        self.rungs = ["int4", "fp32"]
        self.n_ctx = [n_ctx, n_ctx]
        self.n_vocab = n_vocab
        self.max_live = max_live
        self.allow_faults = allow_faults
        self.token_bytes = token_bytes or (lambda ids: b"".join(b"t%d " % t for t in ids))
        self.observers: list[Callable[[Event], None]] = []
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.submitted: list[Request] = []
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return True

    @property
    def verifies(self) -> bool:
        return False  # the fake has no rungs to draft and verify on

    def request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                request_id: str | None = None, faults: Sequence[Fault] = (), prompt_text: str | None = None,
                ladder: LadderConfig | None = None, start_rung: int = 0, flagged: bool = False,
                verified: bool = False, prompt_class: str | None = None, streamed: bool = True) -> Request:
        return Request(request_id or uuid.uuid4().hex[:16], tuple(prompt_ids), params or SamplingParams(),
                       tuple(faults), prompt_text, ladder, start_rung, flagged, verified, prompt_class, streamed)

    def add_audit_observer(self, observe: Callable[[AuditRecord], None]) -> None:
        pass  # the fake audits nothing

    def add_observer(self, observe: Callable[[Event], None]) -> None:
        self.observers.append(observe)

    def stats(self) -> dict[str, float]:
        return {"slots": 8, "slots_in_use": len(self.live), "queue_depth": 0, "standby_depth": 0,
                "standby_active": 0, "live": len(self.live)}

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self.live:
                return False
            self.live.discard(request_id)
            self.aborted.append(request_id)
            return True

    def generate(self, r: Request) -> AsyncEvents:
        if r.faults and not self.allow_faults:
            raise ConfigError("fault injection is disabled on this engine")
        check_prompt_fits(len(r.prompt_ids), min(self.n_ctx))
        with self._lock:
            if len(self.live) >= self.max_live:
                raise QueueFullError("the fake's queue is full", retry_after_s=2.0)
            self.live.add(r.request_id)
            self.submitted.append(r)
        q: asyncio.Queue[Event] = asyncio.Queue()
        for ev in self._events(r):
            for o in self.observers:
                o(ev)
            q.put_nowait(ev)
        return AsyncEvents(r.request_id, q, self.abort)

    def _events(self, r: Request) -> list[Event]:
        ids = list(reversed(r.prompt_ids))[: r.params.max_tokens]
        start = self.rungs[r.start_rung]
        rungs = [start] * len(ids)
        events: list[Event] = []
        hazards: list[Hazard] = []
        handoffs: list[Handoff] = []
        if r.faults and r.start_rung == 0 and len(ids) > 1:
            h = Hazard("nonfinite", "int4", 1, float("nan"), detail="injected")
            hand = Handoff("int4", "fp32", 1, 5.0, len(r.prompt_ids) + 1, False)
            hazards, handoffs = [h], [hand]
            rungs = ["int4"] + ["fp32"] * (len(ids) - 1)
        for k, t in enumerate(ids):
            if hazards and k == 1:
                events += [HazardEvent(r.request_id, hazards[0]), HandoffEvent(r.request_id, handoffs[0])]
            events.append(TokenEvent(r.request_id, [t], [rungs[k]], self.token_bytes([t]).decode("utf-8", "replace")))
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        reason = FinishReason.LENGTH if len(ids) == r.params.max_tokens else FinishReason.STOP
        res = GenerationResult(text, ids, rungs, reason, len(r.prompt_ids), hazards, handoffs,
                               timings={"ttft_ms": 1.0, "total_ms": 2.0}, step_ms=[1.0] * max(0, len(ids) - 1))
        events.append(FinalEvent(r.request_id, res))
        with self._lock:
            self.live.discard(r.request_id)
        return events
