"""`qladder bench calibrate`: the guard's thresholds against clean traffic, and the false-handoff rate.

Replays the train half of the normal prompts (corpora/normal.jsonl; validation scores the other
half) through the production ladder (int4 -> fp32, default guard) and records, for every step on
every rung, the statistics the guard thresholds: the row's `max - mean` gap (the flat check), its
largest |logit| (magnitude) and the per-layer activation peaks against the dtype's limit. Reports
their extremes next to the preset's thresholds (the margin each keeps), which checks fired, and
the share of clean requests that climbed a rung.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qladder.benchmarks.common import environment, percentile
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.health.guard import GUARD_PRESETS, StepGuard
from qladder.ladder import LadderConfig
from qladder.model import inspect_model
from qladder.sampling import SamplingParams
from qladder.service import Qladder
from qladder.types import FinishReason, Hazard

CORPORA = Path(__file__).resolve().parents[3] / "corpora"
OUTLIER_MARGIN = 3.0  # per-layer outlier bound = 3 x the clean per-layer maximum


class RecordingGuard(StepGuard):
    """The default guard, plus a record of the statistics behind each verdict (calibration only)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.gaps: list[float] = []
        self.abs_max: list[float] = []
        self.act_fraction: list[float] = []
        self.rest_peak: list[float] = []
        self.rest_by_layer: torch.Tensor | None = None  # per-layer max over every monitored step

    def check(self, row: torch.Tensor, generated: Sequence[int], rung: str,
              activation_peaks: torch.Tensor | None = None,
              activation_limit: float | None = None,
              rest_peaks: torch.Tensor | None = None,
              row_stats: tuple[float, float, float] | None = None, repetition: bool = True) -> Hazard | None:
        hi, lo, total = float(row.amax()), float(row.amin()), float(row.sum())
        if math.isfinite(total):
            self.gaps.append(hi - total / row.numel())
            self.abs_max.append(max(abs(hi), abs(lo)))
        if activation_peaks is not None and activation_limit:
            self.act_fraction.append(float(activation_peaks.max()) / activation_limit)
        if rest_peaks is not None:
            self.rest_peak.append(float(rest_peaks.max()))
            r = rest_peaks.detach().to(torch.float32).clone()
            self.rest_by_layer = r if self.rest_by_layer is None else torch.maximum(self.rest_by_layer, r)
        return super().check(row, generated, rung, activation_peaks, activation_limit, rest_peaks, row_stats,
                             repetition)


def load_prompts(path: Path = CORPORA / "normal.jsonl", limit: int | None = None) -> list[str | bytes]:
    """The prompts as a client sends them (raw bytes where the corpus holds bytes)."""
    from qladder.validate.corpora import read_jsonl

    prompts = [p.prompt for p in read_jsonl(path) if p.split == "train"]  # validation scores the test half
    return prompts[:limit] if limit else prompts


def layer_limits(per_layer_max: Sequence[float], margin: float = OUTLIER_MARGIN,
                 ceiling: float | None = None) -> tuple[float, ...]:
    """Per-layer outlier bounds from clean per-layer maxima: margin x max, rounded up to a multiple
    of 10, capped by the global bound."""
    out = []
    for m in per_layer_max:
        v = math.ceil(margin * m / 10.0) * 10.0
        out.append(min(v, ceiling) if ceiling is not None else v)
    return tuple(out)


def _replay(q: Qladder, prompts: Sequence[str | bytes], max_tokens: int) -> dict[str, Any]:
    climbed, finishes, checks = 0, Counter[str](), Counter[str]()
    for p in prompts:
        r = q.answer(p, SamplingParams(max_tokens=max_tokens)).result
        climbed += bool(r.handoffs)
        finishes[str(r.finish_reason)] += 1
        checks.update(h.check for h in r.hazards)
    return {"prompts": len(prompts), "requests_with_handoff": climbed,
            "false_handoff_rate": climbed / max(len(prompts), 1), "finish_reasons": dict(finishes),
            "hazards_by_check": dict(checks), "repetition_stops": finishes[str(FinishReason.REPETITION)]}


def run_calibration(limit: int | None = None, max_tokens: int = 48) -> dict[str, Any]:
    """Normal prompts, then the abnormal ones without faults (sanitized, as served)."""
    settings = Settings.from_env()
    info = inspect_model()
    int4, fp32 = load_engine("int4", info, settings), load_engine("fp32", info, settings)
    preset = GUARD_PRESETS["default"]
    q = Qladder(model=info, settings=settings, ladder_config=LadderConfig(guard=preset), engines=[int4, fp32])
    guard = RecordingGuard(preset)
    q.ladder.guard = guard
    t0 = time.perf_counter()
    try:
        normal = _replay(q, load_prompts(limit=limit), max_tokens)
        normal_steps = len(guard.gaps)
        abnormal = _replay(q, load_prompts(CORPORA / "abnormal.jsonl", limit=limit), max_tokens)
    finally:
        int4.close()
        fp32.close()
    min_gap, max_abs = min(guard.gaps), max(guard.abs_max)
    max_frac, max_rest = max(guard.act_fraction, default=math.nan), max(guard.rest_peak, default=math.nan)
    by_layer = [round(v, 1) for v in guard.rest_by_layer.tolist()] if guard.rest_by_layer is not None else []
    return {
        "benchmark": "calibrate", "max_tokens": max_tokens, "wall_s": time.perf_counter() - t0,
        "normal": normal, "abnormal_unfaulted": abnormal,
        "false_handoff_rate": normal["false_handoff_rate"],
        "steps": {"normal": normal_steps, "all": len(guard.gaps), "monitored": len(guard.act_fraction)},
        "flat": {"threshold": preset.flat_gap, "min_gap": min_gap, "p001_gap": percentile(guard.gaps, 0.1),
                 "margin": min_gap / preset.flat_gap},
        "magnitude": {"threshold": preset.max_abs_logit, "max_abs_logit": max_abs,
                      "margin": preset.max_abs_logit / max_abs},
        "activation": {"threshold_fraction": preset.activation_fraction, "max_fraction": max_frac,
                       "margin": preset.activation_fraction / max_frac},
        "outlier": {"threshold": preset.outlier_limit, "max_rest_peak": max_rest,
                    "p999_rest_peak": percentile(guard.rest_peak, 99.9),
                    "margin": (preset.outlier_limit or math.nan) / max_rest,
                    "per_layer_max": by_layer,
                    "per_layer_limits_in_use": list(preset.outlier_layer_limits or ()),
                    "suggested_per_layer_limits": list(layer_limits(by_layer, OUTLIER_MARGIN,
                                                                     preset.outlier_limit)),
                    "per_layer_margin": [lim / m if m else None for lim, m in
                                         zip(preset.outlier_layer_limits or (), by_layer, strict=False)]},
        "note": "statistics over every step of both populations; rungs int4 -> fp32, default guard",
        "env": environment(settings.n_threads),
    }
