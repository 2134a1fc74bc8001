"""Patched copies of a GGUF: faults in the model file itself, run through llama.cpp's real kernels.

A validation tool (and `qladder faults patch-gguf`, the way to test a guard on one's own model);
nothing on the serving path imports it.

    patch_scales   the fp16 scale `d` of chosen quantization blocks (rows x blocks of one tensor)
                   multiplied by x, or set to a value (inf: the block's outputs become inf, the
                   next layer's NaN): a corrupted scale, as a bit flip in memory or a bad
                   conversion makes
    glitch_gguf    the input embeddings of chosen tokens (default: the byte-fallback tokens)
                   multiplied by x, the output matrix untied so the logits stay as they were:
                   under-trained "glitch" tokens, whose abnormal norms put an outlier in the
                   residual stream from the first layer on
    swapped_vocab_gguf   two vocabulary strings trade ids (a tokenizer mismatch, for start-up checks)

Each returns a dict of what it changed (recorded in the validation's results).
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qladder.engines.base import byte_level_table
from qladder.errors import ConfigError

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # each block starts with its fp16 scale d
FP16_MAX = 65504.0

if TYPE_CHECKING:
    import numpy as np


def _read(src: Path) -> Any:
    """gguf's reader of `src` (read-only memory map), parsed once per file: parsing the vocabulary
    takes seconds, and one validation run patches the same GGUF several times."""
    st = src.stat()
    return _reader(str(src.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def parse_index_list(spec: str | Sequence[int] | None, n: int, what: str) -> list[int]:
    """'all', '5', '0-3', '0-3,7,10-12' (or a list of ints) -> sorted indices in [0, n)."""
    if spec is None or spec == "all":
        return list(range(n))
    if not isinstance(spec, str):
        out = sorted({int(i) for i in spec})
    else:
        out_set: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, dash, hi = part.partition("-")
            try:
                a, b = int(lo), int(hi) if dash else int(lo)
            except ValueError as exc:
                raise ConfigError(f"{what}: {part!r} is not an index or a range a-b") from exc
            if b < a:
                raise ConfigError(f"{what}: the range {part!r} runs backwards")
            out_set.update(range(a, b + 1))
        out = sorted(out_set)
    if not out or out[0] < 0 or out[-1] >= n:
        raise ConfigError(f"{what}: {spec!r} is out of range [0, {n})")
    return out


def patch_scales(src: Path, dst: Path, tensor: str, rows: str | Sequence[int] | None = None,
                 blocks: str | Sequence[int] | None = None, x: float | None = None,
                 value: float | None = None) -> dict[str, Any]:
    """Write a copy of a GGUF whose chosen blocks (each of `rows` x each of `blocks` of `tensor`;
    None or 'all': every one) have their fp16 scale `d` multiplied by `x` (clipped to fp16's
    range) or set to `value`. The copy is the original with those bytes changed; llama.cpp then
    runs its real kernels on it."""
    import numpy as np

    if (x is None) == (value is None):
        raise ConfigError("give exactly one of a scale factor (x) or a value")
    info = {t.name: t for t in _read(src).tensors}
    if tensor not in info:
        raise ConfigError(f"no tensor {tensor!r} in {src}")
    t = info[tensor]
    size = _BLOCK_BYTES.get(t.tensor_type.name)
    if size is None:
        raise ConfigError(f"{tensor} is {t.tensor_type.name}; scale patches support {sorted(_BLOCK_BYTES)}")
    n_rows, row_bytes = t.data.shape
    row_ids = parse_index_list(rows, n_rows, f"{tensor} rows")
    block_ids = parse_index_list(blocks, row_bytes // size, f"{tensor} blocks")
    base = int(t.data_offset)
    shutil.copyfile(src, dst)
    mm = np.memmap(dst, dtype=np.uint8, mode="r+", offset=base, shape=(n_rows, row_bytes))
    view = mm.reshape(n_rows, -1, size)[np.ix_(row_ids, block_ids)]  # (rows, blocks, size): a copy
    d = view[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    new = np.clip(d * x, -FP16_MAX, FP16_MAX) if x is not None else np.full_like(d, float(value or 0.0))
    view[..., :2] = new.astype(np.float16)[..., None].view(np.uint8)
    mm.reshape(n_rows, -1, size)[np.ix_(row_ids, block_ids)] = view
    mm.flush()
    del mm
    return {"tensor": tensor, "rows": _ranges(row_ids), "blocks": _ranges(block_ids), "n_blocks": int(d.size),
            "x": x, "value": value, "d_max_abs": float(np.abs(d).max()), "new_d_max_abs": float(np.abs(new).max())}


def _ranges(ids: Sequence[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def corrupt_gguf_scale(src: Path, dst: Path, tensor: str = "blk.11.ffn_down.weight", row: int = 507,
                       block: int = 0, x: float = 1000.0, value: float | None = None) -> dict[str, Any]:
    """One block's scale multiplied by x (or set to `value`): layer 11 ffn_down, row 507, x1000
    turns "Paris" into garbage, and the guard's outlier check catches it at prefill."""
    return patch_scales(src, dst, tensor, [row], [block], None if value is not None else x, value)


