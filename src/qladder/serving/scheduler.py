"""The INT4 pool's scheduler: one thread owns the batched llama.cpp context (vLLM's engine core).

Each iteration:
    take new requests and aborts from the inbox; admit waiting requests into free slots (FIFO)
    one llama_decode of a prefill chunk (`prefill_chunk` tokens, always monitored) of at most
      one prefilling slot, so a long prompt never stalls the others for more than one chunk a
      step; then one of the last accepted token of every decoding slot (monitored every
      `activation_every` steps), the slot whose prefill just ended among them
      (a request's GuardConfig.activation_every: the strict preset monitors every step)
    per row: machine.step judges the request's own row (deadline, guard; a faulted request's
      row as its RowFaults make it) and the scheduler acts on the action:
      Continue -> the token is pushed next step; MoveTo/Verify -> the request leaves for the
      standby (its slot is freed); Done -> the slot is freed
A hazard in one row drops only that row's step: the other rows go on.

Exactness (measured here, 1 thread): with one KV stream per slot, a sequence decoded in a batch
gives bit-identical logits to the same sequence decoded alone, and a prompt prefilled in chunks
gives the same row as one prefill (see llamacpp_batch for what breaks it in a unified buffer).

The watchdog (a second thread) sees a decode that runs past its deadline while it hangs: it
claims the batch's requests (under `_flight_lock`, the only state both threads touch), raises
the engine's abort flag (llama.cpp polls it between graph nodes), and hands every claimed request
to the standby with a `deadline` hazard. The scheduler, when the decode returns, discards its
results for claimed requests, frees their slots, and runs a one-token probe before it serves
again; until a probe succeeds the pool is unhealthy (`healthy` is False).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qladder.actions import Action, Continue, Done, Leave, MoveTo, StepFailed, Verify
from qladder.engines.base import StepOutput
from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry
from qladder.errors import EngineDeadError, EngineError, QueueFullError
from qladder.health.guard import GuardConfig, StepGuard
from qladder.machine import RequestMachine, step
from qladder.sampling import Sampler
from qladder.serving.aborts import AbortRegistry
from qladder.serving.cores import Cores
from qladder.serving.drafts import LEAVE_AFTER, Drafts
from qladder.serving.handoffs import RungPool
from qladder.serving.prompt_states import PromptState, PromptStates
from qladder.testing import seam as fault_seam
from qladder.types import FinishReason, Hazard

if TYPE_CHECKING:
    from qladder.testing.faults import RowFaults

_log = logging.getLogger("qladder.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_queue: int = 64  # waiting requests beyond the slots; more is a QueueFullError (429)
    prefill_chunk: int = 128  # prompt tokens per batch for one prefilling request
    # A decode past the tightest row's guard deadline (GuardConfig.step_deadline_s) plus this
    # allowance per token in the batch is a stall (a prefill chunk of 128 tokens takes ~0.5 s here).
    deadline_per_token_s: float = 0.02
    watchdog_tick_s: float = 0.01
    probe_every_s: float = 1.0  # while unhealthy, a one-token probe this often
    probe_deadline_s: float = 2.0
    # prompts' KV states kept after their prefill, restored when the same prompt comes again
    # (serving/prompt_states.py); 0: off. ~23 KB a token for the embedded model.
    prompt_cache_bytes: int = 512 << 20


@dataclass
class _Slot:
    m: RequestMachine  # not to be touched while `drafts.away` (the verifying rung has it)
    slot: int
    guard: GuardConfig  # the request's guard config and guard (read while its machine may be away)
    checker: StepGuard
    n_past: int = 0  # positions of this slot in the KV cache
    feed: list[int] = field(default_factory=list)  # ids still to evaluate (prompt, catch-up)
    returning: bool = False
    faults: RowFaults | None = None  # test machinery, only on a request that carries step faults
    gain: bool = False  # a gain fault set on this slot's rows (cleared at release)
    chunked: bool = False  # its peaks hold earlier, unjudged prefill chunks (carried to the next)
    drafts: Drafts | None = None  # a verified request's drafts (serving/drafts.py)
    cache_key: tuple[int, ...] | None = None  # its prompt, to be kept in the prompt cache once prefilled

    @property
    def away(self) -> bool:
        return self.drafts is not None and self.drafts.away


@dataclass
class _Flight:
    """The decode in progress, as the watchdog sees it."""

    step: int
    started: float
    deadline_s: float
    slots: list[_Slot]
    claimed: bool = False
    leased: int = 0  # cores leased for it, given back once (_give_back), behind _flight_lock


class Int4Scheduler:
    def __init__(self, engine: BatchedLlamaCpp, standby: RungPool | None, aborts: AbortRegistry,
                 config: SchedulerConfig | None = None, clock: Callable[[], float] = time.perf_counter,
                 cores: Cores | None = None):
        """cores: the machine's cores shared with the standby (elastic threads), or None: the
        engine's own thread count, always."""
        self.engine = engine
        self.cores = cores
        self.standby_threads = 1  # set by the serving engine: the standby's share while it works
        self.keep_drafting: Callable[[str], bool] | None = None  # set by the serving engine (its policy)
        self.stopped_drafting = 0  # verified requests that went on at the verifying rung alone
        self.left_drafting: Callable[[str], None] | None = None  # tells the engine's policy
        # set by the serving engine: whether the audit's test ejected this pool (read on this thread)
        self.ejected: Callable[[], bool] | None = None
        self.withdrawn = 0  # answers taken off the pool when it was ejected (_withdraw)
        self.standby = standby
        self.aborts = aborts
        self.config = config or SchedulerConfig()
        self.monitor = engine.has_native  # whether activation peaks can be had at all
        self.clock = clock
        self._inbox: queue.Queue[tuple[str, RequestMachine]] = queue.Queue()
        self._forgotten: queue.SimpleQueue[str] = queue.SimpleQueue()  # request ids (see forget)
        self._waiting: deque[_Slot] = deque()  # admitted to the queue, not yet in a slot
        self._count_lock = threading.Lock()
        self._n_waiting = 0  # requests in the pool (waiting or in a slot), behind _count_lock
        self._slots: dict[int, _Slot] = {}
        self._hung: dict[str, tuple[float, float]] = {}  # away requests of a hung decode: (deadline, took)
        self._free = list(range(engine.n_slots))
        self._flight_lock = threading.Lock()
        self._flight: _Flight | None = None
        self._wake = threading.Event()
        self._stop = False
        self.healthy = True
        self.dead: BaseException | None = None  # set (under _count_lock) if the thread died of a bug
        self._accepting = True  # cleared (under _count_lock) when the thread ends
        self._last_probe = 0.0
        self.steps = 0
        self.stalls = 0
        self.decode_s = 0.0  # time inside llama_decode
        self.rows_s = 0.0  # time in the per-row work after it (guard, sampling, text, events)
        self.rows = 0
        self.prefix_hits = 0  # admissions that copied the cached prefix instead of prefilling it
        self.prompts = PromptStates(self.config.prompt_cache_bytes)  # whole prompts' states, restored
        # (step, event, request id, slot) of recent admissions and releases, for tests and metrics
        self.slot_log: deque[tuple[int, str, str, int]] = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="qladder-int4", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="qladder-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # -- any thread --------------------------------------------------------------------------------
    def submit(self, m: RequestMachine) -> None:
        """Queue a request (the caller gives its machine up). Raises QueueFullError."""
        with self._count_lock:  # the put is inside the lock: nothing lands after the final drain
            if self.dead is not None or not self._accepting:
                raise EngineDeadError("the int4 scheduler is gone") from self.dead
            if self._n_waiting >= self.config.max_queue + self.engine.n_slots:
                raise QueueFullError(f"{self._n_waiting} requests waiting for the int4 pool", retry_after_s=1.0)
            self._n_waiting += 1
            self._inbox.put(("new", m))
        self._wake.set()

    def resubmit(self, m: RequestMachine) -> None:
        """A request the standby hands back to rung 0 (policy `return_after`)."""
        with self._count_lock:
            if not self._accepting:
                m.finish(FinishReason.ABORT)
                return
            self._inbox.put(("return", m))
        self._wake.set()

    def forget(self, request_id: str) -> None:
        """A verified request left verification at the standby (it goes on there as an ordinary
        handoff): release the slot kept for it, without touching its machine."""
        with self._count_lock:
            if not self._accepting:
                return
            self._forgotten.put(request_id)
        self._wake.set()

    def resume(self, m: RequestMachine) -> None:
        """A verified request's machine back from the verifying rung (its window decided, or ended)."""
        with self._count_lock:
            if not self._accepting:
                if m.done is None:
                    m.finish(FinishReason.ABORT)
                return
            self._inbox.put(("resume", m))
        self._wake.set()

    def wake(self) -> None:
        """An abort was registered: look at it at the next step."""
        self._wake.set()

    @property
    def slots_in_use(self) -> int:
        return self.engine.n_slots - len(self._free)

    @property
    def depth(self) -> int:
        return max(self._n_waiting - self.slots_in_use, 0)

    def close(self) -> None:
        """Stop both threads; raises EngineDeadError if one died of a bug (bugs stay bugs)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._watchdog.join(timeout=5)
        if self.dead is not None:
            raise EngineDeadError(f"the int4 scheduler died: {self.dead!r}") from self.dead

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in our code: never a hazard; it ends the pool, loudly
            _log.exception("the int4 scheduler died")
            with self._count_lock:
                self.dead = exc
        finally:
            with self._count_lock:
                self._accepting = False
            self._take_inbox()
            ended = FinishReason.ABORT if self.dead is None else FinishReason.DEGRADED
            for s in [*self._slots.values(), *self._waiting]:
                if not s.away:  # an away machine is the verifying rung's to end
                    s.m.finish(ended, fallback=self.dead is not None)
            self._slots.clear()
            self._waiting.clear()

    def _loop(self) -> None:
        while not self._stop:
            self._take_inbox()
            self._drop_aborted()
            if self.ejected is not None and (self._slots or self._waiting) and self.ejected():
                self._withdraw()
            if not self.healthy and self.clock() - self._last_probe > self.config.probe_every_s:
                self._probe()
            self._admit()
            if not self._slots or not self._step():  # idle, or every slot waits (a verification)
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _take_inbox(self) -> None:
        while True:
            try:
                rid = self._forgotten.get_nowait()
            except queue.Empty:
                break
            self._hung.pop(rid, None)
            for s in [s for s in self._slots.values() if s.away and s.m.request_id == rid]:
                self._release(s)
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "resume":
                self._resume(item)
                continue
            faults = fault_seam.row_faults(item.req.faults)  # the request's step faults, if any
            s = _Slot(item, -1, item.config.guard, item.guard, feed=item.context, faults=faults,
                      drafts=self._drafts(item))
            if kind == "new":
                self._waiting.append(s)
            else:
                self._count(+1)
                s.returning = s.drafts is None  # a verified one is not handed back: it re-drafts
                self._waiting.appendleft(s)

    def _drafts(self, m: RequestMachine) -> Drafts | None:
        """A verified request's drafts (None for any other)."""
        if not m.req.verified:
            return None
        sampler = None if m.params.greedy else Sampler(m.params, coupled=True)
        return Drafts(m.context, len(m.prompt), m.params, m.eos_ids, min(m.n_ctx), sampler)

    def _resume(self, m: RequestMachine) -> None:
        """A verified request is back: free its slot if it ended, else keep what of its drafts and
        KV still stands, and draft on (a slot lost meanwhile: admitted again, its context prefilled)."""
        s = next((x for x in self._slots.values() if x.m is m), None)
        hung = self._hung.pop(m.request_id, None)
        if s is None and hung is not None and m.done is None:  # its row was in a hung decode: fp32 goes on
            self._hand_off_hung(m, *hung, drafting=True)
            return
        if s is None:
            if m.done is None:
                self._count(+1)
                self._waiting.appendleft(_Slot(m, -1, m.config.guard, m.guard, feed=m.context,
                                               faults=fault_seam.row_faults(m.req.faults), drafts=self._drafts(m)))
            return
        d = s.drafts
        assert d is not None
        if m.done is not None:
            self._release(s)
            return
        poisoned = d.hazard is not None and d.sent == len(d.ids)  # its last evaluated position made a bad row
        context = m.context
        lcp = d.reconcile(context)
        # what the slot evaluated agrees with the new context and its kept lookahead up to here
        agree = len(d.base) + len(d.ids) if lcp >= len(context) else lcp
        keep = min(s.n_past, agree, s.n_past - 1 if poisoned else s.n_past)
        if keep < s.n_past:
            self.engine.truncate(s.slot, keep)
            s.n_past = keep
        s.feed = (d.base + d.ids)[keep:]
        if d.hazard is not None and d.strikes >= LEAVE_AFTER:  # refused again while away
            self._give_up_drafting(s, d.hazard)
            return
        self._send(s)

    def _stop_drafting(self, m: RequestMachine) -> None:
        """The request drafts no more: rung 0 is its rung again (the engine's policy is told)."""
        m.decided_by(0, None)
        if self.left_drafting is not None:
            self.left_drafting(m.request_id)

    def _hand_off_hung(self, m: RequestMachine, deadline: float, took: float, drafting: bool) -> None:
        """A request whose row was in a decode the watchdog claimed (found there by the watchdog's
        thread, or back from the standby after it: `_resume`): INT4 failed it, the rest is fp32's."""
        if drafting:
            self._stop_drafting(m)
        if self.aborts.is_aborted(m.request_id):
            m.finish(FinishReason.ABORT)
            return
        hazard = Hazard("deadline", m.rungs[m.rung], m.step, took, deadline,
                        detail=f"int4 step hung for {took * 1e3:.0f} ms (watchdog)")
        action = m.on_hazard(hazard, None)
        if not isinstance(action, Done):
            self._to_standby(m, action)

    def _withdraw(self) -> None:
        """The audit's test ejected this pool: every answer it is writing or about to (a verified
        one's drafts aside: its verifying rung decides them; and its probes) leaves for the standby now, as an
        `audit` hazard. An answer its client reads whole starts again there with none of INT4's
        tokens in it (machine.on_hazard); a streamed one goes on from what its client was sent."""
        def hazard(s: _Slot) -> Hazard:
            return Hazard("audit", s.m.rungs[0], s.m.step, detail="the audit ejected the INT4 pool writing it")
        for s in [s for s in self._slots.values() if s.drafts is None and s.m.rung == 0 and not s.m.req.probe]:
            self.withdrawn += 1
            self._leave(s, s.m.on_hazard(hazard(s), None))
        for s in [s for s in self._waiting if s.drafts is None and s.m.rung == 0 and not s.returning
                  and not s.m.req.probe]:
            self._waiting.remove(s)
            self._count(-1)
            self.withdrawn += 1
            action = s.m.on_hazard(hazard(s), None)
            if not isinstance(action, Done):
                self._to_standby(s.m, action)

    def _drop_aborted(self) -> None:
        for s in [s for s in self._waiting if self.aborts.is_aborted(s.m.request_id)]:
            self._waiting.remove(s)
            self._count(-1)
            s.m.finish(FinishReason.ABORT)
        for s in [s for s in self._slots.values() if self.aborts.is_aborted(s.m.request_id)]:
            self._release(s)
            if not s.away:  # an away machine: the verifying rung ends it
                s.m.finish(FinishReason.ABORT)
        for s in [s for s in self._slots.values() if s.away and not self.aborts.is_live(s.m.request_id)]:
            self._release(s)  # ended at the verifying rung (it left verification: a hazard there)

    def _admit(self) -> None:
        while self._waiting and self._free and self.healthy:
            s = self._waiting.popleft()
            s.slot = self._free.pop(0)
            key = self._cache_key(s)
            if s.returning:  # back from the standby: from its re-prefill on, rung 0's (judged, faulted) work
                s.returning = False
                s.m.moved(0, s.m.step + len(s.m.prompt), warm=False)
            self._slots[s.slot] = s
            prefix = self.engine.prefix
            if key is not None and self._restore(s, key):
                pass  # the whole prompt's state: only its last token is decoded, in the next batch
            else:
                s.cache_key = key  # kept once its prefill ends (_store)
                if prefix and s.n_past == 0 and len(s.feed) > len(prefix) and tuple(s.feed[:len(prefix)]) == prefix:
                    s.n_past = self.engine.copy_prefix(s.slot)  # the shared system turn, prefilled once
                    del s.feed[:s.n_past]
                    self.prefix_hits += 1
                else:
                    self.engine.truncate(s.slot, 0)
            # The request's gain faults, if any: an activation outlier through the real kernels, this slot only.
            s.gain = fault_seam.slot_gains(self.engine, s.slot, s.m.req.faults)
            self.slot_log.append((self.steps, "admit", s.m.request_id, s.slot))

    def _cache_key(self, s: _Slot) -> tuple[int, ...] | None:
        """The prompt cache's key for a request about to take a slot, or None where it neither
        stores nor restores: the cache off, a request with faults (its prefill runs through
        them), one coming back from the standby (its context is prompt and answer), a prompt of
        one token."""
        if not self.prompts.enabled or s.returning or s.n_past or s.faults is not None or s.m.req.faults \
                or len(s.feed) < 2:
            return None
        return tuple(s.feed)

    def _restore(self, s: _Slot, key: tuple[int, ...]) -> bool:
        """Give the slot the prompt's cached state less its last position and leave that token
        to decode; its peaks are carried to that row when its guard checks activations. False:
        not cached (or the state would not load): the prompt is prefilled."""
        monitored = self.monitor and s.guard.check_activations
        hit = self.prompts.get(key, monitored)
        if hit is None:
            return False
        try:
            self.engine.load_state(s.slot, hit.state, len(key) - 1)
        except EngineError:
            _log.exception("a cached prompt state did not load on slot %d: prefilling it", s.slot)
            return False
        prefix = self.engine.prefix
        if prefix and key[:len(prefix)] == prefix:
            self.engine.holds_prefix(s.slot)
        s.n_past = len(key) - 1
        del s.feed[:-1]
        if monitored:
            assert hit.peaks is not None and hit.rest is not None
            self.engine.carry_peaks(s.slot, hit.peaks, hit.rest)
            s.chunked = True
        return True

    def _store(self, s: _Slot, monitored: bool) -> None:
        """Keep the state the prompt's prefill just left (its last chunk decoded, no error)."""
        key, s.cache_key = s.cache_key, None
        assert key is not None
        try:
            state = self.engine.save_state(s.slot)
        except EngineError:
            _log.exception("the prompt state of slot %d could not be kept", s.slot)
            return
        peaks, rest = (t.numpy().copy() for t in self.engine.peaks(s.slot)) if monitored else (None, None)
        self.prompts.put(key, PromptState(state, peaks, rest))

    def _release(self, s: _Slot) -> None:
        """Free a slot at once: its KV removed, the slot reusable by the next step's admission."""
        if self._slots.get(s.slot) is s:
            del self._slots[s.slot]
            self.engine.release(s.slot)  # keeps the cached prefix's KV for the next admission
            if s.gain:
                self.engine.clear_gain(s.slot)
                s.gain = False
            self._free.insert(0, s.slot)  # the next admission takes it
            self.slot_log.append((self.steps, "release", s.m.request_id, s.slot))
            self._count(-1)

    def _count(self, d: int) -> None:
        with self._count_lock:
            self._n_waiting += d

    def _plan(self) -> tuple[list[Entry], list[_Slot], _Slot | None]:
        """Decode rows (one token each, every decoding slot) and at most one prefilling slot."""
        entries, batch = [], []
        prefilling = None
        for s in self._slots.values():
            if len(s.feed) > 1 or (s.feed and s.n_past == 0):
                if prefilling is None:
                    prefilling = s  # one prefill chunk a step (see the module docstring)
                continue
            if s.feed and (s.drafts is None or s.drafts.wants_row()):
                entries.append(Entry(s.slot, s.feed, s.n_past, carry_peaks=s.chunked))
                batch.append(s)
        return entries, batch, prefilling

    def _step(self) -> bool:
        """One scheduler step: one prefill chunk alone (llama.cpp decodes a prompt apart from
        other sequences' rows: see llamacpp_batch), then a decode of every decoding row, the
        request whose prefill just ended among them. Prefill first: a new request's first token
        does not wait for a decode step of the others (~60 ms at 8 rows). False when there was
        nothing to decode (every slot waits for its verification)."""
        _, _, prefilling = self._plan()
        if prefilling is not None:
            chunk = prefilling.feed[: self.config.prefill_chunk]
            last = len(chunk) == len(prefilling.feed)
            # Prompt-triggered outliers show at prefill: prefill chunks are always monitored, and
            # the engine carries an earlier chunk's peaks to the next, so the last chunk's row is
            # judged on every position of the prompt (as the one-sequence engine's prefill is).
            self._run_batch([Entry(prefilling.slot, chunk, prefilling.n_past, logits=last,
                                   carry_peaks=prefilling.chunked)], [prefilling], True)
        entries, batch, _ = self._plan()
        if entries and self.healthy:
            self._run_batch(entries, batch, False)
        elif prefilling is None:
            return False
        self.steps += 1
        return True

    def _run_batch(self, entries: list[Entry], batch: list[_Slot], prefill: bool) -> None:
        """One llama_decode, watched. Each request's own guard config decides what it needs: a
        row's activations are checked when its guard checks them and is due (a prefill chunk
        always; a decode every `GuardConfig.activation_every` steps of the pool), and the batch is
        monitored when one row is (the others' peaks are not handed to them: a request's verdict
        never depends on its neighbours); row stats are computed when one checks logits, and the
        deadline is the tightest row's."""
        cfg = self.config
        guards = [s.guard for s in batch]
        # (s.chunked on a decode row: a restored prompt's last token, its prefill's peaks carried)
        due = [self.monitor and s.guard.check_activations
               and (prefill or s.chunked or self.steps % s.guard.activation_every == 0) for s in batch]
        monitor = any(due)
        row_stats = any(g.check_logits for g in guards)
        deadline = min(g.step_deadline_s for g in guards)
        for e, s in zip(entries, batch, strict=True):
            stall = s.faults.stall(self._pos(s)) if s.faults is not None and e.logits else None
            if stall is not None:
                if self.engine.has_native:
                    self.engine.arm_stall(int(stall * 1e3))
                else:  # no native helpers: a hang in Python, still inside the watched window
                    self._arm_python_stall(stall)
        n_tokens = sum(len(e.ids) for e in entries)
        leased = self._lease()  # before the watched window: waiting for a core is not a stall
        flight = _Flight(self.steps, self.clock(), deadline + cfg.deadline_per_token_s * n_tokens, batch, leased=leased)
        with self._flight_lock:
            self._flight = flight
        error: str | None = None
        t0 = time.perf_counter()
        try:
            if self._py_stall_s > 0:
                self._python_stall()
            self.engine.decode(entries, monitor=monitor, row_stats=row_stats)
        except EngineError as exc:
            error = str(exc)
        finally:
            self._give_back(flight)
        t1 = time.perf_counter()
        self.decode_s += t1 - t0
        with self._flight_lock:
            self._flight = None
            claimed = flight.claimed
        if claimed:  # the watchdog moved these requests while the decode hung: discard its results
            for s in batch:
                if s.away:  # at the standby: it gets its deadline hazard when it comes back (_resume)
                    self._hung[s.m.request_id] = (flight.deadline_s, self.clock() - flight.started)
                self._release(s)
            self.engine.clear_abort()
            self._probe()
            return
        for e, s, d in zip(entries, batch, due, strict=True):
            s.n_past += len(e.ids)
            del s.feed[: len(e.ids)]
            s.chunked = d and not e.logits
            if not e.logits and error is None:
                continue
            if prefill and error is None and s.cache_key is not None:
                self._store(s, d)
            self._on_row(s, error, d)
        self.rows_s += time.perf_counter() - t1
        self.rows += len(batch)

    @staticmethod
    def _pos(s: _Slot) -> int:
        """The answer's step the slot's next row is for."""
        return s.drafts.position if s.drafts is not None else s.m.step

    def _on_row(self, s: _Slot, error: str | None, monitored: bool) -> None:
        eng = self.engine
        out: StepOutput | StepFailed
        if error is not None:  # a failed decode: every row of the batch leaves
            out = StepFailed(error)
        else:
            peaks, rest = eng.peaks(s.slot) if monitored else (None, None)
            out = StepOutput(eng.row(s.slot), eng.row_stats(s.slot), peaks, rest,
                             eng.activation_limit if monitored else None)
        native: Callable[[], int] | None = functools.partial(eng.argmax, s.slot)
        if s.faults is not None and isinstance(out, StepOutput):  # test machinery: the row as the faults make it
            try:
                faulted = s.faults.output(out, self._pos(s))
            except EngineError as exc:
                out, native = StepFailed(str(exc)), None
            else:
                if faulted is not out:  # a replaced row: the engine's argmax is of the one it replaced
                    out, native = faulted, None
        if s.drafts is not None:  # a verified request's row: a draft, or a refused one
            self._on_draft(s, s.drafts, out, native)
            return
        # The deadline is the watchdog's (took_s 0); greedy on the engine's own row takes its native
        # argmax (first maximum, as torch's), ~25 us less than torch's.
        m = s.m
        action = step(m, out, 0.0, native)
        if isinstance(action, Continue):
            s.feed = [m.accepted[-1]]
            return
        self._leave(s, action)

    def _on_draft(self, s: _Slot, d: Drafts, out: StepOutput | StepFailed,
                  native: Callable[[], int] | None) -> None:
        hazard = d.judge(out, s.checker, self.engine.name, native)
        if hazard is None:
            s.feed = [d.ids[-1]]
        elif d.strikes >= LEAVE_AFTER and not d.away:  # INT4 keeps failing here: fp32 alone from now
            self._give_up_drafting(s, hazard)
            return
        self._send(s)

    def _give_up_drafting(self, s: _Slot, hazard: Hazard) -> None:
        """INT4's rows keep failing for a verified request: it leaves verified decoding (an
        ordinary hazard on rung 0, handed off: the verifying rung decodes the rest alone)."""
        s.drafts = None
        self._stop_drafting(s.m)
        self._leave(s, s.m.on_hazard(hazard, None))

    def _send(self, s: _Slot) -> None:
        """A verified request whose machine is here and whose window is ready goes to the verifying
        rung; one the engine no longer wants drafting (the rung got busy: `keep_drafting`) goes
        there to decode alone (no handoff: rung 1 decides its tokens already)."""
        d = s.drafts
        if d is None or not d.ready():
            return
        if (self.keep_drafting is not None and d.hazard is None
                and not self.keep_drafting(s.m.request_id)):
            s.drafts = None
            self.stopped_drafting += 1
            self._leave(s, MoveTo(1, poisoned=False))
            return
        self._to_standby(s.m, d.window())

    def _leave(self, s: _Slot, action: Action) -> None:
        """The request leaves the pool: done, or to the standby (its slot freed either way)."""
        self._release(s)
        if isinstance(action, Done):
            return
        assert isinstance(action, (MoveTo, Verify))
        self._to_standby(s.m, action)

    def _to_standby(self, m: RequestMachine, action: Leave) -> None:
        if self.standby is None:
            m.finish(FinishReason.DEGRADED, fallback=True)
            return
        try:
            self.standby.submit(m, action)
        except QueueFullError:  # nothing is lost: the request ends with the explicit fallback
            m.finish(FinishReason.DEGRADED, fallback=True)

    def _lease(self) -> int:
        """Lease cores for one decode (up to as many as the engine was built for: every core while
        the standby is idle, what it leaves while it works; cores.int4_threads) and set the
        engine's threads to it; 0 without a shared lease (fixed threads)."""
        if self.cores is None:
            return 0
        n = self.cores.lease(self.cores.int4_want(self.engine.n_threads, self.standby_threads, self.clock()))
        self.engine.set_threads(n)
        return n

    def _probe(self) -> None:
        """One token on a free slot, under the watchdog: healthy again when it completes in time."""
        self.healthy = False
        self._last_probe = self.clock()
        if not self._free:
            return
        slot = self._free[0]
        flight = _Flight(self.steps, self.clock(), self.config.probe_deadline_s, [], leased=self._lease())
        with self._flight_lock:
            self._flight = flight
        try:
            self.engine.decode([Entry(slot, [self.engine.info.bos_id], 0)])
            ok = True
        except EngineError:
            ok = False
        finally:
            self._give_back(flight)
        with self._flight_lock:
            self._flight = None
            ok = ok and not flight.claimed
        self.engine.truncate(slot, 0)
        self.engine.clear_abort()
        self.healthy = ok

    # -- injected stalls without the native helpers ----------------------------------------------
    _py_stall_s: float = 0.0

    def _arm_python_stall(self, seconds: float) -> None:
        self._py_stall_s = seconds

    def _python_stall(self) -> None:
        end = self.clock() + self._py_stall_s
        self._py_stall_s = 0.0
        while self.clock() < end and not (self._flight and self._flight.claimed):
            time.sleep(0.005)

    def _give_back(self, f: _Flight) -> None:
        """A decode's cores back to the lease, once: by the scheduler when the decode returns, or
        by the watchdog when it claims a hung one (its threads may run on until llama.cpp sees the
        abort: the one time the two pools' threads can add up to more than the cores)."""
        with self._flight_lock:
            n, f.leased = f.leased, 0
        if n and self.cores is not None:
            self.cores.release(n)

    # -- the watchdog thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            self._watch_loop()
        except BaseException as exc:
            _log.exception("the int4 watchdog died")
            with self._count_lock:
                self.dead = exc

    def _watch_loop(self) -> None:
        while not self._stop:
            time.sleep(self.config.watchdog_tick_s)
            with self._flight_lock:
                f = self._flight
                if f is None or f.claimed or self.clock() - f.started <= f.deadline_s:
                    continue
                f.claimed = True  # from here the scheduler never touches these requests again
                took = self.clock() - f.started
            self.stalls += 1
            self.healthy = False
            self.engine.abort()
            self._give_back(f)  # the standby it hands them to must not wait for the hung decode's cores
            for s in f.slots:
                if s.away:  # the standby has it: its hazard comes when it is back (_run_batch, _resume)
                    continue
                drafting, s.drafts = s.drafts is not None, None  # a drafting request: fp32 goes on alone
                self._hand_off_hung(s.m, f.deadline_s, took, drafting)
