"""Live and aborted request ids: clients (any thread) abort, the scheduler and the standby read.

One lock guards both sets, so an abort that races a request's end is either seen by the request
or dropped with it: an id is never left behind to abort a later request.
"""

from __future__ import annotations

import threading


class AbortRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._aborted: set[str] = set()

    def start(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._live.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Mark a live request aborted; False when no such request is in flight."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._aborted.add(request_id)
            return True

    def is_aborted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._aborted

    def is_live(self, request_id: str) -> bool:
        """Whether the request is in flight (started, its final event not yet delivered)."""
        with self._lock:
            return request_id in self._live

    def end(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._aborted.discard(request_id)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)
