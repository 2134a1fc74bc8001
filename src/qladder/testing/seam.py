"""The one seam where test machinery meets the request path.

A driver asks here for what a request's faults install on it: row faults for a driver that holds
logits rows (the INT4 scheduler), token faults for a remote stream, a faulty session for the
in-process ladder, gains on an engine or a batch slot. For a request without faults every call
returns at once with nothing to install (None, the session itself, an empty context), and
`qladder.testing.faults` is never imported (tests/test_fault_seam.py checks it on the server). Faults reach
a request only through an `allow_faults` gate (the server's `--allow-faults`, the serving engine's
config) or an in-process caller (the validation harness); what they do is in `qladder.testing.faults`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qladder.engines.base import Engine, Session
    from qladder.engines.llamacpp_batch import BatchedLlamaCpp
    from qladder.testing.faults import Fault, RowFaults, TokenFaults

__all__ = ["engine_gains", "parse", "row_faults", "session", "slot_gains", "token_faults"]


def parse(specs: Sequence[str]) -> tuple[Fault, ...]:
    """Fault specs (`nan@step=3`, ...) as faults; () for none. Raises ConfigError on a bad spec."""
    if not specs:
        return ()
    from qladder.testing.faults import parse_fault

    return tuple(parse_fault(s) for s in specs)


def row_faults(faults: Sequence[Fault]) -> RowFaults | None:
    """The step faults a driver that holds rows applies to a request's rows, or None."""
    if not faults:
        return None
    from qladder.testing.faults import row_faults as build

    return build(faults)


def token_faults(faults: Sequence[Fault]) -> TokenFaults | None:
    """The step faults a remote pool applies to a request's streamed tokens, or None."""
    if not faults:
        return None
    from qladder.testing.faults import token_faults as build

    return build(faults)


def session(inner: Session, faults: Sequence[Fault], prompt_len: int,
            sleep: Callable[[float], None] = time.sleep) -> Session:
    """A session whose steps the request's step faults corrupt; `inner` itself without any."""
    if not faults:
        return inner
    from qladder.testing.faults import FaultySession, step_faults

    return FaultySession(inner, faults, prompt_len, sleep) if step_faults(faults) else inner


def engine_gains(engine: Engine, faults: Sequence[Fault]) -> contextlib.AbstractContextManager[None]:
    """The request's gain faults on an engine's layers for the duration of the context."""
    if not any(f.kind == "gain" for f in faults):
        return contextlib.nullcontext()
    from qladder.testing.faults import engine_faults

    return engine_faults(engine, faults)


def slot_gains(engine: BatchedLlamaCpp, slot: int, faults: Sequence[Fault]) -> bool:
    """The request's gain faults on one batch slot's rows; whether any was set (to clear at release)."""
    if not any(f.kind == "gain" for f in faults):
        return False
    from qladder.testing.faults import install_slot_gains

    return install_slot_gains(engine, slot, faults)
