"""The client side of an engine: what a front end (the CLI, the HTTP server, the tests) submits
and gets back, and nothing of how it is served.

    Request        token ids (already sanitized and templated), sampling, the router's start rung
    EngineClient   the protocol every engine a front end talks to implements (ServingEngine, the
                   tests' FakeClient): request -> generate (AsyncEvents) -> abort
    AsyncEvents    one request's events on the caller's event loop; closing it early aborts it

The events themselves are in `qladder.types`, the errors in `qladder.errors`. This module imports
no engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from qladder.sampling import SamplingParams
from qladder.types import Event, FinalEvent

if TYPE_CHECKING:
    from qladder.audit import AuditRecord
    from qladder.policy import LadderConfig
    from qladder.testing.faults import Fault


@dataclass(frozen=True)
class Request:
    """What a client submits: token ids (already sanitized and templated) and how to sample."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    faults: tuple[Fault, ...] = ()  # test machinery: only where the operator allowed faults
    prompt_text: str | None = None
    ladder: LadderConfig | None = None  # operator-only override of the engine's guard and policy
    start_rung: int = 0  # a router's choice: 1.. starts on the standby (a quarantined prompt, an open breaker)
    flagged: bool = False  # the input defence changed the prompt: its answer's first tokens are checked
    verified: bool = False  # verified decoding: rung 0 drafts, rung 1 decides every token (its answer)
    prompt_class: str | None = None  # chat, qa, code, math, abnormal (qladder.classify): the drift audit's
    # The client is sent tokens as they are released. False: it is sent the whole answer at its
    # end, so nothing is released before: an endpoint the audit ejects mid-answer has none of
    # its tokens in the answer (the answer starts again on the rung above).
    streamed: bool = True
    probe: bool = False  # the engine's own answer nobody is shown (an ejected endpoint's probe): never withdrawn


@runtime_checkable
class EngineClient(Protocol):
    """What a front end (CLI, HTTP server) needs from the serving engine, and nothing more (the
    shape of vLLM's `EngineClient`: generate as an async iterator, abort by id)."""

    rungs: list[str]  # the ladder, rung 0 first (request.start_rung indexes it)
    n_ctx: list[int]  # each rung's context, in tokens

    def request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                request_id: str | None = None, faults: Sequence[Fault] = (), prompt_text: str | None = None,
                ladder: LadderConfig | None = None, start_rung: int = 0, flagged: bool = False,
                verified: bool = False, prompt_class: str | None = None, streamed: bool = True) -> Request:
        """A Request for this engine; nothing is submitted yet."""
        ...

    def add_observer(self, observe: Callable[[Event], None]) -> None:
        """Call `observe` with every event of every request (on a serving thread; before the first
        submit), whether or not the request's client still listens."""
        ...

    def add_audit_observer(self, observe: Callable[[AuditRecord], None]) -> None:
        """Call `observe` with every drift audit's record (qladder.audit), on a serving thread."""
        ...

    def stats(self) -> dict[str, float]:
        """Pool state for metrics: slots, slots_in_use, queue_depth, standby_depth, ..."""
        ...

    def generate(self, request: Request) -> AsyncEvents:
        """Submit the request now (QueueFullError, InputError, ConfigError raised here) and return
        its events, ending with its FinalEvent; `aclose()` before that aborts it."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request; its slot is freed at the next scheduler step. False if not in flight."""
        ...

    @property
    def ready(self) -> bool:
        """Engines loaded and the INT4 pool healthy."""
        ...

    @property
    def verifies(self) -> bool:
        """Whether a request may ask for verified decoding (`Request.verified`)."""
        ...


class AsyncEvents:
    """One request's events on the caller's event loop, ending with its FinalEvent. Closing it
    early (`aclose`, as `async for` does not) aborts the request: its slot frees at the next step."""

    def __init__(self, request_id: str, q: asyncio.Queue[Event], abort: Callable[[str], bool]):
        self.request_id = request_id
        self._q = q
        self._abort = abort
        self._finished = False

    def __aiter__(self) -> AsyncEvents:
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        ev = await self._q.get()
        self._finished = isinstance(ev, FinalEvent)
        return ev

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)
