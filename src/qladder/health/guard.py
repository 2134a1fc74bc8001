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
- outlier: per-layer |hidden| away from the sequence's first position (where the model's massive
  activation, an attention sink, is normal) over that layer's bound, calibrated on clean traffic
  (3x its clean max, capped at 2,000): a prompt-triggered outlier, caught while fp16 still has
  headroom, even in a layer that normally stays near 100.
- repetition: see `repetition.py`.

Thresholds are calibrated on clean traffic (`qladder calibrate`) and kept as named presets.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qladder.health.repetition import find_repetition
from qladder.types import Hazard

# The embedded model's identity (ModelInfo.identity): the per-layer bounds below were calibrated on it.
_log = logging.getLogger("qladder.guard")

SMOLLM2_IDENTITY = "Smollm2 135M 8k Lc100K Mix1 Ep2|llama|L30|D576|V49152|ft3"
SMOLLM2_OUTLIER_LIMITS = (120.0, 650.0, 2000.0, 2000.0, 2000.0, 2000.0, 2000.0, 2000.0, 2000.0, 1310.0,
                          410.0, 390.0, 380.0, 420.0, 450.0, 400.0, 450.0, 410.0, 470.0, 530.0,
                          630.0, 660.0, 750.0, 910.0, 1170.0, 1300.0, 1390.0, 1760.0, 2000.0, 2000.0)


@dataclass(frozen=True)
class RemoteChecks:
    """What only a remote rung's token checks read (health/remote.check_remote, the remote visit)."""

    # Remote rungs with a rung above them: the server's own top-1 log-probability, averaged over
    # the last `diffuse_window` tokens, under `diffuse_logprob` means the distribution has diffused
    # (finite garbage, e.g. a corrupted weight, that no NaN check sees). bench/calibrate_diffuse.py, on
    # the corpora's train half (bench/results/calibrate-diffuse-train-2026-12-01.json): clean answers'
    # lowest window -2.12 over 157, none under the bound; the x1000 scale's highest -1.85, all 32 under.
    diffuse_window: int = 8
    diffuse_logprob: float | None = -2.2
    # The answer's first 2..window-1 tokens (judged before the first full window): their mean
    # under this bound. Clean answers reach -2.35 there, a corrupted scale's mostly under -2.5.
    diffuse_first_logprob: float = -2.5


