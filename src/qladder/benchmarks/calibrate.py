"""`qladder bench calibrate`: the guard's thresholds against clean traffic, and the false-handoff rate.

Replays normal prompts (corpora/normal.jsonl) through the production ladder (int4 -> fp32, default
guard) and records, for every step on every rung, the statistics the guard thresholds: the row's
`max - mean` gap (the flat check), its largest |logit| (magnitude) and the per-layer activation
peaks against the dtype's limit. Reports their extremes next to the preset's thresholds (the
margin each keeps), which checks fired, and the share of clean requests that climbed a rung.
"""

from __future__ import annotations

import json
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
from qladder.ladder import Ladder, LadderConfig
from qladder.model import encode_segments, inspect_model, render_chat
from qladder.sampling import SamplingParams
from qladder.types import FinishReason, Hazard

CORPUS = Path(__file__).resolve().parents[3] / "corpora" / "normal.jsonl"


class RecordingGuard(StepGuard):
    """The default guard, plus a record of the statistics behind each verdict (calibration only)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.gaps: list[float] = []
        self.abs_max: list[float] = []
        self.act_fraction: list[float] = []

    def check(self, row: torch.Tensor, generated: Sequence[int], rung: str,
              activation_peaks: torch.Tensor | None = None,
              activation_limit: float | None = None) -> Hazard | None:
        hi, lo, total = float(row.amax()), float(row.amin()), float(row.sum())
        if math.isfinite(total):
            self.gaps.append(hi - total / row.numel())
            self.abs_max.append(max(abs(hi), abs(lo)))
        if activation_peaks is not None and activation_limit:
            self.act_fraction.append(float(activation_peaks.max()) / activation_limit)
        return super().check(row, generated, rung, activation_peaks, activation_limit)


def load_prompts(path: Path = CORPUS, limit: int | None = None) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


def run_calibration(limit: int | None = None, max_tokens: int = 48) -> dict[str, Any]:
    settings = Settings.from_env()
    info = inspect_model()
    int4, fp32 = load_engine("int4", info, settings), load_engine("fp32", info, settings)
    preset = GUARD_PRESETS["default"]
    ladder = Ladder([int4, fp32], LadderConfig(guard=preset))
    guard = RecordingGuard(preset)
    ladder.guard = guard
    prompts = load_prompts(limit=limit)
    climbed, finishes, checks = 0, Counter[str](), Counter[str]()
    t0 = time.perf_counter()
    try:
        for p in prompts:
            ids = encode_segments(render_chat(info.chat_template, [{"role": "user", "content": p}]), int4.tokenize)
            r = ladder.generate(ids, SamplingParams(max_tokens=max_tokens))
            climbed += bool(r.handoffs)
            finishes[str(r.finish_reason)] += 1
            checks.update(h.check for h in r.hazards)
    finally:
        int4.close()
        fp32.close()
    n = len(prompts)
    min_gap = min(guard.gaps)
    out: dict[str, Any] = {
        "benchmark": "calibrate", "prompts": n, "max_tokens": max_tokens, "steps": len(guard.gaps),
        "wall_s": time.perf_counter() - t0,
        "false_handoff_rate": climbed / n, "requests_with_handoff": climbed,
        "finish_reasons": dict(finishes), "hazards_by_check": dict(checks),
        "repetition_stops": finishes[str(FinishReason.REPETITION)],
        "flat": {"threshold": preset.flat_gap, "min_gap": min_gap, "p001_gap": percentile(guard.gaps, 0.1),
                 "margin": min_gap / preset.flat_gap},
        "magnitude": {"threshold": preset.max_abs_logit, "max_abs_logit": max(guard.abs_max),
                      "margin": preset.max_abs_logit / max(guard.abs_max)},
        "activation": {"threshold_fraction": preset.activation_fraction,
                       "max_fraction": max(guard.act_fraction, default=float("nan")),
                       "margin": preset.activation_fraction / max(guard.act_fraction, default=float("nan"))},
        "env": environment(settings.n_threads),
    }
    return out
