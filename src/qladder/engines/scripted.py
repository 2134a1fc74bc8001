"""A scripted engine: plays back logits from a function of the context. A real engine, not a mock.

Used by tests and by the original write-up's acceptance example: a primary whose logits are
`[[1.0, nan, 2.5]]` and a backup whose logits are `[[1.0, 0.2, 8.5]]`. `logits_fn(ids)` receives
the token ids in the cache and returns the next-token logits, so rollback and handoff behave
exactly as on a real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qladder.engines.base import StepOutput, TokenIdsMixin, tokenizer_fingerprint
from qladder.errors import EngineError, InputError

LogitsFn = Callable[[Sequence[int]], Sequence[float] | torch.Tensor]


class ScriptedEngine:
    """Tokens are characters: id i is chr(ord('a') + i) for a small vocabulary."""

    monitor_is_cheap = True  # nothing to monitor
    computes_row_stats = False

    def __init__(
        self,
        logits_fn: LogitsFn,
        n_vocab: int,
        name: str = "scripted",
        precision: str = "scripted",
        eos_id: int | None = None,
        n_ctx: int = 4096,
        vocab_tag: str = "v1",
    ):
        self.name = name
        self.precision = precision
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.eos_ids = frozenset() if eos_id is None else frozenset({eos_id})
        self._fn = logits_fn
        self._fingerprint = tokenizer_fingerprint(
            (f"{vocab_tag}:{i}" for i in range(n_vocab)), {"eos": eos_id}
        )
        self.steps = 0  # forward passes run, for tests

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def tokenize(self, text: str, special: bool) -> list[int]:
        return [(ord(c) - ord("a")) % self.n_vocab for c in text]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids if t not in self.eos_ids)

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.detokenize(token_ids).encode("utf-8")

    def open(self, prompt_ids: Sequence[int]) -> ScriptedSession:
        if not prompt_ids:
            raise InputError("empty prompt")
        return ScriptedSession(self, list(prompt_ids))

    def _row(self, ids: Sequence[int]) -> torch.Tensor:
        self.steps += 1
        row = torch.as_tensor(self._fn(ids), dtype=torch.float32).reshape(-1)  # (V,)
        if row.numel() != self.n_vocab:
            raise EngineError(f"scripted logits have {row.numel()} entries, expected {self.n_vocab}")
        return row

    def instrument(self, activations: bool, row_stats: bool) -> None:
        pass  # no activations; the guard reduces the row itself

    def close(self) -> None:
        pass


class ScriptedSession(TokenIdsMixin):
    def __init__(self, engine: ScriptedEngine, ids: list[int]):
        self._e = engine
        self._ids = ids
        self._row: torch.Tensor | None = engine._row(ids)
        self._closed = False

    def logits(self) -> torch.Tensor:
        if self._closed:
            raise EngineError("session is closed")
        if self._row is None:
            self._row = self._e._row(self._ids)
        return self._row

    def output(self) -> StepOutput:
        return StepOutput(self.logits())

    def push(self, token_id: int) -> None:
        self.extend([token_id])

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._closed:
            raise EngineError("session is closed")
        if token_ids:
            self._ids.extend(int(t) for t in token_ids)
            self._row = self._e._row(self._ids)

    def rollback(self, n: int) -> None:
        self._check_rollback(n)
        if n:
            del self._ids[-n:]
            self._row = None

    def close(self) -> None:
        self._closed = True
