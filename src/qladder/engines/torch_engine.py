"""PyTorch rungs: transformers' Llama on the GGUF's weights, dequantized, at a chosen compute dtype.

- `fp32`: the full-precision shadow.
- `w4a16`: the same Q4_1-derived weights with FP16 activations and compute, the numerics of GPU
  INT4 (W4A16) kernels. The weights are the exact Q4_1 dequantization (d * q + m) held in fp16, so
  every matmul, residual add and norm runs in fp16: this is where FP16 overflow is real (SmolLM2's
  residual stream carries ~24,900 on channel 507 at layers 11-12, 38% of fp16's 65,504).
- `bf16`: optional.

transformers dequantizes a GGUF in ~13 s here; the result is cached on disk as fp32 safetensors
(keyed by the file's name, size and mtime), so later starts take well under a second.

Per-layer activation peaks (max |hidden| after each decoder layer) can be monitored: forward hooks
write into a preallocated tensor, read by the ladder with the step's single sync, never `.item()`
per layer.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from qladder.engines.base import StepOutput, TokenIdsMixin, byte_level_table, tokenizer_fingerprint
from qladder.errors import EngineError, InputError, ModelError, check_prompt_fits
from qladder.model import ModelInfo

DTYPES = {"fp32": torch.float32, "w4a16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = {
    "fp32": "Q4_1 weights dequantized, fp32 activations and compute (PyTorch)",
    "w4a16": "Q4_1 weights, fp16 activations and compute (PyTorch, GPU W4A16 numerics)",
    "bf16": "Q4_1 weights dequantized, bf16 activations and compute (PyTorch)",
}


def fp32_checkpoint(info: ModelInfo, cache_dir: Path) -> Path:
    """Folder with config, fp32 safetensors and tokenizer of this GGUF, dequantized once (one
    process at a time: others starting together wait on a file lock, then read its result)."""
    from filelock import FileLock

    target = cache_dir / "torch" / f"{info.cache_key}-{_converter()}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f"{target.name}.lock"):
        if not _complete(target):
            _dequantize(info, target)
    return target


CHECKPOINT_FORMAT = 1  # raised when _dequantize writes something else: older folders are not read


def _converter() -> str:
    """What wrote the checkpoint: its format and transformers' version (a newer converter may
    dequantize or save differently)."""
    from importlib.metadata import version

    return f"f{CHECKPOINT_FORMAT}-tf{version('transformers')}"


def _complete(target: Path) -> bool:
    return (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()


def _dequantize(info: ModelInfo, target: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    try:
        model = LlamaForCausalLM.from_pretrained(
            str(info.path.parent), gguf_file=info.path.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
    except Exception as exc:
        raise ModelError(f"transformers cannot load {info.path}: {type(exc).__name__}: {exc}") from exc
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized. (transformers
    # types these two attributes as Module attributes: setattr says what is meant.)
    setattr(model, "hf_quantizer", None)  # noqa: B010
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # an incomplete one (under the lock: no one reads it)
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written cache is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def input_major(model: torch.nn.Module) -> None:
    """Store every Linear's weight input-major: the (out, in) parameter becomes a transposed view
    of an (in, out) contiguous tensor (no copy kept: the old storage is freed; a tied weight stays
    tied). F.linear then multiplies by a contiguous (in, out) matrix, which MKL runs on its fast
    path for a few rows at once: measured here on one thread, the (49,152 x 576) LM head takes
    44 ms for 8 rows row-major and 21 ms input-major (1 row: 11 and 10 ms), and an 8-token
    verification window of the whole model 151 -> 118 ms. Every forward, transformers' and
    BatchedTorch's, uses these same parameters, so both compute the same numbers."""
    relaid: dict[int, torch.nn.Parameter] = {}
    for kind in (torch.nn.Linear, torch.nn.Embedding):  # an embedding tied to the LM head follows it
        for mod in model.modules():
            if isinstance(mod, kind):
                w = mod.weight
                if w.data_ptr() not in relaid and kind is torch.nn.Linear:
                    relaid[w.data_ptr()] = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
                if w.data_ptr() in relaid:
                    mod.weight = relaid[w.data_ptr()]


