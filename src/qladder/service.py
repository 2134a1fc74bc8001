"""The whole request path on one process: sanitize -> chat template -> token ids -> ladder.

This is what the CLI (and later the HTTP server) calls. Engines are loaded once per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qladder.config import Settings
from qladder.engines import load_engine
from qladder.engines.base import Engine
from qladder.errors import ConfigError
from qladder.incidents import IncidentSink
from qladder.ladder import Ladder, LadderConfig
from qladder.model import Message, ModelInfo, inspect_model
from qladder.prepare import Preparer
from qladder.sampling import SamplingParams
from qladder.sanitize import PRESETS as SANITIZE_PRESETS
from qladder.sanitize import SanitizeConfig, SanitizeResult
from qladder.types import GenerationResult

if TYPE_CHECKING:
    from qladder.testing.faults import Fault


@dataclass
class Answer:
    result: GenerationResult
    sanitized: list[SanitizeResult] = field(default_factory=list)  # one per message

    def to_dict(self) -> dict[str, object]:
        d = self.result.to_dict()
        d["input_changes"] = [asdict(c) for s in self.sanitized for c in s.changes]
        return d


def parse_ladder(spec: str | Sequence[str]) -> list[str]:
    rungs = [r.strip() for r in spec.split(",")] if isinstance(spec, str) else list(spec)
    rungs = [r for r in rungs if r]
    if not rungs:
        raise ConfigError("the ladder needs at least one rung")
    if len(set(rungs)) != len(rungs):
        raise ConfigError(f"a rung appears twice in the ladder {','.join(rungs)}")
    return rungs


class Qladder:
    """Engines for the given rungs on one model, plus the defences around them."""

    def __init__(self, rungs: Sequence[str] = ("int4", "fp32"), model: str | Path | ModelInfo | None = None,
                 settings: Settings | None = None, ladder_config: LadderConfig | None = None,
                 sanitize_config: SanitizeConfig | None = None, incidents: IncidentSink | None = None,
                 engines: Sequence[Engine] | None = None):
        self.settings = settings or Settings.from_env()
        self.info = model if isinstance(model, ModelInfo) else inspect_model(model)
        names = parse_ladder(list(rungs))
        self.engines = list(engines) if engines is not None else [
            load_engine(r, self.info, self.settings) for r in names]
        self.ladder = Ladder(self.engines, ladder_config, incidents)
        self.sanitize_config = sanitize_config or SANITIZE_PRESETS["default"]

    @property
    def n_ctx(self) -> int:
        return min(e.n_ctx for e in self.engines)

    def prepare(self, prompt: str | bytes | Sequence[Message], max_tokens: int
                ) -> tuple[list[int], str, list[SanitizeResult]]:
        """Sanitize, template and tokenize (see `qladder.prepare.Preparer`)."""
        return Preparer(self.info, self.engines[0].tokenize, self.n_ctx, self.sanitize_config).prepare(
            prompt, max_tokens)

    def answer(self, prompt: str | bytes | Sequence[Message], params: SamplingParams | None = None,
               faults: Sequence[Fault] = (), request_id: str | None = None) -> Answer:
        params = params or SamplingParams()
        ids, text, reports = self.prepare(prompt, params.max_tokens)
        result = self.ladder.generate(ids, params, faults, prompt_text=text, request_id=request_id)
        return Answer(result, reports)

    def close(self) -> None:
        for e in self.engines:
            e.close()
