"""What one request leaves on record, apart from its answer: timings, handoffs and incidents.

The machine calls it; a driver reads it through the machine (`m.rec`), and calls only
`rec.prefill(ms)` where it timed a real prefill (the in-process ladder; the served paths have no
prefill of their own: it counts as the time to the first token), `rec.flush`, and
`rec.verified(drafts, kept)` where it decided a window of verified decoding (the standby).

- timings: ttft_ms (the first accepted token, EOS included), prefill_ms, total_ms, and the gap
  between consecutive accepted tokens (`step_ms`); first_text_ms and first_text_tokens (when the
  first text was released, and how many tokens were accepted by then: what the checks held
  back before a client saw anything); for verified decoding, the windows decided,
  the drafts in them and the drafts that stood (verify_windows, verify_drafts, verify_kept);
- a handoff opens when a driver has carried out a move (`open_handoff`) and closes at the new
  rung's first accepted token, or at its first hazard (`close_handoff`): its latency runs from
  the moment the old rung was left to then;
- incidents wait for their handoff's latency and are then written to the sink; a failing sink
  never fails the answer: the log keeps the record as JSON.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qladder.incidents import Incident, IncidentSink, prompt_hash
from qladder.types import Event, Handoff, HandoffEvent, Hazard

if TYPE_CHECKING:
    from qladder.client import Request

_log = logging.getLogger("qladder.incidents")


class Recorder:
    """One request's records. Owned by the thread that owns its machine."""

    def __init__(self, request_id: str, incidents: IncidentSink | None, emit: Callable[[Event], None],
                 clock: Callable[[], float]):
        self.request_id = request_id
        self.incidents = incidents
        self.emit = emit
        self.clock = clock
        self.t0 = clock()
        self.timings: dict[str, float] = {}
        self.step_ms: list[float] = []
        self.handoffs: list[Handoff] = []
        self.endpoints: list[str] = []  # the replicas that wrote the answer's rung-0 tokens, in order
        self._last_accept: float | None = None
        self._open: tuple[float, str, str, int, bool] | None = None  # started, from, to, caught, warm
        self._pending: list[Incident] = []

    # -- timings -----------------------------------------------------------------------------
    def first_output(self, now: float) -> None:
        """A token was accepted (or ended the answer): the first one sets the time to it."""
        if "ttft_ms" not in self.timings:
            self.timings["ttft_ms"] = (now - self.t0) * 1e3
            self.timings.setdefault("prefill_ms", self.timings["ttft_ms"])

    def first_text(self, now: float, accepted: int) -> None:
        """Text was released: the first release sets the time to it and the tokens held by then."""
        if "first_text_ms" not in self.timings:
            self.timings["first_text_ms"] = (now - self.t0) * 1e3
            self.timings["first_text_tokens"] = accepted

    def token(self, now: float) -> None:
        """A token joined the answer: the gap since the previous one."""
        if self._last_accept is not None:
            self.step_ms.append((now - self._last_accept) * 1e3)
        self._last_accept = now

    def withdrawn(self) -> None:
        """The answer's tokens were withdrawn (the audit ejected the pool writing an answer its
        client reads whole): the first token and text are the next kept ones', and the gaps
        between withdrawn tokens are no gaps of the answer (the time since the request came in
        stays counted: t0 is kept)."""
        for k in ("ttft_ms", "first_text_ms", "first_text_tokens"):
            self.timings.pop(k, None)
        self.step_ms, self._last_accept = [], None

    def prefill(self, ms: float) -> None:
        """The driver timed the prompt's prefill itself."""
        self.timings["prefill_ms"] = ms

    def verified(self, drafts: int, kept: int) -> None:
        """Verified decoding: a window of `drafts` decided, `kept` of them stood."""
        for key, n in (("verify_windows", 1), ("verify_drafts", drafts), ("verify_kept", kept)):
            self.timings[key] = self.timings.get(key, 0) + n

    def served_by(self, endpoint: str) -> None:
        """A pool of replicas named the endpoint whose tokens follow (RemoteAt)."""
        if endpoint not in self.endpoints:
            self.endpoints.append(endpoint)

    def migrated(self) -> None:
        """A pool of replicas continued the answer's stream at a sibling (its replica died)."""
        self.timings["migrations"] = self.timings.get("migrations", 0) + 1

    def total(self) -> None:
        self.timings["total_ms"] = (self.clock() - self.t0) * 1e3

    # -- handoffs and incidents ----------------------------------------------------------------
    def open_handoff(self, started: float, from_rung: str, to_rung: str, caught: int, warm: bool) -> None:
        self._open = (started, from_rung, to_rung, caught, warm)

    def close_handoff(self, now: float, step: int) -> None:
        """The new rung gave its first token (or failed before it): the handoff's latency is known."""
        if self._open is None:
            return
        started, from_rung, to_rung, caught, warm = self._open
        self._open = None
        latency_ms = (now - started) * 1e3
        h = Handoff(from_rung, to_rung, step, latency_ms, caught, warm)
        self.handoffs.append(h)
        self.emit(HandoffEvent(self.request_id, h))
        self.flush(latency_ms)

    def incident(self, req: Request, prompt: Sequence[int], hazard: Hazard, action: str) -> None:
        """A hazard and what the policy did about it (`handoff:<rung>` or `stop:<reason>`): written
        once the handoff's latency is known (or at the end)."""
        ids = list(prompt)
        self._pending.append(Incident(req.request_id, prompt_hash(ids), ids, req.prompt_text, hazard, action, None,
                                      [str(f) for f in req.faults], time.time()))

    def flush(self, latency_ms: float | None) -> None:
        """Write the waiting incidents (a handoff's with its latency)."""
        pending, self._pending = self._pending, []
        for inc in pending:
            inc.handoff_latency_ms = latency_ms if inc.action.startswith("handoff") else None
            if self.incidents is not None:
                try:
                    self.incidents(inc)
                except Exception:  # a failing store must not fail the answer; the log keeps the record
                    _log.exception("incident store failed; the incident: %s",
                                   json.dumps(inc.to_dict(), default=str, ensure_ascii=True))
