"""The shared standby: full-precision rungs serving the handoffs of every request.

One worker thread owns the standby's engines (a torch rung's activation hooks write into buffers
of the engine, so one thread steps them). It keeps at most `max_sessions` requests open and
steps them round-robin, one decode step each, so every handed-off request progresses; further
handoffs wait in a FIFO queue instead of oversubscribing the cores (2 cores: the INT4 pool on
one, the standby on the other). A request arrives as its `RequestMachine` (an ownership
transfer: the sender never touches it again) with the action to carry out: `MoveTo(j)` or
`Verify(j)`. A policy return to rung 0 (`return_after`) hands the machine back to `on_return`; a
move to a rung this pool does not run (a remote one) hands it to `forward`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qladder.actions import Action, Continue, Done, Leave, MoveTo, StepFailed, Verify
from qladder.engines.base import Engine, Session, StepOutput
from qladder.errors import EngineDeadError, EngineError, QueueFullError
from qladder.machine import RequestMachine, step
from qladder.serving.aborts import AbortRegistry
from qladder.types import FinishReason, Hazard

_log = logging.getLogger("qladder.standby")


@dataclass
class _Task:
    m: RequestMachine
    action: Action
    enqueued: float
    session: Session | None = None
    unpushed: bool = False
    opened: list[float] = field(default_factory=list)


class StandbyPool:
    """Rungs 1.. of the ladder (`engines[j]` for rung j), stepped by one worker thread."""

    def __init__(self, engines: Mapping[int, Engine], aborts: AbortRegistry, max_sessions: int = 4,
                 max_queue: int = 256, on_return: Callable[[RequestMachine], None] | None = None,
                 forward: Callable[[RequestMachine, Leave], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """on_return: a policy move back to rung 0. forward: a move to a rung not here (a remote
        one; QueueFullError when its pool is full)."""
        self.engines = dict(engines)
        self.forward = forward
        self.aborts = aborts
        self.max_sessions = max_sessions
        self.on_return = on_return
        self.clock = clock
        self._inbox: queue.Queue[_Task | None] = queue.Queue(maxsize=max_queue)
        self._waiting: deque[_Task] = deque()
        self._active: list[_Task] = []
        self.waits_ms: deque[float] = deque(maxlen=1024)  # queue wait of recent handoffs
        self.bugs: list[BaseException] = []  # exceptions of our own code, raised again by close()
        self._thread = threading.Thread(target=self._run, name="qladder-standby", daemon=True)
        for e in self.engines.values():
            e.instrument(True, True)  # owned by this pool from here on: handoffs are always monitored
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, m: RequestMachine, action: Leave) -> None:
        """Take over a request (the caller gives it up). Raises QueueFullError when full."""
        try:
            self._inbox.put_nowait(_Task(m, action, self.clock()))
        except queue.Full:
            raise QueueFullError("the standby's queue is full") from None

    @property
    def depth(self) -> int:
        return self._inbox.qsize() + len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def close(self) -> None:
        """Stop the worker (requests still open end as aborted); raises EngineDeadError when a bug
        of our own code was caught while serving (bugs are not hazards)."""
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self.bugs:
            raise EngineDeadError(f"the standby hit {len(self.bugs)} bug(s): {self.bugs[0]!r}") from self.bugs[0]

    # -- the worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            block = not self._active and not self._waiting
            try:
                while True:
                    t = self._inbox.get(block=block, timeout=None)
                    block = False
                    if t is None:
                        self._shutdown()
                        return
                    self._waiting.append(t)
            except queue.Empty:
                pass
            while self._waiting and len(self._active) < self.max_sessions:
                t = self._waiting.popleft()
                self.waits_ms.append((self.clock() - t.enqueued) * 1e3)
                self._active.append(t)
            for t in list(self._active):
                try:
                    finished = self._advance(t)
                except Exception as exc:  # a bug in our code: the request still gets an answer,
                    _log.exception("standby failed on request %s", t.m.request_id)  # and close() raises
                    self.bugs.append(exc)
                    self._close(t)
                    t.m.finish(FinishReason.DEGRADED, fallback=True)
                    finished = True
                if finished:
                    self._active.remove(t)

    def _shutdown(self) -> None:
        for t in [*self._active, *self._waiting]:
            self._close(t)
            t.m.finish(FinishReason.ABORT)
        self._active.clear()
        self._waiting.clear()

    def _close(self, t: _Task) -> None:
        if t.session is not None:
            with contextlib.suppress(Exception):
                t.session.close()
            t.session = None

    def _advance(self, t: _Task) -> bool:
        """One unit of work on a task: open a rung, or one decode step. True when it is done."""
        m = t.m
        if self.aborts.is_aborted(m.request_id):
            self._close(t)
            m.finish(FinishReason.ABORT)
            return True
        if isinstance(t.action, Done):
            self._close(t)
            return True
        if isinstance(t.action, (MoveTo, Verify)):
            return self._carry_out(t)
        return self._step(t)

    def _carry_out(self, t: _Task) -> bool:
        m, action = t.m, t.action
        assert isinstance(action, (MoveTo, Verify))
        j = action.rung
        if j == 0:  # the policy returns to the INT4 pool
            self._close(t)
            if self.on_return is None:
                t.action = Continue()
                return False
            self.on_return(m)
            return True
        if j not in self.engines:  # a rung on another pool (a remote server)
            self._close(t)
            try:
                if self.forward is not None:
                    self.forward(m, action)
                    return True
            except QueueFullError:
                pass
            m.finish(FinishReason.DEGRADED, fallback=True)  # nothing is lost: the explicit fallback
            return True
        engine = self.engines[j]
        same = t.session is not None and m.rung == j  # opened by a Verify on this rung already
        if isinstance(action, MoveTo) and same:
            t.action = Continue()
            return False
        self._close(t)
        ctx = m.context
        start = m.rung == j and isinstance(action, MoveTo)  # a request routed here from the start
        try:
            t.session = engine.open(ctx)
        except EngineError as exc:
            if not start:
                m.moved(j, len(ctx), warm=False)
            t.action = m.on_hazard(Hazard("engine_error", engine.name, m.step, detail=str(exc)), None)
            return isinstance(t.action, Done)
        if isinstance(action, Verify):
            try:
                nxt: int | None = int(t.session.logits().argmax())
            except EngineError:
                nxt = None
            t.action = m.on_verify(nxt)
            if isinstance(t.action, MoveTo) and t.action.rung == j:
                m.moved(j, len(ctx), warm=False)
                t.action = Continue()
            return isinstance(t.action, Done)
        if not start:
            m.moved(j, len(ctx), warm=False)
        t.action = Continue()
        t.unpushed = False
        return False

    def _step(self, t: _Task) -> bool:
        m, s = t.m, t.session
        assert s is not None
        t0 = self.clock()
        out: StepOutput | StepFailed
        try:
            if t.unpushed:
                t.unpushed = False
                s.push(m.accepted[-1])
            out = s.output()
        except EngineError as exc:
            out = StepFailed(str(exc))
        t.action = step(m, out, self.clock() - t0)
        if isinstance(t.action, Done):
            self._close(t)
            return True
        t.unpushed = isinstance(t.action, Continue)
        return False
