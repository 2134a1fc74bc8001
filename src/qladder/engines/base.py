"""The session protocol every rung implements: one decode step at a time, rollback, handoff by ids.

An `Engine` holds loaded weights and a tokenizer; `Engine.open(prompt_ids)` prefills and returns a
`Session`. A session always knows the logits for the *next* token:

    s = engine.open(prompt_ids)     # prefill
    row = s.logits()                # (V,) float32, next-token logits
    s.push(token_id)                # accept a token; the next logits are computed
    s.rollback(n)                   # forget the last n tokens (KV cache truly truncated)
    s.extend(ids)                   # accept several tokens at once (catch-up after a handoff)
    out = s.output()                # the step's row with what the guard needs (StepOutput)
    s.close()

`engine.instrument(activations, row_stats)` switches what `output()` carries: the per-layer
activation peaks of the last forward, and the row's sum/max/min computed with its copy.

Rollback is exact: the KV entries of the dropped positions are removed, and the logits for the
new last position are recomputed lazily by re-decoding that one token, so re-decoding after a
rollback reproduces bit-identical logits. Engines raise `EngineError` for a failed step; the
session is then not to be trusted (the ladder closes it).

Handoff between engines is by token ids only, allowed when their `fingerprint`s match.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from qladder.errors import TokenizerMismatchError


@dataclass(frozen=True)
class StepOutput:
    """One step's outputs, as the guard reads them. Valid until the session's next call."""

    row: torch.Tensor  # (V,) float32 next-token logits
    stats: tuple[float, float, float] | None = None  # (sum, max, min) of `row`, when computed with its copy
    peaks: torch.Tensor | None = None  # (L,) max |hidden| per layer of the last forward; None: unmonitored
    rest_peaks: torch.Tensor | None = None  # (L,) the same away from the sequence's first position
    activation_limit: float | None = None  # the compute dtype's max, with `peaks`


@runtime_checkable
class Session(Protocol):
    """One sequence's state on one engine."""

    @property
    def n_tokens(self) -> int:
        """Tokens in the KV cache (prompt + accepted)."""
        ...

    @property
    def token_ids(self) -> list[int]:
        """A copy of the ids in the KV cache."""
        ...

    def logits(self) -> torch.Tensor:
        """Next-token logits, (V,) float32 on the CPU. Valid until the next call on this session
        (engines may reuse one buffer): clone it to keep it."""
        ...

    def output(self) -> StepOutput:
        """`logits()` with the step's row statistics and activation peaks, as instrumented."""
        ...

    def push(self, token_id: int) -> None:
        """Accept one token and compute the next logits (one decode step)."""
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """Accept several tokens in one batch."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last n tokens from the cache (at least one token must remain)."""
        ...

    def close(self) -> None:
        """Release the sequence's cache. Idempotent."""
        ...


@runtime_checkable
class Engine(Protocol):
    """A loaded model at one precision: a rung of the ladder."""

    name: str  # the rung's name, e.g. "int4"
    precision: str  # human label: weights/activations, e.g. "Q4_1 weights, fp32 compute (llama.cpp)"
    n_ctx: int
    n_vocab: int
    eos_ids: frozenset[int]
    monitor_is_cheap: bool  # whether activation peaks may be taken every step (torch hooks: yes)

    @property
    def computes_row_stats(self) -> bool:
        """Whether instrument(_, row_stats=True) makes output() carry the row's (sum, max, min),
        computed with its copy (llama.cpp's native helper); False: the guard reduces the row itself."""
        ...

    @property
    def fingerprint(self) -> str:
        """Hash of the vocabulary and special tokens."""
        ...

    def tokenize(self, text: str, special: bool) -> list[int]:
        """Token ids of text; `special` parses special-token text like `<|im_start|>`."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens left out; a partial character as U+FFFD)."""
        ...

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes of token ids (may end inside a multi-byte character)."""
        ...

    def open(self, prompt_ids: Sequence[int]) -> Session:
        """Prefill prompt ids and return a session positioned after them."""
        ...

    def instrument(self, activations: bool, row_stats: bool) -> None:
        """What sessions' `output()` carries from now on (its owner thread sets it)."""
        ...

    def close(self) -> None:
        """Free the weights."""
        ...


class TokenIdsMixin:
    """What every session keeps the same way: the ids in its cache, and the rollback bounds."""

    _ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _check_rollback(self, n: int) -> None:
        if n < 0 or n >= len(self._ids):
            raise ValueError(f"cannot roll back {n} of {len(self._ids)} tokens")


@functools.cache
def byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in for each byte (the public bytes-to-unicode table):
    printable Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onwards."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in set(keep)]
    return {**{chr(b): b for b in keep}, **{chr(0x100 + n): b for n, b in enumerate(extra)}}


def tokenizer_fingerprint(pieces: Iterable[str], special_ids: dict[str, int | None]) -> str:
    """sha256 over the vocabulary pieces in id order and the special token ids."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    for key in sorted(special_ids):
        h.update(f"{key}={special_ids[key]};".encode())
    return h.hexdigest()[:16]


class Tokenized(Protocol):
    """What a handoff by token ids needs of a rung, local or remote: its name and its vocabulary."""

    @property
    def name(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...


def check_handoff(src: Tokenized, dst: Tokenized) -> None:
    """Refuse a handoff by token ids between rungs whose tokenizers differ."""
    if src.fingerprint != dst.fingerprint:
        raise TokenizerMismatchError(
            f"cannot hand {src.name} tokens to {dst.name}: tokenizer fingerprints differ "
            f"({src.fingerprint} != {dst.fingerprint})"
        )
