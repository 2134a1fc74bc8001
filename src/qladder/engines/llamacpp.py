"""The `int4` rung: llama.cpp's real 4-bit kernels on the GGUF, through llama-cpp-python.

Only the low-level path is used: `llama_decode` on a batch, `llama_get_logits_ith(ctx, -1)` for the
row, and `llama_memory_seq_rm` to truncate the KV cache. (`Llama.scores` is stale without
`logits_all`, which costs ~400 MB, and exceptions raised inside a high-level `logits_processor`
are swallowed.) Rollback by `seq_rm` plus re-decoding gives bit-identical replays.

Threads default to one: on 2 shared cores, two llama.cpp threads beside another busy process
collapse.

Control vectors (`llama_set_adapter_cvec`) add a vector to a layer's output (`l_out`); the fault
models use them to inject activation outliers through the real kernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qladder.engines.base import StepOutput, TokenIdsMixin, tokenizer_fingerprint
from qladder.engines.monitor import ActivationMonitor
from qladder.errors import EngineError, InputError, ModelError, check_prompt_fits
from qladder.levels import level_name
from qladder.model import ModelInfo

# Bytes that ordinary text never produces alone: UTF-8 lead and continuation bytes (>= 0x80, left
# over when rare Unicode such as an emoji ZWJ sequence has no merge), C0 controls other than tab,
# newline and carriage return, and DEL. Their single-byte tokens are a byte-level vocabulary's
# under-trained ones.
RARE_BYTES = frozenset(b for b in range(256) if b >= 0x7F or (b < 0x20 and b not in (9, 10, 13)))


class LlamaVocabMixin:
    """Tokenizer of a llama-cpp-python model (`self.llm`), shared by the int4 engines."""

    # llama_cpp has no type information: its objects are Any at this seam.
    llm: Any
    info: ModelInfo
    n_vocab: int
    eos_ids: frozenset[int]
    _lib: Any
    _vocab: Any
    _fingerprint: str | None
    _pieces: list[bytes] | None = None
    _lone: frozenset[int] | None = None
    _byte_ids: dict[int, int] | None = None
    _control: frozenset[int] | None = None
    _freed = False  # llama.cpp freed the model: a call into it would abort the process

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            get = self._lib.llama_vocab_get_text
            pieces = (get(self._vocab, i).decode("utf-8", "surrogateescape") for i in range(self.n_vocab))
            self._fingerprint = tokenizer_fingerprint(
                pieces, {"bos": self.info.bos_id, "eos": self.info.eos_id}
            )
        return self._fingerprint

    def tokenize(self, text: str, special: bool) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"text is not valid Unicode (lone surrogate at {exc.start}); sanitize it first") from exc
        if not data:
            return []
        self._alive()
        return list(self.llm.tokenize(data, add_bos=False, special=special))

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """Raw bytes as a byte-level vocabulary spells them (what a client that sends the bytes'
        tokens sends): each valid UTF-8 stretch tokenized as plain text, each byte that belongs to
        none as its own single-byte token (llama.cpp's own tokenizer would turn them into U+FFFD
        first). A byte the vocabulary has no token for (SmolLM2: 0xC0, 0xC1, 0xF5-0xFF and a few
        C0 controls, which valid UTF-8 text never holds alone) becomes U+FFFD, as llama.cpp does."""
        if self._byte_ids is None:
            self.detokenize_bytes([])
            assert self._pieces is not None
            self._byte_ids = {p[0]: i for i, p in reversed(list(enumerate(self._pieces))) if len(p) == 1}
        out: list[int] = []
        while data:
            try:
                out += self.tokenize(data.decode("utf-8"), False)
                break
            except UnicodeDecodeError as exc:
                out += self.tokenize(data[:exc.start].decode("utf-8"), False)
                for b in data[exc.start:exc.end]:
                    out += [self._byte_ids[b]] if b in self._byte_ids else self.tokenize("\ufffd", False)
                data = data[exc.end:]
        return out

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.detokenize_bytes(token_ids).decode("utf-8", "replace")

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes of token ids, end-of-sequence ids left out; may end inside a character.
        Each id's piece is looked up in a table made once (llama.cpp's detokenize concatenates the
        same pieces: no leading-space rule applies to a byte-level BPE without BOS)."""
        if self._pieces is None:
            self._alive()
            body = self.llm.detokenize
            self._pieces = [body([i]) for i in range(self.n_vocab)]
        pieces = self._pieces
        return b"".join(pieces[t] for t in token_ids if t not in self.eos_ids)

    def _alive(self) -> None:
        if self._freed:
            raise EngineError(f"the vocabulary of {self.info.path.name} was closed")

    @property
    def control_ids(self) -> frozenset[int]:
        """Ids of the vocabulary's control tokens (`<|im_start|>`, `<|im_end|>`, ...)."""
        if self._control is None:
            self._alive()
            is_control = self._lib.llama_vocab_is_control
            self._control = frozenset(i for i in range(self.n_vocab) if is_control(self._vocab, i))
        return self._control

    @property
    def lone_byte_ids(self) -> frozenset[int]:
        """Ids of the single-byte tokens of RARE_BYTES (the byte-fallback tokens)."""
        if self._lone is None:
            self.detokenize_bytes([])
            assert self._pieces is not None
            self._lone = frozenset(i for i, p in enumerate(self._pieces) if len(p) == 1 and p[0] in RARE_BYTES)
        return self._lone


