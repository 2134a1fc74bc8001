"""Fault models for testing and validation. A fault hits the first rung only.

Spec strings (CLI `--fault`):

    nan@step=K      the logits row becomes all-NaN from step K on (an FP16 overflow that reached
                    the softmax: the story's `NaN NaN NaN`)
    inf@step=K      +Inf in the row from step K on (an overflowed GEMM output)
    zero@step=K     an all-zero, finite row from step K on (llama.cpp's RMSNorm overflow in FP32:
                    greedy then picks token 0; a NaN check alone misses it)
    error@step=K    the step raises, like a kernel error or a device fault
    stall@step=K[,s=S]  the step at K takes S extra seconds (a hung kernel or a preempted device)
    gain@layer=L,channel=C,x=G
                    multiply the hidden state's channel C after decoder layer L by G (torch rungs,
                    through a forward hook; in fp16 this overflows for real). On `int4` it goes
                    through llama.cpp's control vector, which *adds* a vector at `l_out`: the
                    added value is (G - 1) x 24,900, SmolLM2's measured massive activation on
                    layer 11 channel 507, applied at every position. llama.cpp computes in fp32,
                    so this stays finite there: bare, it is silent garbage (",,,," or newlines).

A corrupted quantization scale is not a per-request fault: `corrupt_gguf_scale` writes a copy of
the GGUF with one block's scale multiplied, and an int4 engine loaded on that copy runs llama.cpp's
real kernels on it (layer 11 ffn_down, row 507, x=1000 turns "Paris" into garbage; the guard's
outlier check catches it at prefill).

Glitch tokens are not a per-request fault either: `glitch_gguf` writes a copy of the GGUF whose
input embeddings of the byte-fallback tokens (UTF-8 lead/continuation bytes, C0 controls) are
multiplied by x, the output matrix untied so logits stay as they were; a prompt that contains
one (emoji ZWJ sequences, raw control bytes) then carries an outlier from the first layer on.

Steps count generated tokens: step K is the logits row from which token K would be sampled
(step 0 is the row right after prefill).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qladder.engines.base import Engine, Session, StepOutput, byte_level_table
from qladder.errors import ConfigError, EngineError

MASSIVE_ACTIVATION = 24_900.0  # SmolLM2-135M, layer 11-12, channel 507, FP32, first token
STEP_KINDS = ("nan", "inf", "zero", "error", "stall")
KINDS = (*STEP_KINDS, "gain")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int = 0
    layer: int = 11
    channel: int = 507
    x: float = 1.0
    stall_s: float = 3.0

    def __str__(self) -> str:
        if self.kind == "gain":
            return f"gain@layer={self.layer},channel={self.channel},x={self.x:g}"
        extra = f",s={self.stall_s:g}" if self.kind == "stall" else ""
        return f"{self.kind}@step={self.step}{extra}"


def parse_fault(spec: str) -> Fault:
    """Parse `kind@key=value,...`. Raises ConfigError with the expected shape."""
    kind, _, args = spec.strip().partition("@")
    if kind not in KINDS:
        raise ConfigError(f"unknown fault {kind!r} in {spec!r}; kinds: {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for part in filter(None, args.split(",")):
        key, eq, val = part.partition("=")
        if not eq:
            raise ConfigError(f"malformed fault argument {part!r} in {spec!r} (expected key=value)")
        values[key.strip()] = val.strip()
    try:
        if kind == "gain":
            unknown = set(values) - {"layer", "channel", "x"}
            fault = Fault("gain", layer=int(values.get("layer", 11)), channel=int(values.get("channel", 507)),
                          x=float(values["x"]))
        else:
            unknown = set(values) - {"step", "s"}
            fault = Fault(kind, step=int(values.get("step", 0)), stall_s=float(values.get("s", 3.0)))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"malformed fault {spec!r}: {exc}") from exc
    if unknown:
        raise ConfigError(f"unknown fault arguments {sorted(unknown)} in {spec!r}")
    if fault.step < 0:
        raise ConfigError(f"fault step must be >= 0 in {spec!r}")
    return fault


def fault_row(row: torch.Tensor, faults: Sequence[Fault], step: int) -> torch.Tensor:
    """The row as the step faults active at `step` make it (the same tensor when none applies;
    a copy otherwise). Raises EngineError for an injected kernel error. Stalls are not rows:
    the caller applies them (a sleep, or a hang inside the engine)."""
    for f in faults:
        if step < f.step:
            continue
        if f.kind == "error":
            raise EngineError(f"injected kernel error at step {step}")
        if f.kind == "nan":
            row = torch.full_like(row, float("nan"))
        elif f.kind == "inf":
            row = row.clone()
            row[row.argmax()] = float("inf")
        elif f.kind == "zero":
            row = torch.zeros_like(row)
    return row


def stall_due(faults: Sequence[Fault], step: int, stalled: set[int]) -> float | None:
    """Seconds a stall fault hangs `step` (once: the step is added to `stalled`), else None."""
    for f in faults:
        if f.kind == "stall" and f.step == step and step not in stalled:
            stalled.add(step)
            return f.stall_s
    return None


class FaultySession:
    """Wraps a session and corrupts its steps from `fault.step` on. Implements Session."""

    def __init__(self, inner: Session, faults: Sequence[Fault], prompt_len: int,
                 sleep: Callable[[float], None] = time.sleep):
        self._inner = inner
        self._faults = [f for f in faults if f.kind in STEP_KINDS]
        self._prompt_len = prompt_len
        self._sleep = sleep
        self._stalled: set[int] = set()

    @property
    def n_tokens(self) -> int:
        return self._inner.n_tokens

    @property
    def token_ids(self) -> list[int]:
        return self._inner.token_ids

    def logits(self) -> torch.Tensor:
        return self.output().row

    def output(self) -> StepOutput:
        out = self._inner.output()
        step = self._inner.n_tokens - self._prompt_len
        stall = stall_due(self._faults, step, self._stalled)
        if stall is not None:
            self._sleep(stall)
        row = fault_row(out.row, self._faults, step)
        return out if row is out.row else dataclasses.replace(out, row=row, stats=None)

    def push(self, token_id: int) -> None:
        self._inner.push(token_id)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._inner.extend(token_ids)

    def rollback(self, n: int) -> None:
        self._inner.rollback(n)

    def close(self) -> None:
        self._inner.close()


@contextmanager
def engine_faults(engine: Engine, faults: Sequence[Fault]) -> Iterator[None]:
    """Install activation faults (gain) on an engine for one request, and remove them after."""
    gains = [f for f in faults if f.kind == "gain"]
    if not gains:
        yield
        return
    if hasattr(engine, "add_layer_fault"):
        for f in gains:
            engine.add_layer_fault(f.layer, _gain_fn(f.channel, f.x))
        try:
            yield
        finally:
            engine.clear_faults()
    elif hasattr(engine, "set_control_vector"):
        if len(gains) > 1:
            raise ConfigError("the int4 rung takes one gain fault at a time (one control vector)")
        f = gains[0]
        engine.set_control_vector(f.layer, f.channel, (f.x - 1.0) * MASSIVE_ACTIVATION)
        try:
            yield
        finally:
            engine.clear_control_vector()
    else:
        raise ConfigError(f"rung {engine.name} cannot take activation faults")


def _gain_fn(channel: int, x: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def apply(h: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        h = h.clone()
        h[..., channel] = h[..., channel] * x
        return h

    return apply


# -- a corrupted quantization scale, through the real int4 kernels ---------------------------------

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # each block starts with its fp16 scale d


def corrupt_gguf_scale(src: Path, dst: Path, tensor: str = "blk.11.ffn_down.weight", row: int = 507,
                       block: int = 0, x: float = 1000.0, value: float | None = None) -> dict[str, float | int | str]:
    """Write a copy of a GGUF whose one quantization block has its scale `d` multiplied by x.

    Emulates a corrupted scale in one layer (a bit flip in memory or a bad conversion): the 32
    weights of that block, in output row `row`, become x times too large, so that row's output
    channel carries an outlier at every position. The file is patched in place of one fp16; llama.cpp
    then runs its real kernels on it. `value` writes that scale instead (inf: the block's outputs
    become inf, the row NaN, and llama-server answers "......" with null logprobs). Returns what
    was changed.
    """
    import shutil

    import numpy as np
    from gguf import GGUFReader

    info = {t.name: t for t in GGUFReader(str(src)).tensors}
    if tensor not in info:
        raise ConfigError(f"no tensor {tensor!r} in {src}")
    t = info[tensor]
    size = _BLOCK_BYTES.get(t.tensor_type.name)
    if size is None:
        raise ConfigError(f"{tensor} is {t.tensor_type.name}; scale corruption supports {sorted(_BLOCK_BYTES)}")
    rows, row_bytes = t.data.shape
    if not (0 <= row < rows and 0 <= block < row_bytes // size):
        raise ConfigError(f"row {row} / block {block} out of range for {tensor} ({rows} rows)")
    offset = int(t.data_offset) + row * row_bytes + block * size
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        d = float(np.frombuffer(f.read(2), dtype=np.float16)[0])
        new = float(np.clip(d * x, -65504.0, 65504.0)) if value is None else float(value)
        f.seek(offset)
        f.write(np.float16(new).tobytes())
    return {"tensor": tensor, "row": row, "block": block, "offset": offset, "d": d, "new_d": new}


# -- glitch tokens: scaled input embeddings of rare byte tokens, through the real int4 kernels -----


def byte_fallback_tokens(pieces: Sequence[str]) -> list[int]:
    """Ids of single-byte tokens for bytes that ordinary text never produces alone: UTF-8 lead and
    continuation bytes (>= 0x80, left over when rare Unicode such as emoji ZWJ sequences has no
    merge) and C0 controls other than tab, newline and carriage return. These are the
    under-trained tokens of byte-level vocabularies."""
    from qladder.engines.llamacpp import RARE_BYTES

    table = byte_level_table()
    return [i for i, p in enumerate(pieces) if p in table and table[p] in RARE_BYTES]


def glitch_gguf(src: Path, dst: Path, x: float = 1000.0, tokens: Sequence[int] | None = None
                ) -> dict[str, object]:
    """Write a copy of a GGUF whose input embeddings of `tokens` (default: the byte-fallback tokens)
    are multiplied by x: a prompt-triggered outlier, as under-trained tokens cause.

    When the model ties its output to `token_embd` (SmolLM2 does), the copy first unties them:
    `output.weight` becomes the original embedding matrix and only the input side is scaled
    (llama.cpp uses `output.weight` when a file has one). Each scaled row has every block's fp16 scale `d`
    multiplied by x (Q8_0/Q4_0/Q4_1: value = d * q [+ m]; for Q4_1 the min m is scaled too).
    Returns what was changed, with the largest |value| of a scaled row.
    """
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(str(src))
    by_name = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in by_name
    emb = by_name.get("token_embd.weight")
    if emb is None:
        raise ConfigError(f"no token_embd.weight in {src}")
    kind = emb.tensor_type.name
    size = _BLOCK_BYTES.get(kind)
    if size is None:
        raise ConfigError(f"token_embd.weight is {kind}; glitch_gguf supports {sorted(_BLOCK_BYTES)}")
    if tokens is None:
        tokens = byte_fallback_tokens(reader.fields["tokenizer.ggml.tokens"].contents())
    rows = np.asarray(sorted(set(tokens)), dtype=np.int64)
    if rows.size == 0 or rows.min() < 0 or rows.max() >= emb.data.shape[0]:
        raise ConfigError(f"glitch token ids out of range (vocabulary of {emb.data.shape[0]})")

    writer = _writer_with_fields(reader, dst)
    patched = np.array(emb.data, copy=True)
    blocks = patched.reshape(patched.shape[0], -1, size)
    n_scales = 2 if kind == "Q4_1" else 1  # Q4_1 blocks carry d then m
    for r in rows:
        s = blocks[r, :, : 2 * n_scales].copy().view(np.float16)
        blocks[r, :, : 2 * n_scales] = np.clip(s.astype(np.float32) * x, -65504, 65504).astype(
            np.float16).view(np.uint8)
    for t in reader.tensors:
        data = patched if t.name == "token_embd.weight" else t.data
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)  # quantized: shape in bytes
    if tied:
        writer.add_tensor("output.weight", emb.data, raw_dtype=emb.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    peak = float(np.abs(_dequantize_rows(patched, kind, rows)).max())
    return {"tensor": "token_embd.weight", "tokens": len(rows), "x": x, "max_abs_scaled": peak,
            "untied_output": tied}


def _writer_with_fields(reader: Any, dst: Path, replace: dict[str, object] | None = None) -> Any:
    """A GGUFWriter for `dst` holding the reader's metadata (with `replace`d values), no tensors yet."""
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header fields, and the one the writer adds itself
        value = (replace or {}).get(name, f.contents())
        if f.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, f.types[0], sub_type=f.types[-1])
        else:
            writer.add_key_value(name, value, f.types[0])
    return writer


