"""The step guard: after every decode step, decide whether the row may be sampled.

Costs are kept inside ~1% of an int4 decode step (~6.5 ms, so ~65 us). A full softmax plus
entropy over 49,152 logits costs ~85 us, so the row checks use three reductions instead,
`sum`, `amax` and `amin` (~15 us together), read with a single host sync together with the
per-layer activation peaks:

- nonfinite: any NaN or +-Inf makes the sum non-finite.
- flat: `max - mean < flat_gap`. By Jensen, sum(exp x) >= V exp(mean), so the top probability is
  at most exp(max - mean) / V: a gap under ln(k) bounds every probability under k / V, a row
  more diffuse than the model ever produces. It also catches all-equal and all-zero rows
  (llama.cpp's RMSNorm overflow gives exactly-zero, finite logits), which a NaN check misses.
  The write-up's `max_prob < 1e-7` cannot fire at V = 49,152, whose uniform probability is 2e-5.
- magnitude: |logit| beyond an absurd bound.
- activation: the largest per-layer |hidden| over the compute dtype's maximum times a fraction
  (fp16: 65,504), so the ladder leaves before an overflow becomes inf.
- outlier: the largest per-layer |hidden| away from the sequence's first position (where the
  model's massive activation, an attention sink, is normal) over a bound calibrated on clean
  traffic: a prompt-triggered outlier, caught while fp16 still has headroom.
- repetition: see `repetition.py`.

Thresholds are calibrated on clean traffic (`qladder calibrate`) and kept as named presets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qladder.health.repetition import find_repetition
from qladder.types import Hazard


@dataclass(frozen=True)
class GuardConfig:
    check_logits: bool = True
    check_repetition: bool = True
    check_activations: bool = True
    flat_gap: float = math.log(64.0)  # top probability bound 64 / V
    max_abs_logit: float = 1.0e4
    activation_fraction: float = 0.6  # of the dtype's max; SmolLM2's natural fp16 peak is 47%
    # Decode steps between activation checks on rungs whose monitor is costly (int4: a monitored
    # llama.cpp step splits its graph at every layer output). Prefill, where a prompt-triggered
    # outlier shows, and every handoff catch-up are always checked; torch rungs check every step.
    activation_every: int = 32
    # Away from position 0 (whose massive activation is an attention sink), clean traffic keeps
    # |hidden| near ~1,000-2,000 on SmolLM2; an outlier past this calibrated bound is a hazard even
    # with fp16 headroom left (an outlier there is where an overflow starts). None: off.
    outlier_limit: float | None = 2000.0  # clean max 1,077 over 329 prompts (bench calibrate)
    repetition_min_period: int = 1
    repetition_max_period: int = 64
    repetition_min_repeats: int = 8
    repetition_min_span: int = 32  # tokens the repeated tail must cover at least
    step_deadline_s: float = 2.0


GUARD_PRESETS: dict[str, GuardConfig] = {
    "default": GuardConfig(),
    "logits": GuardConfig(check_repetition=False, check_activations=False),
    "strict": GuardConfig(flat_gap=math.log(256.0), activation_fraction=0.5, repetition_min_repeats=6,
                          activation_every=1),
    "off": GuardConfig(check_logits=False, check_repetition=False, check_activations=False,
                       step_deadline_s=float("inf")),
}


class StepGuard:
    """Pure checks on one step's outputs. Returns the first hazard found, or None."""

    def __init__(self, config: GuardConfig = GUARD_PRESETS["default"]):
        self.config = config

    def check(
        self,
        row: torch.Tensor,
        generated: Sequence[int],
        rung: str,
        activation_peaks: torch.Tensor | None = None,
        activation_limit: float | None = None,
        rest_peaks: torch.Tensor | None = None,
        row_stats: tuple[float, float, float] | None = None,
    ) -> Hazard | None:
        """row: (V,) float32 logits; generated: ids accepted so far (the step index is their count);
        activation_peaks: (L,) per-layer max |hidden| with `activation_limit` the dtype's max;
        rest_peaks: (L,) the same away from the sequence's first position;
        row_stats: (sum, max, min) of the row when the engine computed them with its copy."""
        c = self.config
        step = len(generated)
        use_act = c.check_activations and activation_peaks is not None and activation_limit is not None
        use_rest = use_act and rest_peaks is not None and c.outlier_limit is not None
        reduce_row = c.check_logits and row_stats is None
        if reduce_row or use_act:
            parts = [row.sum(), row.amax(), row.amin()] if reduce_row else []
            if use_act:
                assert activation_peaks is not None and activation_limit is not None
                limit = c.activation_fraction * activation_limit
                parts += _first_over(activation_peaks, limit)
            if use_rest:
                assert rest_peaks is not None and c.outlier_limit is not None
                parts += _first_over(rest_peaks, c.outlier_limit)
            values = torch.stack(parts).tolist()  # the step's single host sync
            if reduce_row:
                row_stats = (values[0], values[1], values[2])
            if use_act:
                base = 3 if reduce_row else 0
                hit, layer, peak = values[base : base + 3]
                if hit:
                    return Hazard("activation", rung, step, peak, limit, int(layer),
                                  f"max |hidden| {peak:.6g} at layer {int(layer)} over "
                                  f"{c.activation_fraction:.0%} of {activation_limit:.6g}")
                if use_rest:
                    hit, layer, peak = values[base + 3 : base + 6]
                    if hit:
                        return Hazard("outlier", rung, step, peak, c.outlier_limit, int(layer),
                                      f"|hidden| {peak:.6g} at layer {int(layer)} away from the first "
                                      f"position, over the calibrated {c.outlier_limit:.6g}")
        if c.check_logits:
            assert row_stats is not None
            hazard = self._check_row(*row_stats, row.numel(), rung, step)
            if hazard is not None:
                return hazard
        if c.check_repetition and len(generated) >= c.repetition_min_span:
            period = find_repetition(generated, c.repetition_min_period, c.repetition_max_period,
                                     c.repetition_min_repeats, c.repetition_min_span)
            if period is not None:
                return Hazard("repetition", rung, step, float(period), float(c.repetition_min_repeats),
                              detail=f"the tail repeats a {period}-token pattern")
        return None

    def _check_row(self, total: float, hi: float, lo: float, n: int, rung: str, step: int) -> Hazard | None:
        c = self.config
        if not math.isfinite(total):
            return Hazard("nonfinite", rung, step, total, None, detail="NaN or Inf in the logits row")
        bound = max(abs(hi), abs(lo))
        if bound > c.max_abs_logit:
            return Hazard("magnitude", rung, step, bound, c.max_abs_logit, detail="absurd logit magnitude")
        gap = hi - total / n
        if gap < c.flat_gap:
            return Hazard("flat", rung, step, gap, c.flat_gap,
                          detail=f"max - mean {gap:.3g}: top probability <= {math.exp(gap):.3g}/V")
        return None


def _first_over(values: torch.Tensor, limit: float) -> list[torch.Tensor]:
    """[any over, index of the first over, its value] as float32 scalars; NaN counts as over."""
    over = ~(values <= limit)  # (L,)
    first = over.to(torch.uint8).argmax()
    return [over.any().to(torch.float32), first.to(torch.float32), values[first]]