@dataclass(frozen=True)
class DraftCheck:
    """What only the remote pool's draft check reads (serving/remote.py, health/remote.check_draft)."""

    # A flagged input's answer (the input defence changed it, or its prompt holds a lone byte's id)
    # on a remote rung: its first `verify_tokens` are scored by the rung above (where it can: vLLM) before
    # any is released; a token the standby finds over e^verify_gap times less likely than the rung
    # that drew it is refused (health/remote.check_draft; bench/calibrate_verify.py on the train half,
    # bench/results/calibrate-verify-train-2026-12-01.json: clean normal answers' largest gap 0.20
    # nats, 3 of 31 abnormal ones over 18; a corrupted scale's 42 of 43 drafts over 5, the glitch
    # tokens' 4 of 4). 0: off.
    verify_tokens: int = 8
    verify_gap: float = 5.0
    # vLLM (0.32, CPU) scores a prompt without its prefix cache, at a cost that grows with it: 0.19 s
    # at 40 tokens, 0.7 s at 200, 2.9 s at 800, 8.9 s at 1,900 here. Longer prompts go unchecked.
    verify_max_context: int = 512


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
    # Per-layer bounds under that ceiling, for a model with this many layers (others use the
    # ceiling alone): clean traffic peaks at very different heights per layer (SmolLM2: ~40 after
    # layer 0, ~850 in layers 2-8, ~110 in layers 10-12), so one bound misses an outlier of a few
    # hundred where the layer normally stays near 100 (a glitch token's scaled embedding).
    # 3 x each layer's clean max over the 329 corpus prompts (prefill and every 32nd decode step,
    # `qladder bench calibrate`: max 37.5 after layer 0, 906 in layers 2-8, 125-155 in 10-18).
    outlier_layer_limits: tuple[float, ...] | None = SMOLLM2_OUTLIER_LIMITS
    # The model those limits were calibrated on (ModelInfo.identity): another model gets the
    # ceiling alone, with a warning, until it is calibrated. None: apply them to any model with
    # as many layers (hand-made limits, tests).
    outlier_layer_limits_model: str | None = SMOLLM2_IDENTITY
    repetition_min_period: int = 1
    repetition_max_period: int = 64
    repetition_min_repeats: int = 8
    repetition_min_span: int = 32  # tokens the repeated tail must cover at least
    # Short loops (a token or a few: '((((((', '❄❄❄❄') are caught sooner, at the bar of the
    # offline garbage judge: period <= 16, 6 repeats, 12 tokens. None of the 896 normal answers
    # of a full `qladder validate` run reaches it.
    repetition_short_max_period: int = 16
    repetition_short_min_repeats: int = 6
    repetition_short_min_span: int = 12
    step_deadline_s: float = 2.0
    remote: RemoteChecks = field(default_factory=RemoteChecks)  # read by a remote rung's checks only
    draft: DraftCheck = field(default_factory=DraftCheck)  # read by the remote pool's draft check only


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

    def __init__(self, config: GuardConfig = GUARD_PRESETS["default"], model_key: str | None = None):
        """model_key: the identity of the model whose steps this guard judges (ModelInfo.identity)."""
        self.config = config
        self.model_key = model_key
        per = config.outlier_layer_limits
        self.calibrated = per is not None and (config.outlier_layer_limits_model is None
                                               or config.outlier_layer_limits_model == model_key)
        if per is not None and not self.calibrated and config.check_activations:
            _log.warning("the guard's per-layer outlier bounds were calibrated on %s, not on %s: using the "
                         "ceiling %s alone until this model is calibrated (qladder bench calibrate)",
                         config.outlier_layer_limits_model, model_key, config.outlier_limit)
        self._outlier_bounds: dict[int, list[float]] = {}
        self._outlier_bounds_on: dict[tuple[int, torch.device], torch.Tensor] = {}  # for device peaks

    def outlier_bounds(self, n_layer: int) -> list[float]:
        """The outlier bound of each of n_layer layers: the per-layer limits (capped by the
        ceiling) when they were calibrated for this model and depth, else the ceiling alone."""
        if n_layer not in self._outlier_bounds:
            c = self.config
            ceiling = c.outlier_limit if c.outlier_limit is not None else math.inf
            per = c.outlier_layer_limits if self.calibrated else None
            self._outlier_bounds[n_layer] = ([min(v, ceiling) for v in per]
                                             if per is not None and len(per) == n_layer else [ceiling] * n_layer)
        return self._outlier_bounds[n_layer]

    def outlier_bounds_on(self, n_layer: int, device: torch.device) -> torch.Tensor:
        """`outlier_bounds` as a tensor on `device`, made once: not a host-to-device copy a step."""
        key = (n_layer, device)
        if key not in self._outlier_bounds_on:
            self._outlier_bounds_on[key] = torch.tensor(self.outlier_bounds(n_layer), device=device)
        return self._outlier_bounds_on[key]

    def check(
        self,
        row: torch.Tensor,
        generated: Sequence[int],
        rung: str,
        activation_peaks: torch.Tensor | None = None,
        activation_limit: float | None = None,
        rest_peaks: torch.Tensor | None = None,
        row_stats: tuple[float, float, float] | None = None,
        repetition: bool = True,
    ) -> Hazard | None:
        """row: (V,) float32 logits; generated: ids accepted so far (the step index is their count);
        activation_peaks: (L,) per-layer max |hidden| with `activation_limit` the dtype's max;
        rest_peaks: (L,) the same away from the sequence's first position;
        row_stats: (sum, max, min) of the row when the engine computed them with its copy;
        repetition: whether to look for a loop in `generated` (a draft's is the verifier's to judge)."""
        c = self.config
        step = len(generated)
        use_act = c.check_activations and activation_peaks is not None and activation_limit is not None
        use_rest = use_act and rest_peaks is not None and (c.outlier_limit is not None
                                                           or c.outlier_layer_limits is not None)
        reduce_row = c.check_logits and row_stats is None
        limit = c.activation_fraction * activation_limit if use_act and activation_limit is not None else 0.0
        # Peaks that live on the host (llama.cpp's C monitor, CPU hooks) are compared in Python: a
        # few dozen floats, where torch ops right after a llama.cpp decode cost ~150 us each.
        host = use_act and activation_peaks is not None and activation_peaks.device.type == "cpu"
        act: list[float] | None = None  # [hit, layer, peak, bound]
        rest: list[float] | None = None
        if host:
            assert activation_peaks is not None
            act = _first_over_host(activation_peaks.tolist(), limit)
            if use_rest:
                assert rest_peaks is not None
                rest = _first_over_host(rest_peaks.tolist(), self.outlier_bounds(int(rest_peaks.numel())))
        if reduce_row or (use_act and not host):
            parts = [row.sum(), row.amax(), row.amin()] if reduce_row else []
            if use_act and not host:
                assert activation_peaks is not None
                parts += _first_over(activation_peaks, limit)
                if use_rest:
                    assert rest_peaks is not None
                    parts += _first_over(rest_peaks, self.outlier_bounds_on(int(rest_peaks.numel()), rest_peaks.device))
            values = torch.stack(parts).tolist()  # the step's single host sync
            if reduce_row:
                row_stats = (values[0], values[1], values[2])
            if use_act and not host:
                base = 3 if reduce_row else 0
                act = values[base : base + 4]
                rest = values[base + 4 : base + 8] if use_rest else None
        if act is not None and act[0]:
            _, layer, peak, _ = act
            return Hazard("activation", rung, step, peak, limit, int(layer),
                          f"max |hidden| {peak:.6g} at layer {int(layer)} over "
                          f"{c.activation_fraction:.0%} of {activation_limit:.6g}")
        if rest is not None and rest[0]:
            _, layer, peak, bound = rest
            return Hazard("outlier", rung, step, peak, bound, int(layer),
                          f"|hidden| {peak:.6g} at layer {int(layer)} away from the first "
                          f"position, over its calibrated bound {bound:.6g}")
        if c.check_logits:
            assert row_stats is not None
            hazard = self._check_row(*row_stats, row.numel(), rung, step)
            if hazard is not None:
                return hazard
        return self.check_repetition(generated, rung) if repetition else None

    def check_repetition(self, generated: Sequence[int], rung: str) -> Hazard | None:
        """A loop in the accepted ids (short loops sooner, longer ones after more repeats)."""
        c = self.config
        step = len(generated)
        if c.check_repetition and step >= min(c.repetition_min_span, c.repetition_short_min_span):
            rules = ((c.repetition_short_max_period, c.repetition_short_min_repeats, c.repetition_short_min_span),
                     (c.repetition_max_period, c.repetition_min_repeats, c.repetition_min_span))
            for max_period, repeats, span in rules:
                if step < span:
                    continue
                period = find_repetition(generated, c.repetition_min_period, max_period, repeats, span)
                if period is not None:
                    return Hazard("repetition", rung, step, float(period), float(repeats),
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


def _first_over_host(values: Sequence[float], limit: Sequence[float] | float) -> list[float]:
    """`_first_over` on host floats: [hit, layer, value, bound] of the first layer over its bound
    (NaN counts as over), or [0, 0, max, first bound] when none is."""
    bounds = [limit] * len(values) if isinstance(limit, (int, float)) else list(limit)
    for i, (v, b) in enumerate(zip(values, bounds, strict=True)):
        if not v <= b:
            return [1.0, float(i), v, b]
    return [0.0, 0.0, max(values, default=0.0), bounds[0] if bounds else 0.0]


def _first_over(values: torch.Tensor, limit: torch.Tensor | float) -> list[torch.Tensor]:
    """[any over, index of the first over, its value] as float32 scalars, plus that layer's bound
    when `limit` is per layer; NaN counts as over."""
    over = ~(values <= limit)  # (L,)
    first = over.to(torch.uint8).argmax()
    bound = limit[first] if isinstance(limit, torch.Tensor) else torch.tensor(limit, device=values.device)
    return [over.any().to(torch.float32), first.to(torch.float32), values[first].to(torch.float32),
            bound.to(torch.float32)]