def swapped_vocab_gguf(src: Path, dst: Path, a: int, b: int) -> dict[str, object]:
    """A copy of a GGUF whose vocabulary has tokens `a` and `b` swapped (their strings trade ids):
    a server on it tokenizes some text differently from the original, and a handoff by ids
    between the two would change the text. For the tokenizer check at a remote rung's start."""
    from gguf import GGUFReader

    reader = GGUFReader(str(src))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    tokens[a], tokens[b] = tokens[b], tokens[a]
    writer = _writer_with_fields(reader, dst, {"tokenizer.ggml.tokens": tokens})
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"swapped": [a, b], "strings": [tokens[b], tokens[a]]}


def _dequantize_rows(data: object, kind: str, rows: object) -> object:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.asarray(data)[np.asarray(rows)], GGMLQuantizationType[kind])


def inf_scale_gguf(src: Path, dst: Path, tensor: str = "blk.11.ffn_down.weight", row: int = 507,
                   block: int = 0) -> dict[str, float | int | str]:
    """A copy of a GGUF with one Q4_1 block scale set to +inf (`corrupt_gguf_scale(value=inf)`)."""
    return corrupt_gguf_scale(src, dst, tensor, row, block, value=float("inf"))


GGUF_PATCHES: dict[str, Callable[..., dict[str, object]]] = {
    "scale": corrupt_gguf_scale,  # type: ignore[dict-item]
    "inf_scale": inf_scale_gguf,  # type: ignore[dict-item]
    "glitch": glitch_gguf,
}
