"""The `int4` rung for many requests at once: one llama.cpp context, one sequence (slot) a request.

One `llama_decode` carries a token of every decoding sequence plus prefill chunks of new ones
(llama-server's slots, vLLM's continuous batching). Each batch token carries its slot as its
`seq_id` and its own position; only the last token of each entry asks for logits. A slot is
truncated with `llama_memory_seq_rm(mem, slot, p0, -1)`, for a rollback or when its request ends.

Per row of a batch, the native helpers (`native/act_monitor.c`) give the guard that sequence's
own numbers and never another's:
    row stats   sum / max / min of the logits row, fused into its copy, and the row's argmax
    peaks       per-layer max |hidden| of the slot's positions (and away from its position 0),
                recorded by the C eval callback, which knows the slot of every batch row
    gain faults a value added to one channel of one layer's output, for one slot's rows only
    stalls      an injected hang inside llama_decode, ended by the context's abort callback

KV layout (measured here, 1 thread, greedy, 8 prompts x 32 tokens): with one KV stream per slot
(`kv_unified=False`, the default) a sequence decoded in a batch gives bit-identical logits to the
same sequence alone, also after other slots were freed. With one unified buffer, a slot freed
mid-batch leaves holes that later tokens of other sequences fill, their attention then sums its
cells in another order, and 3 of 7 answers diverged within 32 tokens; two prompts prefilled in
the same decode diverged too. Per-slot streams are also a little faster here (B=8: 130 vs 125
tok/s). llama.cpp splits a per-slot-stream batch into ubatches with equal tokens per sequence, in
slot order: so a batch is either single tokens of several slots (sorted by slot, one ubatch) or
one prefill chunk alone, and the per-row monitor knows the slot of every row.

Thread ownership: one thread (the scheduler's) makes every call on an instance, except `abort()`,
which a watchdog may call from another thread (it only raises a flag the C callback polls).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qladder.engines.llamacpp import LlamaVocabMixin
from qladder.engines.monitor import load_native
from qladder.errors import EngineError, ModelError
from qladder.model import ModelInfo

_i32 = ctypes.POINTER(ctypes.c_int32)
_f32 = ctypes.POINTER(ctypes.c_float)


class _BatchState(ctypes.Structure):
    _fields_ = [("enabled", ctypes.c_int32), ("n_layer", ctypes.c_int32), ("n_embd", ctypes.c_int32),
                ("n_slots", ctypes.c_int32), ("n_tokens", ctypes.c_int32), ("n_outputs", ctypes.c_int32),
                ("tok_slot", _i32), ("tok_pos0", _i32), ("out_slot", _i32),
                ("peaks", _f32), ("rest_peaks", _f32),
                ("gain_layer", _i32), ("gain_channel", _i32), ("gain_add", _f32),
                ("any_gain", ctypes.c_int32), ("abort_flag", ctypes.c_int32), ("stall_ms", ctypes.c_int32),
                ("_pad", ctypes.c_int32)]


@dataclass(frozen=True)
class Entry:
    """One slot's tokens in a batch: `ids` at positions start_pos.. of that sequence."""

    slot: int
    ids: Sequence[int]
    start_pos: int
    logits: bool = True  # whether the last id's logits row is wanted
    # A monitored decode starts the slot's peaks afresh unless this is set: the next chunk of a
    # prompt prefilled in chunks adds its positions to the earlier chunks' peaks.
    carry_peaks: bool = False


def _ptr(a: np.ndarray, kind: type) -> object:
    return a.ctypes.data_as(ctypes.POINTER(kind))


