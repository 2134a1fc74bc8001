"""The drift rule: whether a window of INT4's tokens stays with full precision's own choices.

The rung above scores a held window of the answer teacher-forced (one forward, or one prefill on a
remote server) and says, per token, whether it is its own argmax there (`flags`). Clean INT4
answers paraphrase now and then; a corrupted rung's (fluent loops, confident salad, plausible
wrong answers, all finite, all passing a likelihood tolerance) leave fp32's argmax. A window where
the share of fp32's argmax among the last `window` tokens is under `bound` is refused from its
first token that is not fp32's argmax: the exactness rule of verified decoding with a tolerance.
The bound is calibrated on clean traffic and the train faults (bench/calibrate_drift.py); the
remote pool (serving/remote.py) and the in-process scheduler's checked windows (serving/verify.py)
apply the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from qladder.types import Hazard


def drift_agreement(flags: Sequence[bool], held: int, window: int) -> float:
    """The share of fp32's argmax among the last max(window, held) scored tokens (`flags`: per
    token, whether it is fp32's argmax; the last `held` are the window under check, the ones
    before it already passed)."""
    tail = flags[-max(window, held):]
    return sum(tail) / len(tail) if tail else 1.0


def window_agreements(flags: Sequence[bool], first: int, window: int) -> list[float]:
    """`drift_agreement` at each check of an answer whose tokens' flags are `flags`, as the remote
    pool checks them: the first `first` tokens, then every `window` tokens, then the rest at the
    end (bench/calibrate_drift.py)."""
    out, start = [], 0
    while start < len(flags):
        end = min(len(flags), start + (first if start == 0 else window))
        out.append(drift_agreement(flags[:end], end - start, window))
        start = end
    return out


def check_drift(draft: Sequence[int], flags: Sequence[bool], before: Sequence[bool], rung: str, by: str,
                window: int, bound: float, start: int = 0) -> Hazard | None:
    """The drift window: the held tokens `draft` (the answer's from index `start`) with their
    `flags` from the rung above (`by`), after `before` (the flags of the tokens it already passed
    on this rung). When the share of the rung above's own argmax among the last max(window, held)
    tokens is under `bound`, the first held token that is not its argmax is refused: the answer
    continues from the tokens before it on the rung above. None: the window passes."""
    share = drift_agreement([*before, *flags], len(flags), window)
    if share >= bound:
        return None
    k = next((i for i, f in enumerate(flags) if not f), None)
    if k is None:  # every held token is its argmax: the low share is the window before, already out
        return None
    n = min(len(before) + len(flags), max(window, len(flags)))
    return Hazard("drift", rung, start + k, share, bound,
                  detail=f"{by}'s argmax is {share:.0%} of the last {n} tokens; token {draft[k]} is not it")