class LlamaCppEngine(LlamaVocabMixin):
    name = "int4"
    monitor_is_cheap = False  # a monitored step splits llama.cpp's graph at each layer output

    def __init__(self, info: ModelInfo, n_ctx: int = 2048, n_threads: int = 1, n_batch: int = 512,
                 monitor_dir: Path | None = None, name: str = "int4"):
        """monitor_dir: where to build the C activation monitor; None runs without it. name: the
        rung it is ("int4"; "int8" on a Q8_0 file)."""
        import llama_cpp

        self._lib = llama_cpp
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(info.path),
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=False,
                # Flash attention on, as llama.cpp's own default (auto) picks it on the CPU and as
                # BatchedLlamaCpp pins it: the in-process and the served int4 rungs then give the
                # same rows on the same ids (with it off, rows differ by up to ~0.8 in a logit).
                flash_attn=True,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(f"llama.cpp cannot load {info.path}: {exc}") from exc
        self.info = info
        self.name = name
        self.precision = f"{level_name(info.file_type)} weights, llama.cpp CPU kernels (fp32 activations)"
        self.n_ctx = int(self.llm.n_ctx())
        self.n_vocab = int(self.llm.n_vocab())
        self.n_layer = info.n_layer
        self.n_embd = info.n_embd
        self.eos_ids = frozenset({info.eos_id})
        self._ctx = self.llm._ctx.ctx
        # Activation monitor (cb_eval): a context of our own with the C callback installed.
        # Its peaks are compared with fp16's maximum: the activation dtype of the GPU INT4
        # (W4A16) kernels this rung stands for, even though llama.cpp's CPU path computes in fp32.
        self.monitor: ActivationMonitor | None = None
        self.activation_peaks: torch.Tensor | None = None
        self.activation_rest_peaks: torch.Tensor | None = None
        self.activation_limit = float(torch.finfo(torch.float16).max)
        self._own_ctx = None
        self.monitor_error: str | None = None
        if monitor_dir is not None:
            try:
                self.monitor = ActivationMonitor(info.n_layer, info.n_embd, monitor_dir)
            except EngineError as exc:  # no compiler: run unmonitored, and say so
                self.monitor_error = str(exc)
        if self.monitor is not None:
            params = self.llm.context_params
            params.cb_eval = self.monitor.callback
            params.cb_eval_user_data = self.monitor.user_data
            ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
            if not ctx:
                raise ModelError("llama.cpp could not create a monitored context")
            self._own_ctx = ctx
            self._ctx = ctx
        self._vocab = self.llm._model.vocab
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._fingerprint: str | None = None
        self._owner: LlamaCppSession | None = None
        self._cvec: np.ndarray | None = None

    @property
    def computes_row_stats(self) -> bool:
        """With the native helpers, the row's stats come with its copy."""
        return self.monitor is not None

    def instrument(self, activations: bool, row_stats: bool) -> None:
        self.monitor_activations(activations)
        self.guard_row_stats(row_stats)

    def guard_row_stats(self, enabled: bool = True) -> None:
        """Compute the guard's row statistics while copying each logits row (native helper)."""
        if self.monitor is not None:
            self.monitor.enabled_stats = enabled

    def monitor_activations(self, enabled: bool = True) -> None:
        """Record per-layer max |hidden| on every decode (needs the monitor built at load)."""
        if self.monitor is None:
            return
        self.monitor.enabled = enabled
        self.activation_peaks = torch.from_numpy(self.monitor.peaks) if enabled else None
        self.activation_rest_peaks = torch.from_numpy(self.monitor.rest_peaks) if enabled else None

    # -- control vector (fault injection through the real kernels) ---------------------------
    def set_control_vector(self, layer: int, channel: int, value: float) -> None:
        """Add `value` to hidden channel `channel` at the output of decoder layer `layer` (1..n-1)."""
        if not 1 <= layer < self.n_layer:
            raise ModelError(f"control vectors apply to layers 1..{self.n_layer - 1}, not {layer}")
        if not 0 <= channel < self.n_embd:
            raise ModelError(f"channel {channel} out of range 0..{self.n_embd - 1}")
        data = np.zeros((self.n_layer - 1) * self.n_embd, dtype=np.float32)  # layers 1..n-1
        data[(layer - 1) * self.n_embd + channel] = value
        self._cvec = data  # keep the buffer alive while llama.cpp may read it
        ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = self._lib.llama_set_adapter_cvec(self._ctx, ptr, data.size, self.n_embd, layer, layer)
        if rc != 0:
            raise EngineError(f"llama_set_adapter_cvec returned {rc}")

    def clear_control_vector(self) -> None:
        self._lib.llama_set_adapter_cvec(self._ctx, None, 0, self.n_embd, 0, 0)
        self._cvec = None

    # -- sessions ----------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[int]) -> LlamaCppSession:
        if self._owner is not None:
            self._owner.close()
        session = LlamaCppSession(self)
        self._owner = session
        session._prefill(list(prompt_ids))
        return session

    def close(self) -> None:
        if self._owner is not None:
            self._owner.close()
        if self.monitor is not None and self._own_ctx is not None:
            self._lib.llama_free(self._own_ctx)
            self._own_ctx = None
        self.llm.close()


