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

Faults in the model file itself (a corrupted quantization scale, glitch-token embeddings) are
not per-request faults: `qladder.testing.gguf_patch` writes patched copies of the GGUF
(`qladder faults patch-gguf`), and an int4 engine loaded on a copy runs llama.cpp's real kernels
on it.

Steps count generated tokens: step K is the logits row from which token K would be sampled
(step 0 is the row right after prefill).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from qladder.engines.base import Engine, Session, StepOutput
from qladder.errors import ConfigError, EngineError
from qladder.health.remote import RemoteToken

if TYPE_CHECKING:
    from qladder.engines.llamacpp_batch import BatchedLlamaCpp

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


class RowFaults:
    """One request's step faults on the rung under test, as the driver that holds its rows installs
    them (only for a request that has some): `stall(step)` once per step, `output(out, step)` the
    step's output as the faults make it (stats dropped from a replaced row: they describe the
    engine's). Raises EngineError for an injected kernel error."""

    def __init__(self, faults: Sequence[Fault]):
        self.faults = step_faults(faults)
        self._stalled: set[int] = set()

    def stall(self, step: int) -> float | None:
        return stall_due(self.faults, step, self._stalled)

    def output(self, out: StepOutput, step: int) -> StepOutput:
        row = fault_row(out.row, self.faults, step)
        return out if row is out.row else dataclasses.replace(out, row=row, stats=None)


def step_faults(faults: Sequence[Fault]) -> list[Fault]:
    """The faults that act on a step's output (all but gain, which acts on an engine's layers)."""
    return [f for f in faults if f.kind in STEP_KINDS]


def row_faults(faults: Sequence[Fault]) -> RowFaults | None:
    """The row faults a driver installs for a request, or None when it has none (the usual case)."""
    return RowFaults(faults) if step_faults(faults) else None


class TokenFaults:
    """One request's step faults on a remote rung under test, which streams sampled tokens and no
    rows: at step K exactly (the server has sampled on), nan/inf make the token's logprob
    non-finite, zero flattens it (logprob -ln V, no top-k), error is an engine error (EngineError),
    stall a gap of S seconds."""

    def __init__(self, faults: Sequence[Fault]):
        self.faults = step_faults(faults)

    def token(self, tok: RemoteToken, took_s: float, step: int, n_vocab: int) -> tuple[RemoteToken, float]:
        for f in self.faults:
            if f.step != step:
                continue
            if f.kind in ("nan", "inf"):
                tok = RemoteToken(tok.token_id, float(f.kind), tok.token_bytes, tok.top)
            elif f.kind == "zero":
                tok = RemoteToken(tok.token_id, -math.log(n_vocab), tok.token_bytes, ())
            elif f.kind == "error":
                raise EngineError("injected engine error")
            elif f.kind == "stall":
                took_s = max(took_s, f.stall_s)
        return tok, took_s


def token_faults(faults: Sequence[Fault]) -> TokenFaults | None:
    """The token faults the remote pool applies to a request's rung 0, or None without any."""
    return TokenFaults(faults) if step_faults(faults) else None


class FaultySession:
    """Wraps a session and corrupts its steps from `fault.step` on (step = ids past the prompt).
    Implements Session."""

    def __init__(self, inner: Session, faults: Sequence[Fault], prompt_len: int,
                 sleep: Callable[[float], None] = time.sleep):
        self._inner = inner
        self._faults = RowFaults(faults)
        self._prompt_len = prompt_len
        self._sleep = sleep

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
        stall = self._faults.stall(step)
        if stall is not None:
            self._sleep(stall)
        return self._faults.output(out, step)

    def push(self, token_id: int) -> None:
        self._inner.push(token_id)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._inner.extend(token_ids)

    def rollback(self, n: int) -> None:
        self._inner.rollback(n)

    def close(self) -> None:
        self._inner.close()


def install_slot_gains(engine: BatchedLlamaCpp, slot: int, faults: Sequence[Fault]) -> bool:
    """Add each gain fault's activation outlier to one slot's rows through the real kernels
    (in C, at layer L's output). Returns whether any was set (the slot's gain then needs clearing)."""
    gains = [f for f in faults if f.kind == "gain"]
    for f in gains:
        engine.set_gain(slot, f.layer, f.channel, (f.x - 1.0) * MASSIVE_ACTIVATION)
    return bool(gains)


@runtime_checkable
class _LayerFaults(Protocol):
    """An engine that runs a function on a layer's output (the torch rungs)."""

    def add_layer_fault(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...
    def clear_faults(self) -> None: ...


@runtime_checkable
class _ControlVector(Protocol):
    """An engine that adds a control vector to a layer's output (llama.cpp's int4 rung)."""

    def set_control_vector(self, layer: int, channel: int, value: float) -> None: ...
    def clear_control_vector(self) -> None: ...


@contextmanager
def engine_faults(engine: Engine, faults: Sequence[Fault]) -> Iterator[None]:
    """Install activation faults (gain) on an engine for one request, and remove them after."""
    gains = [f for f in faults if f.kind == "gain"]
    if not gains:
        yield
        return
    if isinstance(engine, _LayerFaults):
        for f in gains:
            engine.add_layer_fault(f.layer, _gain_fn(f.channel, f.x))
        try:
            yield
        finally:
            engine.clear_faults()
    elif isinstance(engine, _ControlVector):
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
