"""Quantization levels: a model's weights at another precision, made by llama.cpp's own quantizer.

From the highest-precision weights there are (an F32/F16/BF16 GGUF as they are; a quantized one,
the embedded Q4_1 included, dequantized to an F32 GGUF first: the fp32 rung's weights), each level
is `llama_model_quantize` with that level's file type. Files are kept under
`<cache>/levels/<source's cache key>/<LEVEL>.gguf`, written to a temporary name and renamed, so a
second process finds a whole file or none.

llama.cpp quantizes a tensor at the level's type only where its rows fit the type's block: a
K-quant needs rows of a multiple of 256, and the embedded model's are 576 wide, so most of its
tensors at the K levels fall back to a 32-block type (Q2_K is mostly Q4_0 on it). `describe` says
what each file holds (its tensor types and bits per weight): a sweep's axis is the bits per weight
measured, never the level's nominal name.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qladder.errors import ConfigError, ModelError
from qladder.model import ModelInfo

# level -> llama_ftype (llama.h's LLAMA_FTYPE_MOSTLY_*)
LEVELS: dict[str, int] = {"Q2_K": 10, "Q3_K_M": 12, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_0": 8,
                          "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}
SWEEP_LEVELS = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
FULL_FILE_TYPES = frozenset({0, 1, 32})  # ALL_F32, MOSTLY_F16, MOSTLY_BF16: a source as it is


@dataclass(frozen=True)
class LevelFile:
    """A GGUF at one level, and what it holds."""

    level: str
    path: Path
    bits_per_weight: float  # 8 x tensor bytes / weights, every tensor (embeddings and norms too)
    size_mb: float
    n_weights: int
    tensor_types: dict[str, int]  # ggml type -> tensors of it

    def to_dict(self) -> dict[str, object]:
        return {"level": self.level, "path": str(self.path), "bits_per_weight": self.bits_per_weight,
                "size_mb": self.size_mb, "n_weights": self.n_weights, "tensor_types": self.tensor_types}


def level_name(file_type: int) -> str:
    """A GGUF's `general.file_type` by name ("Q4_1"; "file type N" for one without a level here)."""
    names = {0: "F32", 1: "F16", 32: "BF16", **{v: k for k, v in LEVELS.items()}}
    return names.get(file_type, f"file type {file_type}")


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ConfigError(f"unknown quantization level {level!r}; choose from {', '.join(LEVELS)}")


def _publish(make: Callable[[Path], None], dst: Path) -> Path:
    """Run `make(tmp_path)` and rename its file to `dst` (atomic: a reader sees all of it or none)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".part")
    os.close(fd)
    try:
        make(Path(tmp))
        Path(tmp).replace(dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dst


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """The process's stderr (file descriptor 2) into `path` while the block runs: llama.cpp's
    quantizer prints each tensor that falls back to another type there, past its log callback
    (180 lines for a K level of the embedded model). The file stays beside the level's GGUF;
    `describe` reports the types the file holds."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("wb") as f:
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _levels_dir(info: ModelInfo, cache_dir: Path) -> Path:
    return cache_dir / "levels" / info.cache_key


def full_precision_gguf(info: ModelInfo, cache_dir: Path) -> Path:
    """The highest-precision GGUF of this model: the file itself when it is F32/F16/BF16, else
    every tensor dequantized (gguf's reference dequantizers) into an F32 copy, made once."""
    if info.file_type in FULL_FILE_TYPES:
        return info.path
    dst = _levels_dir(info, cache_dir) / "F32.gguf"
    if dst.is_file():
        return dst

    def make(tmp: Path) -> None:
        import numpy as np
        from gguf import GGUFReader, GGUFValueType, GGUFWriter
        from gguf.quants import dequantize

        reader = GGUFReader(str(info.path))
        writer = GGUFWriter(str(tmp), arch=reader.fields["general.architecture"].contents())
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue  # header fields, and the one the writer adds itself
            value = 0 if name == "general.file_type" else f.contents()  # ALL_F32
            if f.types[0] == GGUFValueType.ARRAY:
                writer.add_key_value(name, value, f.types[0], sub_type=f.types[-1])
            else:
                writer.add_key_value(name, value, f.types[0])
        for t in reader.tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    try:
        return _publish(make, dst)
    except (ValueError, NotImplementedError, KeyError) as exc:  # gguf: a type it cannot dequantize
        raise ModelError(f"cannot dequantize {info.path} to F32: {type(exc).__name__}: {exc}") from exc


def level_gguf(info: ModelInfo, level: str, cache_dir: Path, threads: int = 1, verbose: bool = False) -> Path:
    """This model at `level`, quantized by llama.cpp from `full_precision_gguf` (made once)."""
    check_level(level)
    dst = _levels_dir(info, cache_dir) / f"{level}.gguf"
    if dst.is_file():
        return dst
    src = full_precision_gguf(info, cache_dir)
    log = dst.with_suffix(".quantize.log")  # llama.cpp's own report of the quantization (unless verbose)

    def make(tmp: Path) -> None:
        import llama_cpp
        from llama_cpp._logger import set_verbose

        params = llama_cpp.llama_model_quantize_default_params()
        params.nthread = threads
        params.ftype = LEVELS[level]
        set_verbose(verbose)  # llama.cpp's log (each tensor, each fallback) through llama-cpp-python's logger,
        # as `Llama(verbose=...)` sets it
        with contextlib.nullcontext() if verbose else _stderr_to(log):
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise ModelError(f"llama.cpp could not quantize {src} to {level} (code {rc}; its log: {log})")

    return _publish(make, dst)


def describe(level: str, path: Path) -> LevelFile:
    """What a GGUF holds: its tensors' types, bytes and weights."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    n = sum(int(t.n_elements) for t in reader.tensors)
    nbytes = sum(int(t.n_bytes) for t in reader.tensors)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return LevelFile(level, path, 8.0 * nbytes / n, nbytes / 2**20, n, dict(sorted(types.items())))