class BatchedLlamaCpp(LlamaVocabMixin):
    """n_slots sequences on one context; every slot may hold up to n_ctx tokens."""

    name = "int4"

    def __init__(self, info: ModelInfo, n_slots: int = 8, n_ctx: int = 2048, n_threads: int = 1,
                 n_batch: int = 512, native_dir: Path | None = None, kv_unified: bool = False):
        import llama_cpp

        if n_slots < 1:
            raise ModelError(f"n_slots must be >= 1, got {n_slots}")
        self._lib = llama_cpp
        try:  # the model and its vocabulary; a tiny context of its own, unused
            self.llm = llama_cpp.Llama(model_path=str(info.path), n_ctx=32, n_batch=32, n_threads=n_threads,
                                       n_threads_batch=n_threads, logits_all=False, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(f"llama.cpp cannot load {info.path}: {exc}") from exc
        self.info = info
        ftype = {2: "Q4_0", 3: "Q4_1"}.get(info.file_type, f"file type {info.file_type}")
        self.precision = f"{ftype} weights, llama.cpp CPU kernels (fp32 activations), {n_slots} slots"
        self.n_slots, self.n_ctx, self.n_batch, self.n_threads = n_slots, n_ctx, n_batch, n_threads
        self.n_vocab = int(self.llm.n_vocab())
        self.n_layer, self.n_embd = info.n_layer, info.n_embd
        self.eos_ids = frozenset({info.eos_id})
        self._vocab = self.llm._model.vocab
        self._fingerprint: str | None = None
        self.activation_limit = float(torch.finfo(torch.float16).max)  # see LlamaCppEngine
        self.native_error: str | None = None
        self._native = None
        if native_dir is not None:
            try:
                self._native = load_native(native_dir)
            except EngineError as exc:  # no compiler: unmonitored, plain copies, stalls not injectable
                self.native_error = str(exc)
        self._alloc(n_slots + 1, n_batch)  # the slots and the prefix cache stream
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = (n_slots + 1) * n_ctx  # one more stream: the shared prefix cache
        self.kv_unified = kv_unified
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_slots + 1
        params.kv_unified = kv_unified
        params.n_threads = params.n_threads_batch = n_threads
        # Pinned to what llama.cpp's default (auto) picks on the CPU, and to what LlamaCppEngine
        # uses: the same kernels, the same rows (tests/test_batched_contract.py).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if self._native is not None:
            params.cb_eval = ctypes.cast(self._native.qladder_batch_monitor_cb,
                                         llama_cpp.ggml_backend_sched_eval_callback)
            params.cb_eval_user_data = ctypes.cast(ctypes.pointer(self._state), ctypes.c_void_p)
        self._ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
        self._threads_now = n_threads
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create a context of {n_slots} x {n_ctx} tokens")
        if self._native is not None:
            self._abort_cb = ctypes.cast(self._native.qladder_abort, llama_cpp.ggml_abort_callback)
            llama_cpp.llama_set_abort_callback(self._ctx, self._abort_cb,
                                               ctypes.cast(ctypes.pointer(self._state), ctypes.c_void_p))
            lib = self._native
            lib.qladder_copy_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            lib.qladder_copy_stats.restype = None
            lib.qladder_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64]
            lib.qladder_argmax.restype = ctypes.c_int64
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.prefix: tuple[int, ...] = ()  # ids whose KV the cache stream holds
        self._cache_slot = n_slots
        self._holds_prefix: set[int] = set()  # slots whose first positions are the prefix's KV
        self.prefix_copies = 0

    def _alloc(self, n_slots: int, n_batch: int) -> None:
        """Batch arrays and per-slot outputs, allocated once; the C side points into them."""
        self._tok = np.zeros(n_batch, np.int32)
        self._pos = np.zeros(n_batch, np.int32)
        self._nseq = np.ones(n_batch, np.int32)
        self._seq = np.zeros(n_batch, np.int32)
        self._want = np.zeros(n_batch, np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n_batch)(
            *[ctypes.cast(self._seq.ctypes.data + 4 * i, _i32) for i in range(n_batch)])
        self._batch = self._lib.llama_batch(0, _ptr(self._tok, ctypes.c_int32), None, _ptr(self._pos, ctypes.c_int32),
                                            _ptr(self._nseq, ctypes.c_int32), self._seq_ptrs,
                                            _ptr(self._want, ctypes.c_int8))
        self._rows = np.zeros((n_slots, self.n_vocab), np.float32)  # (S, V): each slot's last row
        self._rows_t = torch.from_numpy(self._rows)
        self._row_views = [self._rows_t[i] for i in range(n_slots)]  # made once: a view costs ~8 us
        self._stats = np.zeros((n_slots, 3), np.float64)
        self._stats_valid = np.zeros(n_slots, bool)
        self._peaks = np.zeros((n_slots, self.n_layer), np.float32)  # (S, L)
        self._rest = np.zeros((n_slots, self.n_layer), np.float32)
        self._tok_pos0 = np.zeros(n_batch, np.int32)
        self._out_slot = np.zeros(n_batch, np.int32)
        self._gain_layer = np.full(n_slots, -1, np.int32)
        self._gain_channel = np.zeros(n_slots, np.int32)
        self._gain_add = np.zeros(n_slots, np.float32)
        self._state = _BatchState(0, self.n_layer, self.n_embd, n_slots, 0, 0,
                                  _ptr(self._seq, ctypes.c_int32), _ptr(self._tok_pos0, ctypes.c_int32),
                                  _ptr(self._out_slot, ctypes.c_int32), _ptr(self._peaks, ctypes.c_float),
                                  _ptr(self._rest, ctypes.c_float), _ptr(self._gain_layer, ctypes.c_int32),
                                  _ptr(self._gain_channel, ctypes.c_int32), _ptr(self._gain_add, ctypes.c_float),
                                  0, 0, 0, 0)

    @property
    def has_native(self) -> bool:
        return self._native is not None

    # -- one step ------------------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        """Threads for the next decodes (a lease of the machine's cores: serving/cores.py)."""
        if n != self._threads_now:
            self._lib.llama_set_n_threads(self._ctx, n, n)
            self._threads_now = n

    def decode(self, entries: Sequence[Entry], monitor: bool = False, row_stats: bool = False) -> None:
        """One llama_decode over every entry (at most n_batch tokens in all). Afterwards each entry
        that wanted logits has its row (`row(slot)`), its stats when `row_stats`, and, when
        `monitor`, its per-layer peaks over this decode's positions. Raises EngineError (the
        entries' new positions are then removed from their slots)."""
        if not self.kv_unified:
            # One stream per slot: llama.cpp splits a batch into ubatches of equal tokens per
            # sequence, in slot order. A batch of single tokens in slot order is one ubatch in
            # that order (the per-row monitor relies on it); a prefill chunk goes alone.
            entries = sorted(entries, key=lambda e: e.slot)
            if len(entries) > 1 and any(len(e.ids) > 1 for e in entries):
                raise ValueError("with per-slot KV streams a prefill chunk is decoded alone")
        n = 0
        outs = 0
        for e in entries:
            k = len(e.ids)
            if k == 0:
                continue
            if n + k > self.n_batch:
                raise ValueError(f"batch of more than {self.n_batch} tokens")
            if e.start_pos + k > self.n_ctx:
                raise EngineError(f"slot {e.slot}: context full ({self.n_ctx} tokens)")
            self._tok[n:n + k] = e.ids
            self._pos[n:n + k] = np.arange(e.start_pos, e.start_pos + k)
            self._seq[n:n + k] = e.slot
            self._want[n:n + k] = 0
            self._tok_pos0[n:n + k] = 0
            if e.start_pos == 0:
                self._tok_pos0[n] = 1
            if e.logits:
                self._want[n + k - 1] = 1
                self._out_slot[outs] = e.slot
                outs += 1
            n += k
        if n == 0:
            return
        self._batch.n_tokens = n
        st = self._state
        st.n_tokens, st.n_outputs = n, outs
        st.enabled = int(monitor and self._native is not None)
        st.any_gain = int(bool((self._gain_layer[[e.slot for e in entries]] >= 0).any()))
        if st.enabled:
            for e in entries:
                if e.carry_peaks:
                    continue
                self._peaks[e.slot] = 0.0
                self._rest[e.slot] = 0.0
        rc = self._lib.llama_decode(self._ctx, self._batch)
        st.stall_ms = 0
        if rc != 0:
            for e in entries:  # llama.cpp removes what it kept on failure; make sure of it
                self._lib.llama_memory_seq_rm(self._memory, e.slot, e.start_pos, -1)
            raise EngineError("llama_decode aborted" if rc == 2 else f"llama_decode returned {rc}")
        self._read_rows(entries, row_stats)

    def _read_rows(self, entries: Sequence[Entry], row_stats: bool) -> None:
        i = -1
        stats = row_stats and self._native is not None
        for e in entries:
            if not e.ids:
                continue
            i += len(e.ids)
            if not e.logits:
                continue
            ptr = self._lib.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise EngineError(f"no logits for batch row {i}")
            s = e.slot
            if stats:
                assert self._native is not None
                self._native.qladder_copy_stats(ptr, self._rows[s].ctypes.data, self.n_vocab,
                                                self._stats[s].ctypes.data)
            else:
                np.copyto(self._rows[s], np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)))
            self._stats_valid[s] = stats

    def row(self, slot: int) -> torch.Tensor:
        """The slot's last logits row, (V,) float32; valid until that slot's next decode."""
        return self._row_views[slot]

    def row_stats(self, slot: int) -> tuple[float, float, float] | None:
        if not self._stats_valid[slot]:
            return None
        s = self._stats[slot]
        return float(s[0]), float(s[1]), float(s[2])

    def argmax(self, slot: int) -> int:
        """The greedy token of the slot's row (first maximum; NaN counts as the maximum)."""
        if self._native is not None:
            return int(self._native.qladder_argmax(self._rows[slot].ctypes.data, self.n_vocab))
        return int(self._row_views[slot].argmax())

    def peaks(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(L,) max |hidden| of the slot's positions in the last monitored decode (and the
        decodes before it that it carried on: `Entry.carry_peaks`), and the same away from its
        position 0."""
        return torch.from_numpy(self._peaks[slot]), torch.from_numpy(self._rest[slot])

    # -- slots -----------------------------------------------------------------------------------
    def truncate(self, slot: int, keep: int) -> None:
        """Keep the slot's first `keep` positions (0: free the slot's KV)."""
        if keep < len(self.prefix):
            self._holds_prefix.discard(slot)
        if not self._lib.llama_memory_seq_rm(self._memory, slot, keep, -1):
            raise EngineError(f"llama_memory_seq_rm failed on slot {slot}")

    def release(self, slot: int) -> None:
        """Free the slot's KV, but keep the cached prefix in it when it holds it: the next prompt
        that starts with the prefix then needs no copy (llama.cpp's server keeps a slot's common
        prefix the same way)."""
        self.truncate(slot, len(self.prefix) if slot in self._holds_prefix else 0)

    def cache_prefix(self, ids: Sequence[int]) -> None:
        """Prefill `ids` (a prefix every prompt shares: the chat template's system turn) once,
        into a stream of its own. It is decoded alone, as any prompt is: a slot that copies it
        and decodes the rest of its prompt gets the rows a full prefill gives (a chunked prefill
        is bit-identical here)."""
        for slot in list(self._holds_prefix):
            self.truncate(slot, 0)
        self.truncate(self._cache_slot, 0)
        self.prefix = ()
        if ids:
            self.decode([Entry(self._cache_slot, list(ids), 0, logits=False)])
            self.prefix = tuple(int(t) for t in ids)

    def copy_prefix(self, slot: int) -> int:
        """Give `slot` the cached prefix's KV, and nothing else: kept from its last request when
        the slot still holds it (`release`), else a copy of the whole cache stream (~n_ctx x 30
        layers of K and V, done at the next decode: a few ms, against ~0.1 s to prefill it).
        Returns the positions the slot now holds."""
        if not self.prefix:
            return 0
        if slot in self._holds_prefix:
            self.truncate(slot, len(self.prefix))
            return len(self.prefix)
        self.truncate(slot, 0)
        self._lib.llama_memory_seq_cp(self._memory, self._cache_slot, slot, -1, -1)
        self._holds_prefix.add(slot)
        self.prefix_copies += 1
        return len(self.prefix)

    def save_state(self, slot: int) -> np.ndarray:
        """The slot's sequence state (its KV cells, every position), as uint8 bytes."""
        n = self._lib.llama_state_seq_get_size(self._ctx, slot)
        out = np.empty(n, np.uint8)
        if self._lib.llama_state_seq_get_data(self._ctx, _ptr(out, ctypes.c_uint8), n, slot) != n:
            raise EngineError(f"llama_state_seq_get_data failed on slot {slot}")
        return out

    def load_state(self, slot: int, state: np.ndarray, keep: int) -> None:
        """Give `slot` a state `save_state` made (of any slot), then keep its first `keep`
        positions. The slot then holds the cached prefix only if the state's first positions were
        it: the caller says so (`holds_prefix`)."""
        self.truncate(slot, 0)
        if self._lib.llama_state_seq_set_data(self._ctx, _ptr(state, ctypes.c_uint8), state.nbytes, slot) == 0:
            self.truncate(slot, 0)
            raise EngineError(f"llama_state_seq_set_data failed on slot {slot}")
        self.truncate(slot, keep)

    def holds_prefix(self, slot: int) -> None:
        """The slot's first positions are the cached prefix's KV (a state restored from a slot that held it)."""
        self._holds_prefix.add(slot)

    def carry_peaks(self, slot: int, peaks: np.ndarray, rest: np.ndarray) -> None:
        """Set the slot's peaks, as a monitored prefill of its earlier positions left them: the
        next monitored decode of an entry with `carry_peaks` adds its positions to them."""
        self._peaks[slot] = peaks
        self._rest[slot] = rest

    def set_gain(self, slot: int, layer: int, channel: int, add: float) -> None:
        """Add `add` to channel `channel` of layer `layer`'s output, on this slot's rows only."""
        if self._native is None:
            raise EngineError(f"per-slot gain faults need the native helpers ({self.native_error})")
        if not 0 <= layer < self.n_layer or not 0 <= channel < self.n_embd:
            raise ModelError(f"gain fault at layer {layer}, channel {channel} is out of range")
        self._gain_layer[slot], self._gain_channel[slot], self._gain_add[slot] = layer, channel, add

    def clear_gain(self, slot: int) -> None:
        self._gain_layer[slot] = -1

    def arm_stall(self, ms: int) -> None:
        """Fault injection: the next decode hangs inside llama.cpp for up to `ms` (or until abort)."""
        if self._native is None:
            raise EngineError(f"injected stalls need the native helpers ({self.native_error})")
        self._state.stall_ms = int(ms)

    def abort(self) -> None:
        """End the decode in flight (any thread): it returns 'aborted' at the next graph node."""
        self._state.abort_flag = 1

    def clear_abort(self) -> None:
        self._state.abort_flag = 0

    def close(self) -> None:
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        self.llm.close()
