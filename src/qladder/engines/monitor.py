"""Per-layer activation peaks for the int4 rung, through llama.cpp's eval callback (`cb_eval`).

The callback is a few lines of C (`native/act_monitor.c`), compiled once with the system C
compiler against the ggml shipped in llama-cpp-python and cached beside the torch weights. A
Python callback would run for every graph node (~1 us each, ~10% of a decode step); in C the
cost is the graph splits at each observed layer output and one pass over its values.
If no compiler is available, `load_monitor` raises EngineError and the rung runs unmonitored.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from qladder.errors import EngineError

SOURCE = Path(__file__).parent / "native" / "act_monitor.c"


class _State(ctypes.Structure):
    _fields_ = [("enabled", ctypes.c_int32), ("n_layer", ctypes.c_int32), ("observed", ctypes.c_int64),
                ("peaks", ctypes.POINTER(ctypes.c_float)), ("rest_peaks", ctypes.POINTER(ctypes.c_float)),
                ("n_embd", ctypes.c_int32), ("batch_tokens", ctypes.c_int32), ("pos0_in_batch", ctypes.c_int32),
                ("_pad", ctypes.c_int32)]


def _build(cache_dir: Path) -> Path:
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + str(libdir).encode()).hexdigest()[:12]
    out = cache_dir / "native" / f"act_monitor-{key}.so"
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise EngineError("no C compiler found: the int4 activation monitor is unavailable")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".so")  # its own: processes may build at once
    os.close(fd)
    tmp = Path(name)
    cmd = [cc, "-O3", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), f"-L{libdir}", "-lggml-base",
           f"-Wl,-rpath,{libdir}", "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise EngineError(f"building the activation monitor failed: {proc.stderr.strip()[:500]}")
    os.replace(tmp, out)  # atomic; a library another process already loaded keeps its own inode
    return out


def load_native(cache_dir: Path) -> ctypes.CDLL:
    """The native helpers, built once and cached. Raises EngineError without a C compiler."""
    return ctypes.CDLL(str(_build(cache_dir)))


class ActivationMonitor:
    """Holds the C state. `peaks`: per-layer max |hidden| over the batch; `rest_peaks`: the same
    without the sequence's first position (its massive activation is normal)."""

    def __init__(self, n_layer: int, n_embd: int, cache_dir: Path):
        import llama_cpp

        self._lib = load_native(cache_dir)
        self.peaks = np.zeros(n_layer, dtype=np.float32)
        self.rest_peaks = np.zeros(n_layer, dtype=np.float32)
        as_ptr = ctypes.POINTER(ctypes.c_float)
        self.state = _State(0, n_layer, 0, self.peaks.ctypes.data_as(as_ptr), self.rest_peaks.ctypes.data_as(as_ptr),
                            n_embd, 0, 0, 0)
        self._lib.qladder_copy_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._lib.qladder_copy_stats.restype = None
        self.copy_stats = self._lib.qladder_copy_stats  # (src, dst, n, out[3] doubles)
        fn = self._lib.qladder_act_monitor
        self.callback = ctypes.cast(fn, llama_cpp.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(self.state), ctypes.c_void_p)
        self.enabled_stats = False  # whether logits copies also compute the guard's row stats

    @property
    def enabled(self) -> bool:
        return bool(self.state.enabled)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.state.enabled = int(on)

    def reset(self) -> None:
        """Before a decode call: peaks then cover that call's positions only."""
        self.peaks[:] = 0.0
        self.rest_peaks[:] = 0.0
        self.state.observed = 0

    def begin_batch(self, batch_tokens: int, starts_at_zero: bool) -> None:
        """Before each llama_decode: its size, and whether it holds position 0."""
        self.state.batch_tokens = batch_tokens
        self.state.pos0_in_batch = int(starts_at_zero)
