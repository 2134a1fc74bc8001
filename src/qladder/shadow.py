"""Warm shadow: the fallback rung prefills the prompt ahead of time, on the other core.

llama.cpp (ctypes) and torch both release the GIL while they compute, so a worker thread running
the torch rung on one thread overlaps the int4 rung on the other core. Accepted tokens are fed to
the shadow in batches every `sync_every` tokens; at handoff only the tail since the last batch is
caught up, so handoff costs about one short batch instead of a full prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from qladder.engines.base import Engine, Session
from qladder.errors import EngineError


class WarmShadow:
    def __init__(self, engine: Engine, prompt_ids: Sequence[int], sync_every: int = 16):
        self.engine = engine
        self.sync_every = sync_every
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shadow-{engine.name}")
        self._fed = len(prompt_ids)  # ids submitted to the worker so far
        self._session: Session | None = None
        self._last: Future[None] = self._pool.submit(self._open, list(prompt_ids))

    def _open(self, ids: list[int]) -> None:
        self._session = self.engine.open(ids)

    def _extend(self, ids: list[int]) -> None:
        assert self._session is not None
        self._session.extend(ids)

    def feed(self, context: Sequence[int]) -> None:
        """Called after each accepted token with prompt + accepted; submits a batch when due."""
        if len(context) - self._fed >= self.sync_every and self._last.done():
            batch = list(context[self._fed :])
            self._fed = len(context)
            self._last = self._pool.submit(self._extend, batch)

    def ready(self, timeout: float | None = None) -> bool:
        """Whether the worker has run every batch submitted so far, waiting up to `timeout` s."""
        try:
            self._last.exception(timeout)
        except TimeoutError:
            return False
        return True

    def take(self, context: Sequence[int]) -> tuple[Session, int]:
        """Wait for the worker, catch up to `context`, and hand the session over.
        Returns the session and how many ids were caught up at handoff time."""
        try:
            self._last.result()
        except Exception as exc:
            self.discard()
            raise EngineError(f"warm shadow on {self.engine.name} failed: {exc}") from exc
        finally:
            self._pool.shutdown(wait=False)
        session = self._session
        assert session is not None
        have = session.n_tokens
        if session.token_ids != list(context[:have]):
            session.close()
            raise EngineError("warm shadow diverged from the context")
        session.extend(list(context[have:]))
        self._session = None
        return session, len(context) - have

    def discard(self) -> None:
        """Drop the shadow (the request ended without a handoff). Does not wait: a prefill still
        running finishes on the worker, which then closes its session."""
        self._last.add_done_callback(lambda _f: self._close())
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()
