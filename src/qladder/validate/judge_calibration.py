"""The committed calibration of the judge (judge_calibration.json, the committed full run's: see
validate/calibration.py for how one is derived), and its record. The judge reads it for any
answer judged without a run's own calibration."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

COMMITTED = Path(__file__).with_name("judge_calibration.json")


@dataclass(frozen=True)
class Calibration:
    threshold: float  # an answer scoring over it is implausible
    quantile: float
    margin: float
    answers: int  # distinct train-half normal answers it was read from
    quantile_nll: float  # their QUANTILE
    source: str  # "this run" or where the committed one came from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def committed() -> Calibration:
    return Calibration(**json.loads(COMMITTED.read_text(encoding="utf-8")))
