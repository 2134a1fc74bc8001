"""The shared standby: full-precision rungs serving the handoffs (and verifications) of every request.

One worker thread owns the standby's engines. A torch rung runs batched (`BatchedTorch`): each
turn of the loop is one forward per rung over every open session's new tokens (a decode token,
a chunk of a handoff's context, a window of drafts to verify), so sessions progress together
and a turn with eight costs little more than a turn with one. Another kind of engine is stepped
one session after the other. At most `max_sessions` handoffs are open at once; more wait in a
FIFO queue. A request arrives as its `RequestMachine` (an ownership transfer: the sender never
touches it again) with what to carry out:

    MoveTo(j)    open rung j on the context (token ids), then decode: every row through `step`
    Verify(j)    a repetition: rung j's greedy token on the same context -> m.on_verify
    Drafted(j)   verified decoding: rung j decides the drafts in one forward (serving/verify.py),
                 then the machine goes back to rung 0 (`on_checked`) to draft on; the session
                 stays here, keyed by the request, until the request ends

A policy return to rung 0 (`return_after`) hands the machine back to `on_return`, unless
`may_return` says rung 0 takes none now (the audit ejected it: the answer goes on here); a move to a rung
this pool does not run (a remote one) hands it to `forward`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from qladder.actions import Action, Continue, Done, Drafted, Leave, MoveTo, StepFailed, Verify
from qladder.audit import AuditJob, AuditRecord
from qladder.engines.base import Engine, Session, StepOutput
from qladder.engines.torch_batch import BatchedTorch, BatchedTorchSession
from qladder.engines.torch_engine import TorchEngine
from qladder.errors import EngineDeadError, EngineError, QueueFullError
from qladder.machine import RequestMachine, step
from qladder.serving import verify
from qladder.serving.aborts import AbortRegistry
from qladder.serving.auditor import Auditor
from qladder.serving.cores import Cores
from qladder.serving.drafts import common_prefix
from qladder.types import FinishReason, Hazard

_log = logging.getLogger("qladder.standby")
# What a forward gives a task: its rows, the last row's StepOutput (with the forward's peaks) and
# the time a deadline sees; or the engine's failure.
Rows = tuple[torch.Tensor, StepOutput, float] | StepFailed
# While requests keep the standby busy, the audit runs chunks of BUSY_CHUNK tokens in at most
# BUSY_SHARE of its time, URGENT_SHARE while an urgent job (a suspect endpoint's answer, a probe)
# waits: its verdict is what takes a broken endpoint, and the handoffs it causes, out (an idle
# standby audits in chunks of the auditor's size).
BUSY_SHARE, URGENT_SHARE, BUSY_CHUNK = 0.2, 0.5, 16


class _Wake:
    """An inbox item that only wakes the worker (a drift audit was queued)."""


_WAKE = _Wake()


@dataclass(eq=False)  # by identity: a task is a key of the turn's rows
class _Task:
    m: RequestMachine
    action: Action | Drafted
    enqueued: float
    session: Session | None = None
    rung: int = 0  # the rung of `session`
    feed: list[int] | None = None  # ids to evaluate before the task's next rows
    rows: int = 1  # rows wanted from the forward that ends `feed`
    opened: bool = False  # `feed` opens the rung (a handoff's context), not a decode step
    caught: int | None = None  # a warm opening: the ids fed to a kept session (None: the whole context)
    handoff: bool = True  # counts against max_sessions (a verification window does not)


def batched(engine: Engine, sessions: int) -> Engine:
    """A torch rung becomes its batched form (the same weights); another engine stays as it is."""
    return BatchedTorch(engine, sessions) if isinstance(engine, TorchEngine) else engine


class StandbyPool:
    """Rungs 1.. of the ladder (`engines[j]` for rung j), stepped by one worker thread."""

    def __init__(self, engines: Mapping[int, Engine], aborts: AbortRegistry, max_sessions: int = 4,
                 max_queue: int = 256, on_return: Callable[[RequestMachine], None] | None = None,
                 forward: Callable[[RequestMachine, Leave], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 on_checked: Callable[[RequestMachine], None] | None = None,
                 verify_sessions: int = 12, prefill_chunk: int = 256, deadline_per_token_s: float = 0.02,
                 cores: Cores | None = None, threads: int = 1,
                 on_audit: Callable[[AuditRecord], None] | None = None, audit_queue: int = 64):
        """on_return: a policy move back to rung 0. forward: a move to a rung not here (a remote
        one; QueueFullError when its pool is full). on_checked: a verified request's window was
        decided (or it ended): back to rung 0. verify_sessions: verified requests' sessions kept
        at once, beside the handoffs'. A forward's time, less `deadline_per_token_s` for each
        token past the first, is what a step's deadline sees (a context's chunk is not a stall).
        on_audit: a drift audit's record (qladder.audit; on this pool's thread)."""
        self._given = dict(engines)
        # (+2: the audit's job, and an ordinary one it set aside for an urgent one)
        self.engines = {j: batched(e, max_sessions + verify_sessions + 2) for j, e in engines.items()}
        self.forward = forward
        self.aborts = aborts
        self.max_sessions = max_sessions
        self.on_return = on_return
        self.on_checked = on_checked
        self.on_left: Callable[[str], None] | None = None  # set by the serving engine (see _left)
        self.may_return: Callable[[], bool] | None = None  # set by the serving engine: rung 0 takes returns now
        self.prefill_chunk = prefill_chunk
        self.deadline_per_token_s = deadline_per_token_s
        self.cores, self.threads = cores, threads  # a lease of up to `threads` cores per forward
        # drift audits (qladder.audit) on the first full-precision rung in its batched form (rung 1,
        # or rung 2 above an int8 rung), in the turns with nothing else to do
        full = next((e for _, e in sorted(self.engines.items()) if isinstance(e, BatchedTorch)), None)
        self.auditor = Auditor(full, on_audit, max_jobs=audit_queue) \
            if on_audit is not None and full is not None else None
        self.clock = clock
        self._inbox: queue.Queue[_Task | _Wake | None] = queue.Queue(maxsize=max_queue)
        self._waiting: deque[_Task] = deque()
        self._active: list[_Task] = []
        # verified requests' sessions between windows, and the rung each is on
        self._kept: dict[str, tuple[RequestMachine, Session, int]] = {}
        self._n_handoffs = 0
        self._busy_s = self._busy_audit_s = 0.0  # this busy spell's requests' and audit's time (_audit_turn)
        self.waits_ms: deque[float] = deque(maxlen=1024)  # queue wait of recent handoffs
        self.forwards = 0  # batched forwards run
        self.windows = 0  # draft windows decided
        self.drafts = 0  # drafts in them
        self.drafts_kept = 0  # drafts that stood
        self.bugs: list[BaseException] = []  # exceptions of our own code, raised again by close()
        self._thread = threading.Thread(target=self._run, name="qladder-standby", daemon=True)
        for e in self.engines.values():
            e.instrument(True, True)  # owned by this pool from here on: handoffs are always monitored
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, m: RequestMachine, action: Leave) -> None:
        """Take over a request (the caller gives it up). Raises QueueFullError when full."""
        try:
            self._inbox.put_nowait(_Task(m, action, self.clock(), handoff=not isinstance(action, Drafted)))
        except queue.Full:
            raise QueueFullError("the standby's queue is full") from None

    def audit(self, job: AuditJob) -> None:
        """Queue a drift audit (any thread; a full queue drops its oldest, counted)."""
        if self.auditor is not None:
            self.auditor.offer(job)
            with contextlib.suppress(queue.Full):  # a full inbox wakes the worker anyway
                self._inbox.put_nowait(_WAKE)

    @property
    def depth(self) -> int:
        return self._inbox.qsize() + len(self._waiting)

    @property
    def active(self) -> int:
        """Handoffs open (the worker's count as of its last turn: safe to read from any thread)."""
        return self._n_handoffs

    def close(self) -> None:
        """Stop the worker (requests still open end as aborted); raises EngineDeadError when a bug
        of our own code was caught while serving (bugs are not hazards)."""
        self._inbox.put(None)
        self._thread.join(timeout=30)
        for j, e in self.engines.items():
            if e is not self._given[j]:
                e.close()  # the batched form's cache (the weights are the given engine's)
        if self.bugs:
            raise EngineDeadError(f"the standby hit {len(self.bugs)} bug(s): {self.bugs[0]!r}") from self.bugs[0]

    # -- the worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            block = not self._active and not self._waiting and not (self.auditor and self.auditor.runnable)
            if block and self.cores is not None:  # idle: INT4 may take every core (cores.int4_threads)
                self.cores.standby_turn(False, self.clock())
            try:
                while True:
                    t = self._inbox.get(block=block, timeout=None)
                    block = False
                    if t is None:
                        self._shutdown()
                        return
                    if isinstance(t, _Wake):
                        continue
                    if t.handoff:
                        self._waiting.append(t)
                    else:
                        self._active.append(t)
            except queue.Empty:
                pass
            self._sweep()
            while self._waiting and self._handoffs() < self.max_sessions:
                t = self._waiting.popleft()
                self.waits_ms.append((self.clock() - t.enqueued) * 1e3)
                self._active.append(t)
            self._n_handoffs = self._handoffs()
            if self.cores is not None:
                self.cores.standby_turn(bool(self._active or (self.auditor and self.auditor.runnable)), self.clock(),
                                        requests=bool(self._active))
            try:
                busy, t0 = bool(self._active), self.clock()
                self._turn()
                self._n_handoffs = self._handoffs()
                if self.auditor is not None:
                    self._audit_turn(self.auditor, self.clock() - t0 if busy else 0.0)
            except Exception as exc:  # a bug in our code: every request of the turn still gets an
                _log.exception("the standby failed")  # answer, and close() raises
                self.bugs.append(exc)
                for t in self._active:
                    self._close(t)
                    t.m.finish(FinishReason.DEGRADED, fallback=True)
                    self._back(t)
                self._active.clear()

    def _audit_turn(self, auditor: Auditor, turn_s: float) -> None:
        """After a turn that took `turn_s` of requests' work: an audit chunk if nothing else is
        waiting, or, while requests keep the standby busy, a BUSY_CHUNK one whenever the audit's
        time so far in this busy spell is under BUSY_SHARE of the requests' (URGENT_SHARE while an
        urgent job waits): the floor always runs, and a suspect endpoint's audits, first in the
        queue, decide under a stream of handoffs; a handoff's tokens are slowed by at most that
        share."""
        if not self._active and not self._waiting:
            self._busy_s = self._busy_audit_s = 0.0
            self._audit_chunk(auditor)
            return
        self._busy_s += turn_s
        share = URGENT_SHARE if auditor.urgent else BUSY_SHARE
        if auditor.runnable and self._busy_audit_s <= share * self._busy_s:
            self._busy_audit_s += self._audit_chunk(auditor, BUSY_CHUNK)

    def _audit_chunk(self, auditor: Auditor, chunk: int | None = None) -> float:
        """One chunk of a drift audit (on the leased cores). Returns its time."""
        leased = self._lease()
        t0 = self.clock()
        try:
            auditor.step(chunk)
        finally:
            if leased and self.cores is not None:
                self.cores.release(leased)
            took = self.clock() - t0
            auditor.charge(self.clock(), took * (leased or self.threads))
        return took

    def _handoffs(self) -> int:
        return sum(t.handoff for t in self._active)

    def _sweep(self) -> None:
        """Close the kept sessions of verified requests that have ended (anywhere)."""
        for rid in [r for r in self._kept if not self.aborts.is_live(r)]:
            with contextlib.suppress(Exception):
                self._kept.pop(rid)[1].close()

    def _shutdown(self) -> None:
        for t in [*self._active, *self._waiting]:
            self._close(t)
            t.m.finish(FinishReason.ABORT)
        self._active.clear()
        self._waiting.clear()
        for _, s, _ in self._kept.values():
            with contextlib.suppress(Exception):
                s.close()
        self._kept.clear()
        if self.auditor is not None:
            self.auditor.close()

    def _close(self, t: _Task) -> None:
        """Close the task's session, and the request's kept verifying session (it leaves verification)."""
        kept = self._kept.pop(t.m.request_id, None)
        for s in {id(x): x for x in (t.session, kept[1] if kept is not None else None) if x is not None}.values():
            with contextlib.suppress(Exception):
                s.close()
        t.session = None

    def _turn(self) -> None:
        """Prepare every active task's work, run one forward per rung, act on the rows."""
        for t in list(self._active):
            if self._prepare(t):
                self._active.remove(t)
        by_rung: dict[int, list[_Task]] = {}
        for t in self._active:
            if t.session is not None and t.feed is not None:
                by_rung.setdefault(t.rung, []).append(t)
        for j, tasks in by_rung.items():
            done = self._forward(self.engines[j], tasks)
            for t in tasks:
                if t in done and self._rows(t, done[t]):
                    self._active.remove(t)

    def _prepare(self, t: _Task) -> bool:
        """Before the forward: end an aborted or finished task, carry out a move (open the rung:
        its context becomes the feed), or queue the next token. True when the task leaves."""
        m = t.m
        if self.aborts.is_aborted(m.request_id):
            self._close(t)
            m.finish(FinishReason.ABORT)
            self._back(t)
            return True
        if isinstance(t.action, Done):
            self._close(t)
            self._back(t)
            return True
        if t.feed is not None:
            return False  # a context still being evaluated, chunk by chunk
        if isinstance(t.action, Drafted):
            return self._open_window(t, t.action)
        if isinstance(t.action, (MoveTo, Verify)):
            return self._carry_out(t)
        assert t.session is not None and isinstance(t.action, Continue)
        t.feed, t.rows, t.opened = [m.accepted[-1]], 1, False
        return False

    def _left(self, t: _Task) -> None:
        """The task goes on as an ordinary handoff; a verified request that leaves verification
        here tells rung 0 to release the slot it keeps for it (its machine stays here)."""
        if not t.handoff and self.on_left is not None:
            self.on_left(t.m.request_id)
        t.handoff = True

    def _back(self, t: _Task) -> None:
        """A verified request goes back to rung 0 whatever happened here (its slot waits there)."""
        if not t.handoff and self.on_checked is not None:
            self.on_checked(t.m)

    def _carry_out(self, t: _Task) -> bool:
        m, action = t.m, t.action
        assert isinstance(action, (MoveTo, Verify))
        j = action.rung
        if j == 0 and self.on_return is not None and (self.may_return is None or self.may_return()):
            self._close(t)  # the policy returns to the INT4 pool
            self.on_return(m)
            return True
        if j == 0:  # no pool to return to (or it was ejected): go on here
            t.action = Continue()
            return self._prepare(t)
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
        kept = self._kept.get(m.request_id)
        # at most all but the context's last id, fed again for the row that decides the next token
        n = min(common_prefix(kept[1].token_ids, m.context), len(m.context) - 1) \
            if isinstance(action, MoveTo) and kept is not None and kept[0] is m and kept[2] == j else 0
        if n:
            # Warm: the session that verified this answer's windows holds rung j's cache of its
            # context up to the last window, and is fed only what it lacks (a verified request
            # that stops drafting: one id).
            s = self._kept.pop(m.request_id)[1]
            if n < s.n_tokens:
                s.rollback(s.n_tokens - n)
            t.session, t.handoff = s, True
            t.rung, t.feed, t.rows, t.opened, t.caught = j, m.context[n:], 1, True, len(m.context) - n
            return False
        self._close(t)
        t.handoff = True
        try:
            t.session = self._reserve(self.engines[j], m.context)
        except EngineError as exc:
            return self._open_failed(t, j, str(exc))
        t.rung, t.feed, t.rows, t.opened, t.caught = j, self._pending(t.session), 1, True, None
        return False

    def _open_window(self, t: _Task, d: Drafted) -> bool:
        m = t.m
        kept = self._kept.get(m.request_id)
        if kept is not None and kept[0] is m:
            t.session = kept[1]
        else:
            try:
                t.session = self._reserve(self.engines[d.rung], m.context)
            except EngineError as exc:
                return self._open_failed(t, d.rung, str(exc))
            self._kept[m.request_id] = (m, t.session, d.rung)
            self._pending(t.session)  # dropped: the window below starts at the context's first id
        m.decided_by(d.rung, d.hazard)
        t.rung, t.feed = d.rung, verify.window(m, t.session.n_tokens, d)
        t.rows, t.opened = len(d.ids) + 1, True
        return False

    def _open_failed(self, t: _Task, j: int, error: str) -> bool:
        m = t.m
        self._close(t)
        if isinstance(t.action, MoveTo) and m.rung != j:
            m.moved(j, len(m.context), warm=False)
        t.action = m.on_hazard(Hazard("engine_error", self.engines[j].name, m.step, detail=error), None)
        if isinstance(t.action, Done):
            self._back(t)
            return True
        self._left(t)
        return False

    @staticmethod
    def _reserve(engine: Engine, ids: list[int]) -> Session:
        """A session whose ids are evaluated by the pool's forwards (a batched rung), or opened now."""
        if isinstance(engine, BatchedTorch):
            return engine.reserve(ids)
        return engine.open(ids)

    @staticmethod
    def _pending(s: Session) -> list[int]:
        return s.take_pending() if isinstance(s, BatchedTorchSession) else []

    def _forward(self, engine: Engine, tasks: list[_Task]) -> dict[_Task, Rows]:
        """One forward over the tasks' feeds (a batched rung), or one session after the other.
        Returns the rows of each task whose feed ended (an EngineError: StepFailed)."""
        t0 = self.clock()
        out: dict[_Task, Rows] = {}
        chunks = {t: self._chunk(t) for t in tasks}
        if isinstance(engine, BatchedTorch):
            work = []
            for t in tasks:
                assert isinstance(t.session, BatchedTorchSession)
                ids, last = chunks[t]
                work.append((t.session, ids, t.rows if last else 0))
            leased = self._lease()
            t0 = self.clock()  # the lease's wait is not the forward's time
            try:
                engine.run(work)
            except EngineError as exc:
                return {t: StepFailed(str(exc)) for t in tasks}
            finally:
                if leased and self.cores is not None:
                    self.cores.release(leased)
            self.forwards += 1
            took = self._took(t0, sum(len(ids) for ids, _ in chunks.values()))
            for s, _, n in work:
                t = next(t for t in tasks if t.session is s)
                if n:
                    out[t] = (s.rows(), s.output(), took)
            return out
        for t in tasks:  # an engine without a batched form: its sessions one by one
            ids, _ = chunks[t]
            one = t.session
            assert one is not None
            t0 = self.clock()
            try:
                rows = [one.logits().clone()] if t.rows > len(ids) else []
                for i, tok in enumerate(ids):
                    one.push(tok)
                    if i >= len(ids) - t.rows:
                        rows.append(one.logits().clone())
                out[t] = (torch.stack(rows), one.output(), self._took(t0, len(ids)))
            except EngineError as exc:
                out[t] = StepFailed(str(exc))
        return out

    def _lease(self) -> int:
        """Lease cores for one forward (up to `threads`) and set torch's threads to it; 0 without
        a shared lease (torch's threads as they were set)."""
        if self.cores is None:
            return 0
        n = self.cores.lease(self.threads)
        torch.set_num_threads(n)
        return n

    def _took(self, t0: float, n_tokens: int) -> float:
        return max(self.clock() - t0 - self.deadline_per_token_s * max(n_tokens - 1, 0), 0.0)

    def _chunk(self, t: _Task) -> tuple[list[int], bool]:
        """The next chunk of a task's feed, and whether it is the last (a batched rung; another
        engine opened its session on the context and gets the whole feed at once)."""
        feed = t.feed or []
        if not isinstance(t.session, BatchedTorchSession):
            t.feed = None
            return feed, True
        cut = self.prefill_chunk
        if 0 < len(feed) - cut < t.rows:  # the last chunk must hold every row the task wants
            cut = len(feed) - t.rows
        ids, t.feed = feed[:cut], feed[cut:]
        last = not t.feed
        if last:
            t.feed = None
        return ids, last

    def _rows(self, t: _Task, got: Rows) -> bool:
        """Act on a task's rows. True when it leaves the pool."""
        m, action = t.m, t.action
        if isinstance(action, MoveTo) and t.opened and m.rung != action.rung:  # not routed here from the start
            m.moved(action.rung, len(m.context) if t.caught is None else t.caught, warm=t.caught is not None)
        if isinstance(got, StepFailed):
            t.feed, t.rows = None, 1  # what was left of a context is moot: the session is not trusted
            if isinstance(action, Drafted):  # the verifying rung failed
                self._close(t)
                t.action = m.on_hazard(Hazard("engine_error", m.rungs[action.rung], m.step, detail=got.error), None)
                return self._after_window(t)
            if isinstance(action, Verify):
                t.action = m.on_verify(None)  # the rung could not say
                self._close(t)
                return self._settle(t)
            t.action = step(m, got, 0.0)
            return self._settle(t)
        rows, out, took = got
        if isinstance(action, Drafted):
            self.windows += 1
            self.drafts += len(action.ids)
            t.action, kept = verify.decide(m, rows, action, took, lambda r: _with_row(out, r))
            self.drafts_kept += kept
            return self._after_window(t)
        if isinstance(action, Verify):
            t.action = m.on_verify(int(rows[-1].argmax()))
            if not (isinstance(t.action, MoveTo) and t.action.rung == action.rung):
                if isinstance(t.action, MoveTo | Verify):
                    self._close(t)  # elsewhere: carried out next turn
                return self._settle(t)
            m.moved(action.rung, len(m.context), warm=False)  # climbing here: this row is its first step
        t.action = step(m, out, took)
        return self._settle(t)

    def _settle(self, t: _Task) -> bool:
        if isinstance(t.action, Done):
            self._close(t)
            return True
        return False

    def _after_window(self, t: _Task) -> bool:
        """A window decided: back to rung 0 to draft on, ended, or (a hazard here) moved on."""
        m = t.m
        if isinstance(t.action, Continue):
            s = t.session
            assert s is not None
            s.rollback(s.n_tokens - verify.keep(m))
            t.session = None  # kept in self._kept for the next window
            self._back(t)
            return True
        if isinstance(t.action, Done):
            self._close(t)
            self._back(t)
            return True
        # A hazard: an ordinary handoff from here. The window's session stays kept: a handoff to
        # its rung opens warm on it (_carry_out); any other move closes it there.
        t.session = None
        self._left(t)
        return False



def _with_row(out: StepOutput, row: torch.Tensor) -> StepOutput:
    return StepOutput(row, out.stats, out.peaks, out.rest_peaks, out.activation_limit)