class TorchEngine:
    """A torch rung. One thread by default (see config.Settings)."""

    monitor_is_cheap = True  # forward hooks writing into a preallocated tensor
    computes_row_stats = False  # torch reduces the row fast enough: the guard does it

    def __init__(self, info: ModelInfo, rung: str, cache_dir: Path, n_ctx: int = 2048, n_threads: int = 1):
        if rung not in DTYPES:
            raise ModelError(f"unknown torch rung {rung!r}")
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.set_num_threads(n_threads)
        ckpt = fp32_checkpoint(info, cache_dir)
        self.name = rung
        self.precision = PRECISIONS[rung]
        self.dtype = DTYPES[rung]
        self.info = info
        self.n_ctx = n_ctx
        self.model = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=self.dtype)
        self.model.train(False)  # eval mode (transformers leaves its eval() untyped)
        input_major(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        self.n_vocab = int(self.model.config.vocab_size)
        self.n_layer = int(self.model.config.num_hidden_layers)
        self.eos_ids = frozenset({info.eos_id})
        self._fingerprint: str | None = None
        self._pieces: list[bytes] | None = None
        # Activation monitor: per-layer max |hidden| of the last forward, preallocated.
        self.activation_peaks = torch.zeros(self.n_layer, dtype=torch.float32)
        self.activation_rest_peaks = torch.zeros(self.n_layer, dtype=torch.float32)
        self._pos0_in_batch = False  # set by a session around each forward
        self.activation_limit = float(torch.finfo(self.dtype).max)
        self._monitor_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._fault_handles: list[torch.utils.hooks.RemovableHandle] = []

    # -- tokenizer ---------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            t = self.tokenizer
            pieces = t.convert_ids_to_tokens(list(range(self.n_vocab)))
            self._fingerprint = tokenizer_fingerprint(
                pieces, {"bos": self.info.bos_id, "eos": self.info.eos_id}
            )
        return self._fingerprint

    def tokenize(self, text: str, special: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"text is not valid Unicode (lone surrogate at {exc.start}); sanitize it first") from exc
        if special:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        # Plain text: special-token strings typed by a user stay plain text.
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes:
        """Byte-level BPE pieces mapped back to their bytes (special tokens left out), as
        llama.cpp's detokenize gives them: a piece may end inside a character."""
        if self._pieces is None:
            table = byte_level_table()
            special = set(self.tokenizer.all_special_ids)
            toks = self.tokenizer.convert_ids_to_tokens(list(range(self.n_vocab)))
            self._pieces = [b"" if i in special else
                            bytes(table[c] for c in t) if all(c in table for c in t) else t.encode("utf-8")
                            for i, t in enumerate(toks)]
        pieces = self._pieces
        return b"".join(pieces[t] for t in token_ids)

    # -- monitors and faults (hooks on decoder layers) ---------------------------------------
    def instrument(self, activations: bool, row_stats: bool) -> None:
        """Row statistics are the guard's own reductions here (torch is fast at them)."""
        self.monitor_activations(activations)

    @property
    def monitored(self) -> bool:
        return bool(self._monitor_handles)

    def monitor_activations(self, enabled: bool = True) -> None:
        """Record, after every decoder layer of each forward, max |hidden| over the batch into
        `activation_peaks` and the same without position 0 (the attention sink's massive
        activation, which is normal) into `activation_rest_peaks`."""
        if enabled == bool(self._monitor_handles):
            return
        for h in self._monitor_handles:
            h.remove()
        self._monitor_handles = []
        if not enabled:
            return
        peaks, rest = self.activation_peaks, self.activation_rest_peaks
        for i, layer in enumerate(self.model.model.layers):

            def hook(_m: torch.nn.Module, _a: object, out: torch.Tensor | tuple[torch.Tensor, ...],
                     i: int = i) -> None:
                h = (out[0] if isinstance(out, tuple) else out).detach()  # (B, T, D)
                a = h.abs()
                # tensor ops into preallocated buffers: no host sync here
                if self._pos0_in_batch and a.shape[1] > 1:
                    rest[i].copy_(a[:, 1:].amax())
                    peaks[i].copy_(torch.maximum(rest[i], a[:, 0].amax()))
                elif self._pos0_in_batch:
                    rest[i].zero_()
                    peaks[i].copy_(a.amax())
                else:
                    peaks[i].copy_(a.amax())
                    rest[i].copy_(peaks[i])

            self._monitor_handles.append(layer.register_forward_hook(hook))

    def add_layer_fault(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Transform a decoder layer's output hidden states (B, T, D) on every forward."""
        if not 0 <= layer < self.n_layer:
            raise ModelError(f"layer {layer} out of range 0..{self.n_layer - 1}")

        def hook(_m: torch.nn.Module, _a: object, out: torch.Tensor | tuple[torch.Tensor, ...]) -> object:
            if isinstance(out, tuple):
                return (fn(out[0]), *out[1:])
            return fn(out)

        self._fault_handles.append(self.model.model.layers[layer].register_forward_hook(hook))
        if self._monitor_handles:  # re-register so the monitor runs after the fault
            self.monitor_activations(False)
            self.monitor_activations(True)

    def clear_faults(self) -> None:
        for h in self._fault_handles:
            h.remove()
        self._fault_handles = []

    # -- sessions ----------------------------------------------------------------------------
    def rows(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> torch.Tensor:
        """The logits rows that predict each answer token ((n, V), fp32), given the prompt and the
        answer before it, in one teacher-forced forward (no session, no cache, no hooks' faults)."""
        ids = [*prompt_ids, *answer_ids]
        if len(ids) > self.n_ctx:
            raise InputError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        rows: torch.Tensor = logits[len(prompt_ids) - 1 : len(ids) - 1]
        return rows

    def score(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> list[float]:
        """Log-probability of each answer token given the prompt and the answer before it (for
        judging answers): `rows`, log-softmaxed."""
        if not answer_ids:
            return []
        logp = torch.log_softmax(self.rows(prompt_ids, answer_ids), dim=-1)
        return logp.gather(1, torch.tensor(list(answer_ids)).unsqueeze(1)).squeeze(1).tolist()

    def open(self, prompt_ids: Sequence[int]) -> TorchSession:
        return TorchSession(self, prompt_ids)

    def close(self) -> None:
        self.monitor_activations(False)
        self.clear_faults()


class TorchSession(TokenIdsMixin):
    """A sequence on a torch rung, with a DynamicCache that rollback truly crops."""

    def __init__(self, engine: TorchEngine, prompt_ids: Sequence[int]):
        from transformers import DynamicCache

        check_prompt_fits(len(prompt_ids), engine.n_ctx)
        self._engine = engine
        self._cache: DynamicCache | None = DynamicCache(config=engine.model.config)
        self._ids: list[int] = []
        self._logits: torch.Tensor | None = None
        self._forward(list(prompt_ids))

    def _forward(self, ids: list[int]) -> None:
        if self._cache is None:
            raise EngineError("session is closed")
        if len(self._ids) + len(ids) > self._engine.n_ctx:
            raise EngineError(f"context full ({self._engine.n_ctx} tokens)")
        x = torch.tensor([ids], dtype=torch.long)  # (1, T)
        self._engine._pos0_in_batch = not self._ids
        try:
            with torch.inference_mode():
                out = self._engine.model(
                    input_ids=x, cache=self._cache, use_cache=True, logits_to_keep=1
                )
        except Exception as exc:
            raise EngineError(f"{self._engine.name} forward failed: {type(exc).__name__}: {exc}") from exc
        self._ids.extend(ids)
        self._logits = out.logits[0, -1].float()  # (V,)

    def logits(self) -> torch.Tensor:
        if self._cache is None:
            raise EngineError("session is closed")
        if self._logits is None:
            # After a rollback: re-decode the last token alone, exactly as it was first decoded.
            last = self._ids.pop()
            assert self._cache is not None
            self._cache.crop(-1)
            self._forward([last])
        assert self._logits is not None
        return self._logits

    def output(self) -> StepOutput:
        row = self.logits()
        e = self._engine
        if not e.monitored:
            return StepOutput(row)
        return StepOutput(row, None, e.activation_peaks, e.activation_rest_peaks, e.activation_limit)

    def push(self, token_id: int) -> None:
        # After a rollback the KV cache is already right for every kept id; only the logits of
        # the last position are unknown, and pushing makes them irrelevant.
        self._forward([int(token_id)])

    def extend(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            self._forward([int(t) for t in token_ids])

    def rollback(self, n: int) -> None:
        self._check_rollback(n)
        if n == 0 or self._cache is None:
            return
        self._cache.crop(-n)
        del self._ids[-n:]
        self._logits = None

    def close(self) -> None:
        self._cache = None
        self._logits = None