class LlamaCppSession(TokenIdsMixin):
    """The engine's single sequence (seq 0). Opening another session closes this one."""

    def __init__(self, engine: LlamaCppEngine):
        self._e = engine
        self._ids: list[int] = []
        self._fresh = False  # whether the context's last logits row belongs to our last token
        self._closed = False
        self._row = np.empty(engine.n_vocab, dtype=np.float32)
        self._row_t = torch.from_numpy(self._row)
        self._stats = np.zeros(3, dtype=np.float64)
        self._stats_valid = False
        engine._lib.llama_memory_clear(engine._memory, True)

    def _check(self) -> None:
        if self._closed or self._e._owner is not self:
            raise EngineError("llama.cpp session is closed")

    def _decode(self, ids: list[int]) -> None:
        """Append ids at the current position, in n_batch chunks; logits for the last one only."""
        self._check()
        e = self._e
        if len(self._ids) + len(ids) > e.n_ctx:
            raise EngineError(f"context full ({e.n_ctx} tokens)")
        batch = e.llm._batch
        monitor = e.monitor if e.monitor is not None and e.monitor.enabled else None
        if monitor is not None:
            monitor.reset()  # peaks cover this call's positions only
        for i in range(0, len(ids), e.llm.n_batch):
            chunk = ids[i : i + e.llm.n_batch]
            if monitor is not None:
                monitor.begin_batch(len(chunk), starts_at_zero=not self._ids)
            batch.set_batch(batch=chunk, n_past=len(self._ids), logits_all=False)
            rc = e._lib.llama_decode(e._ctx, batch.batch)
            if rc != 0:
                self._fresh = False
                raise EngineError(f"llama_decode returned {rc}")
            self._ids.extend(chunk)
        self._fresh = True

    def _prefill(self, ids: list[int]) -> None:
        check_prompt_fits(len(ids), self._e.n_ctx)
        self._decode(ids)

    def logits(self) -> torch.Tensor:
        self._check()
        if not self._fresh:
            # After a rollback: drop the last token's KV and decode it again, alone.
            last = self._ids.pop()
            self._e._lib.llama_memory_seq_rm(self._e._memory, 0, len(self._ids), -1)
            self._decode([last])
        ptr = self._e._lib.llama_get_logits_ith(self._e._ctx, -1)
        # Copied into one buffer per session: a fresh 192 KB array per step would be a fresh mmap,
        # page faults and a cold cache for the guard's reductions. Valid until the next call.
        if self._e.monitor is not None and self._e.monitor.enabled_stats:
            # The guard's sum/max/min computed in the same pass as the copy (native helper).
            self._e.monitor.copy_stats(ptr, self._row.ctypes.data, self._e.n_vocab, self._stats.ctypes.data)
            self._stats_valid = True
        else:
            np.copyto(self._row, np.ctypeslib.as_array(ptr, shape=(self._e.n_vocab,)))
            self._stats_valid = False
        return self._row_t  # (V,) float32

    def output(self) -> StepOutput:
        row = self.logits()
        e = self._e
        peaks = e.activation_peaks
        return StepOutput(row, self.row_stats(), peaks, e.activation_rest_peaks if peaks is not None else None,
                          e.activation_limit if peaks is not None else None)

    def row_stats(self) -> tuple[float, float, float] | None:
        """(sum, max, min) of the row the last `logits()` returned, when computed with it."""
        if not self._stats_valid:
            return None
        s = self._stats
        return float(s[0]), float(s[1]), float(s[2])

    def push(self, token_id: int) -> None:
        self._decode([int(token_id)])

    def extend(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            self._decode([int(t) for t in token_ids])

    def rollback(self, n: int) -> None:
        self._check()
        self._check_rollback(n)
        if n == 0:
            return
        keep = len(self._ids) - n
        if not self._e._lib.llama_memory_seq_rm(self._e._memory, 0, keep, -1):
            raise EngineError("llama_memory_seq_rm failed")
        del self._ids[keep:]
        self._fresh = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._e._owner is self:
                self._e._lib.llama_memory_seq_rm(self._e._memory, 0, 0, -1)
                self._e._owner = None


class LlamaVocab(LlamaVocabMixin):
    """The GGUF's tokenizer alone (llama.cpp `vocab_only`, no weights, ~0.1 s to load): what a
    gateway tokenizes with, so that no thread but an engine's owner ever touches an engine."""

    def __init__(self, info: ModelInfo):
        import llama_cpp

        self._lib = llama_cpp
        try:
            self.llm = llama_cpp.Llama(model_path=str(info.path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(f"llama.cpp cannot load the vocabulary of {info.path}: {exc}") from exc
        self.info = info
        self.n_vocab = int(self.llm.n_vocab())
        self.eos_ids = frozenset({info.eos_id})
        self._vocab = self.llm._model.vocab
        self._fingerprint = None

    def close(self) -> None:
        self._freed = True
        self.llm.close()