def inf_scale_gguf(src: Path, dst: Path, tensor: str = "blk.11.ffn_down.weight", row: int = 507,
                   block: int = 0) -> dict[str, Any]:
    """One block scale set to +inf: llama-server then answers "......" with null logprobs."""
    return corrupt_gguf_scale(src, dst, tensor, row, block, value=float("inf"))


def byte_fallback_tokens(pieces: Sequence[str]) -> list[int]:
    """Ids of single-byte tokens for bytes that ordinary text never produces alone: UTF-8 lead and
    continuation bytes (>= 0x80, left over when rare Unicode such as emoji ZWJ sequences has no
    merge) and C0 controls other than tab, newline and carriage return. These are the
    under-trained tokens of byte-level vocabularies."""
    from qladder.engines.llamacpp import RARE_BYTES

    table = byte_level_table()
    return [i for i, p in enumerate(pieces) if p in table and table[p] in RARE_BYTES]


def partial_utf8_tokens(pieces: Sequence[str]) -> list[int]:
    """Ids of multi-byte tokens that are not whole UTF-8 characters (an emoji's first two bytes,
    merged): under-trained too (the glitch-token literature finds partial-character tokens among
    them), and apart from the byte-fallback ones: the held-out glitch tokens. SmolLM2 has 200;
    emoji ZWJ and zero-width prompts hold them, the normal corpus none."""
    table = byte_level_table()
    out = []
    for i, p in enumerate(pieces):
        if len(p) < 2 or any(c not in table for c in p):
            continue
        try:
            bytes(table[c] for c in p).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


GLITCH_SETS: dict[str, Callable[[Sequence[str]], list[int]]] = {"byte-fallback": byte_fallback_tokens,
                                                                "partial-utf8": partial_utf8_tokens}


def glitch_tokens(src: Path, spec: str) -> list[int]:
    """A named set of tokens (`byte-fallback`, `partial-utf8`) or ids and ranges ('100,200-210')."""
    pieces = _read(src).fields["tokenizer.ggml.tokens"].contents()
    if spec in GLITCH_SETS:
        return GLITCH_SETS[spec](pieces)
    return parse_index_list(spec, len(pieces), "glitch tokens")


def glitch_gguf(src: Path, dst: Path, x: float = 1000.0, tokens: Sequence[int] | str | None = None
                ) -> dict[str, Any]:
    """Write a copy of a GGUF whose input embeddings of `tokens` (default: the byte-fallback tokens;
    a name of GLITCH_SETS or an id list) are multiplied by x: a prompt-triggered outlier, as
    under-trained tokens cause.

    When the model ties its output to `token_embd` (SmolLM2 does), the copy first unties them:
    `output.weight` becomes the original embedding matrix and only the input side is scaled
    (llama.cpp uses `output.weight` when a file has one). Each scaled row has every block's fp16
    scale `d` multiplied by x (Q8_0/Q4_0/Q4_1: value = d * q [+ m]; for Q4_1 the min m is scaled
    too). Returns what was changed, with the largest |value| of a scaled row.
    """
    import numpy as np

    reader = _read(src)
    by_name = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in by_name
    emb = by_name.get("token_embd.weight")
    if emb is None:
        raise ConfigError(f"no token_embd.weight in {src}")
    kind = emb.tensor_type.name
    size = _BLOCK_BYTES.get(kind)
    if size is None:
        raise ConfigError(f"token_embd.weight is {kind}; glitch_gguf supports {sorted(_BLOCK_BYTES)}")
    name = tokens if isinstance(tokens, str) else ("byte-fallback" if tokens is None else "ids")
    ids = glitch_tokens(src, tokens or "byte-fallback") if tokens is None or isinstance(tokens, str) else tokens
    rows = np.asarray(sorted(set(ids)), dtype=np.int64)
    if rows.size == 0 or rows.min() < 0 or rows.max() >= emb.data.shape[0]:
        raise ConfigError(f"glitch token ids out of range (vocabulary of {emb.data.shape[0]})")

    writer = _writer_with_fields(reader, dst)
    patched = np.array(emb.data, copy=True)
    blocks = patched.reshape(patched.shape[0], -1, size)
    n_scales = 2 if kind == "Q4_1" else 1  # Q4_1 blocks carry d then m
    for r in rows:
        s = blocks[r, :, : 2 * n_scales].copy().view(np.float16)
        blocks[r, :, : 2 * n_scales] = np.clip(s.astype(np.float32) * x, -FP16_MAX, FP16_MAX).astype(
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
    return {"tensor": "token_embd.weight", "token_set": name, "tokens": len(rows), "x": x,
            "max_abs_scaled": peak, "untied_output": tied}


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
    reader = _read(src)
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


def _dequantize_rows(data: object, kind: str, rows: object) -> np.ndarray:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.asarray(data)[np.asarray(rows)], GGMLQuantizationType[kind])


# name -> writer(src, dst, **kwargs): what a FaultModel's `patch` names
GGUF_PATCHES: dict[str, Callable[..., dict[str, Any]]] = {
    "scale": corrupt_gguf_scale,
    "inf_scale": inf_scale_gguf,
    "scales": patch_scales,
    "glitch": glitch_gguf,
}
