"""The batched full-precision rung: one forward for many sessions of a torch rung.

`BatchedTorch` runs the Llama decoder of a loaded `TorchEngine` (the same parameters: nothing is
copied) over the tokens of several sessions at once:

    engine.run([(session_a, [tok], 1), (session_b, [t0, d1, ..., dk], k + 1), ...])
    session_b.rows()    # (k + 1, V): the rows of its last k + 1 new positions

Every session has its own KV cache (a slot of one preallocated cache per layer, positions
0..n_ctx), its own length, and its own rollback. The tokens of all sessions are packed into one
(T, D) matrix, so the projections, the MLP and the LM head run as one matmul each over every
row of the batch (the weights are read once a step: on a CPU, decode is bound by that read, so
eight sessions cost little more than one). Attention runs per session over its own cache
(scaled dot-product attention on a view of its slot, causal within its new tokens). A session
may bring one token (a decode), many (a prefill, a catch-up after a handoff) or a window of
draft tokens to verify, and asks for the rows of its last `n_rows` new positions (0 for a
prefill chunk that is not the last; the LM head runs on those rows only).

Exactness: a session's rows in a batch equal its rows alone up to fp32 rounding: the matmuls'
blocking may differ with the batch's row count (tests/test_torch_batch.py measures the
largest difference and asserts greedy answers token-identical); a session stepped alone is
bit-identical to itself, and a rollback re-decodes the last kept token alone, as it was first
decoded when it was pushed alone. The numerics follow transformers' Llama (RMSNorm in fp32 then
cast, rotary embedding from the model's own module, SiLU MLP): in fp16 (`w4a16`) the same
overflow happens where transformers' does.

Per-layer activation peaks are per session: each layer's max |hidden| per token is written into a
preallocated (layers, tokens) buffer, reduced per session after the forward, the sequence's first
position kept apart (`rest_peaks`), with one host sync for the whole batch.

One thread owns the engine and its sessions (the standby's worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qladder.engines.base import StepOutput, TokenIdsMixin
from qladder.engines.torch_engine import TorchEngine
from qladder.errors import EngineError, check_prompt_fits


class BatchedTorch:
    """A torch rung (fp32, w4a16, bf16) whose sessions step together. Implements `Engine`."""

    monitor_is_cheap = True
    computes_row_stats = False

    def __init__(self, engine: TorchEngine, n_slots: int = 16):
        self.base = engine
        self.name = engine.name
        self.precision = engine.precision
        self.n_ctx = engine.n_ctx
        self.n_vocab = engine.n_vocab
        self.eos_ids = engine.eos_ids
        self.dtype = engine.dtype
        self.n_slots = n_slots
        model: Any = engine.model
        cfg = model.config
        self.n_layer = int(cfg.num_hidden_layers)
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head)
        self.eps = float(cfg.rms_norm_eps)
        self._model = model.model
        self._lm_head = model.lm_head.weight
        self._rotary = model.model.rotary_emb
        self._layers = list(model.model.layers)
        # The KV cache: one slot per session. torch.empty leaves the pages untouched, so memory is
        # taken as positions are written (a slot of 2,048 positions is ~94 MB in fp32).
        shape = (n_slots, self.n_kv, self.n_ctx, self.head_dim)
        self._k = [torch.empty(shape, dtype=self.dtype) for _ in range(self.n_layer)]
        self._v = [torch.empty(shape, dtype=self.dtype) for _ in range(self.n_layer)]
        self._free = list(range(n_slots))
        self._monitor = False
        self.activation_limit = float(torch.finfo(self.dtype).max)
        self.forwards = 0  # forward passes run (one per `run`)

    # -- what the Engine protocol asks, from the base engine -----------------------------------
    @property
    def fingerprint(self) -> str:
        return self.base.fingerprint

    def tokenize(self, text: str, special: bool) -> list[int]:
        return self.base.tokenize(text, special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.base.detokenize(token_ids)

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.base.detokenize_bytes(token_ids)

    def instrument(self, activations: bool, row_stats: bool) -> None:
        self._monitor = activations

    def score(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> list[float]:
        return self.base.score(prompt_ids, answer_ids)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def open(self, prompt_ids: Sequence[int]) -> BatchedTorchSession:
        """A session on a free slot, its prompt prefilled (alone). EngineError when none is free."""
        s = self.reserve(prompt_ids)
        self.run([(s, s.take_pending(), 1)])
        return s

    def reserve(self, prompt_ids: Sequence[int]) -> BatchedTorchSession:
        """A session on a free slot whose prompt is not evaluated yet: the caller prefills it
        with others in one `run` (`take_pending()` gives its ids), in chunks if it likes."""
        check_prompt_fits(len(prompt_ids), self.n_ctx)
        if not self._free:
            raise EngineError(f"{self.name}: all {self.n_slots} sessions are in use")
        return BatchedTorchSession(self, self._free.pop(0), [int(t) for t in prompt_ids])

    def _release(self, slot: int) -> None:
        self._free.insert(0, slot)

    def close(self) -> None:
        self._k, self._v = [], []

    # -- the forward ---------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def run(self, work: Sequence[tuple[BatchedTorchSession, Sequence[int], int]]) -> None:
        """One forward over every session's new tokens. Each session keeps the rows of its last
        `n_rows` new positions; then `logits()`, `rows()` and `output()` read them. Raises
        EngineError (every session of the batch is then to be closed)."""
        items = [(s, [int(t) for t in ids], min(n, len(ids))) for s, ids, n in work if ids]
        if not items:
            return
        for s, ids, _ in items:
            if s._closed:
                raise EngineError("session is closed")
            if s.n_past + len(ids) > self.n_ctx:
                raise EngineError(f"context full ({self.n_ctx} tokens)")
        try:
            with torch.inference_mode():
                self._forward(items)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"{self.name} batched forward failed: {type(exc).__name__}: {exc}") from exc
        self.forwards += 1

    def _forward(self, items: list[tuple[BatchedTorchSession, list[int], int]]) -> None:
        work = [(s, toks) for s, toks, _ in items]
        ids = torch.tensor([t for _, toks in work for t in toks], dtype=torch.long)
        spans: list[tuple[int, int]] = []
        pos: list[int] = []
        slots: list[int] = []
        a = 0
        for s, toks in work:
            spans.append((a, a + len(toks)))
            pos.extend(range(s.n_past, s.n_past + len(toks)))
            slots.extend([s.slot] * len(toks))
            a += len(toks)
        n_tok = a
        positions = torch.tensor(pos, dtype=torch.long)
        slot_idx = torch.tensor(slots, dtype=torch.long)
        x = self._model.embed_tokens(ids)  # (T, D)
        cos, sin = self._rotary(x, positions.unsqueeze(0))  # (1, T, hd) each
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # (T, 1, hd)
        masks = [self._mask(s.n_past, b - a) for (s, _), (a, b) in zip(work, spans, strict=True)]
        peaks = torch.empty((self.n_layer, n_tok), dtype=torch.float32) if self._monitor else None
        hd, half = self.head_dim, self.head_dim // 2
        for li, layer in enumerate(self._layers):
            attn = layer.self_attn
            h = self._norm(x, layer.input_layernorm.weight)
            q = F.linear(h, attn.q_proj.weight).view(n_tok, self.n_head, hd)
            k = F.linear(h, attn.k_proj.weight).view(n_tok, self.n_kv, hd)
            v = F.linear(h, attn.v_proj.weight).view(n_tok, self.n_kv, hd)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            kc, vc = self._k[li], self._v[li]
            kc[slot_idx, :, positions] = k
            vc[slot_idx, :, positions] = v
            outs = []
            for (s, _), (a, b), mask in zip(work, spans, masks, strict=True):
                end = s.n_past + (b - a)
                qs = q[a:b].transpose(0, 1).unsqueeze(0)  # (1, H, t, hd)
                o = F.scaled_dot_product_attention(qs, kc[s.slot, :, :end].unsqueeze(0),
                                                   vc[s.slot, :, :end].unsqueeze(0), attn_mask=mask,
                                                   scale=attn.scaling, enable_gqa=True)
                outs.append(o[0].transpose(0, 1).reshape(b - a, self.n_head * hd))
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + F.linear(o, attn.o_proj.weight)
            mlp = layer.mlp
            h = self._norm(x, layer.post_attention_layernorm.weight)
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
            if peaks is not None:
                peaks[li] = x.abs().amax(dim=-1)
        keep = [torch.arange(b - n, b) for (a, b), (_, _, n) in zip(spans, items, strict=True)]
        sel = torch.cat(keep)
        logits = torch.empty((0, self.n_vocab))
        if len(sel):
            h = self._norm(x[sel], self._model.norm.weight)
            logits = F.linear(h, self._lm_head).float()  # (R, V)
        sess_peaks = self._session_peaks(work, spans, peaks) if peaks is not None else None
        r = 0
        for i, ((s, toks), k_rows) in enumerate(zip(work, keep, strict=True)):
            n = len(k_rows)
            s._accept(toks, logits[r:r + n] if n else None, None if sess_peaks is None else sess_peaks[i])
            r += n

    @staticmethod
    def _mask(n_past: int, t: int) -> torch.Tensor | None:
        """New token i of a session sees its cache's first n_past + i + 1 positions."""
        if t == 1:
            return None
        j = torch.arange(n_past + t)
        return j.unsqueeze(0) <= (n_past + torch.arange(t)).unsqueeze(1)  # (t, n_past + t)

    def _session_peaks(self, work: list[tuple[BatchedTorchSession, list[int]]], spans: list[tuple[int, int]],
                       peaks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per session: (max |hidden| per layer over its new tokens, the same without position 0)."""
        out = []
        for (s, _), (a, b) in zip(work, spans, strict=True):
            whole = peaks[:, a:b].amax(dim=1)
            if s.n_past == 0 and b - a == 1:
                rest = torch.zeros_like(whole)
            elif s.n_past == 0:
                rest = peaks[:, a + 1:b].amax(dim=1)
            else:
                rest = whole
            out.append((whole, rest))
        return out


class BatchedTorchSession(TokenIdsMixin):
    """One sequence on a BatchedTorch slot. A `Session`; `push`/`extend` run a forward of its own,
    `BatchedTorch.run` runs many sessions' steps in one."""

    def __init__(self, engine: BatchedTorch, slot: int, pending: list[int]):
        self._engine = engine
        self.slot = slot
        self._ids: list[int] = []
        self._pending = pending  # ids reserved with the session, not evaluated yet
        self._rows: torch.Tensor | None = None  # (R, V) rows kept by the last forward
        self._peaks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._chunked = False
        self._closed = False

    @property
    def n_past(self) -> int:
        """Positions in this session's cache."""
        return len(self._ids)

    def take_pending(self) -> list[int]:
        ids, self._pending = self._pending, []
        return ids

    def _accept(self, ids: list[int], rows: torch.Tensor | None,
                peaks: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._ids.extend(ids)
        self._rows = rows
        if peaks is not None and self._peaks is not None and rows is not None and self._chunked:
            peaks = (torch.maximum(peaks[0], self._peaks[0]), torch.maximum(peaks[1], self._peaks[1]))
        self._peaks = peaks
        self._chunked = rows is None  # a prefill chunk with no rows: its peaks carry to the next

    def rows(self) -> torch.Tensor:
        """The rows the last forward kept: (R, V) float32, one per new position (`all_rows`) or
        the last one. Valid until the session's next forward."""
        self.logits()
        assert self._rows is not None
        return self._rows

    def logits(self) -> torch.Tensor:
        if self._closed:
            raise EngineError("session is closed")
        if self._pending:
            self._engine.run([(self, self.take_pending(), 1)])
        if self._rows is None:
            # After a rollback: re-decode the last kept token alone, as it was first decoded.
            last = self._ids.pop()
            self._engine.run([(self, [last], 1)])
        assert self._rows is not None
        return self._rows[-1]

    def output(self) -> StepOutput:
        row = self.logits()
        if self._peaks is None:
            return StepOutput(row)
        whole, rest = self._peaks
        return StepOutput(row, None, whole, rest, self._engine.activation_limit)

    def push(self, token_id: int) -> None:
        self._engine.run([(self, [*self.take_pending(), int(token_id)], 1)])

    def extend(self, token_ids: Sequence[int]) -> None:
        if token_ids or self._pending:
            self._engine.run([(self, [*self.take_pending(), *token_ids], 1)])

    def rollback(self, n: int) -> None:
        self._check_rollback(n)
        if n == 0 or self._closed:
            return
        del self._ids[-n:]  # positions past n_past are overwritten by the next forward
        self._rows = None
        self._peaks = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rows = None
            self._engine._release(self.slot)
