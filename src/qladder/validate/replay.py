"""The two configurations the validation compares, and one request through each.

Both run on the same serving engine (`qladder.serving`: the batched int4 context, its scheduler,
the fp32 standby), one request at a time, so the only difference between them is the defence:

bare:     the int4 engine served naively, as a plain llama.cpp server would: no sanitizer (raw
          bytes are decoded with U+FFFD replacement), the chat template, greedy decoding of every
          row as it comes (argmax of an all-NaN row returns index 0), guard "off" (no checks, no
          deadline, no watchdog), and an engine failure ends the request as a 5xx
          (`LadderPolicy.fail_on_engine_error`) instead of a handoff or the fallback; a prompt
          longer than the context is refused (a 4xx); text the tokenizer cannot encode (a lone
          surrogate) raises, a 5xx. No incident records.
guarded:  sanitizer "default" + step guard "default" + ladder int4 -> fp32, the engine's defaults.
          Any exception escaping it is counted as a 5xx, with its type.

Faults are applied identically to both (`Request.faults`, on the request's own row or slot).
`greedy` is the naive loop over a single-sequence session, kept for the boundary sweeps and the
standby replay.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qladder.config import Settings
from qladder.engines.base import Engine
from qladder.errors import InputError
from qladder.faults import Fault, FaultySession, engine_faults
from qladder.health.guard import GUARD_PRESETS
from qladder.incidents import IncidentSink
from qladder.machine import LadderConfig
from qladder.model import ModelInfo, user_prompt_ids
from qladder.policy import LadderPolicy
from qladder.sampling import SamplingParams
from qladder.service import Qladder
from qladder.serving import ServingConfig, ServingEngine
from qladder.types import FALLBACK_TEXT, FinishReason
from qladder.validate.corpora import Prompt
from qladder.validate.garbage import judge


@dataclass
class Outcome:
    """One request through one configuration."""

    config: str  # bare | guarded
    prompt_id: str
    cls: str
    population: str  # normal | abnormal
    fault: str  # fault model name, or "none"
    status: str  # ok | error (5xx) | rejected (4xx)
    error_kind: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_rungs: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    hazards: list[str] = field(default_factory=list)
    handoff_ms: list[float] = field(default_factory=list)
    fallback: bool = False
    prompt_tokens: int = 0
    wall_ms: float = 0.0
    prefill_ms: float = 0.0
    garbage: list[str] = field(default_factory=list)
    round: int = 0
    nll: float | None = None  # mean NLL of the answer under the fp32 reference, when scored
    model_own: bool = False  # garbage that fp32 alone answers too (runner.attribute_garbage)

    @property
    def per_token_ms(self) -> float | None:
        """Decode time per generated token: the request's wall time less its prefill."""
        return (self.wall_ms - self.prefill_ms) / len(self.token_ids) if self.token_ids else None

    @property
    def is_garbage(self) -> bool:
        return self.status == "ok" and bool(self.garbage)

    def judge(self, truncated: bool | None = None) -> None:
        if truncated is None:
            truncated = self.finish_reason == "length"
        if self.status != "ok" or (self.fallback and self.text == FALLBACK_TEXT):
            self.garbage = []
            return
        self.garbage = list(judge(self.text, self.token_ids, truncated, self.nll).reasons)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["text"] = self.text[:400]
        return d


def greedy(engine: Engine, ids: Sequence[int], max_tokens: int, faults: Sequence[Fault] = (),
           timings: dict[str, float] | None = None) -> list[int]:
    """Naive greedy decoding of every row as it comes. Raises EngineError from the engine.
    `timings`, when given, receives prefill_ms and decode_ms."""
    step_faults = [f for f in faults if f.kind != "gain"]
    out: list[int] = []
    with engine_faults(engine, [f for f in faults if f.kind == "gain"]):
        t0 = time.perf_counter()
        s = engine.open(list(ids))
        t1 = time.perf_counter()
        if step_faults:
            s = FaultySession(s, step_faults, len(ids))
        try:
            while len(out) < max_tokens and len(ids) + len(out) < engine.n_ctx:
                if out:  # pushed only when another row is wanted, as the ladder does
                    s.push(out[-1])
                tok = int(s.logits().argmax())
                if tok in engine.eos_ids:
                    break
                out.append(tok)
        finally:
            s.close()
        if timings is not None:
            timings["prefill_ms"] = (t1 - t0) * 1e3
            timings["decode_ms"] = (time.perf_counter() - t1) * 1e3
    return out


BARE_LADDER = LadderConfig(guard=GUARD_PRESETS["off"], policy=LadderPolicy(fail_on_engine_error=True),
                           record_incidents=False)


class Bare:
    """The int4 engine served naively (see the module docstring)."""

    name = "bare"

    def __init__(self, served: ServingEngine, info: ModelInfo):
        self.se = served
        self.info = info

    def encode(self, prompt: str | bytes) -> list[int]:
        text = prompt.decode("utf-8", "replace") if isinstance(prompt, bytes) else prompt
        return user_prompt_ids(self.info.chat_template, text, self.se.int4.tokenize)

    def prompt_ids(self, p: Prompt, max_tokens: int) -> list[int]:
        """The ids this configuration feeds its engine for a prompt (as `Guarded.prompt_ids`)."""
        return self.encode(p.prompt)

    def run(self, p: Prompt, population: str, fault_name: str, faults: Sequence[Fault],
            params: SamplingParams) -> Outcome:
        o = Outcome("bare", p.id, p.cls, population, fault_name, "ok")
        t0 = time.perf_counter()
        try:
            ids = self.encode(p.prompt)
            o.prompt_tokens = len(ids)
            if len(ids) >= self.se.int4.n_ctx:
                o.status, o.error_kind = "rejected", "context_overflow"
            else:
                r = self.se.generate_sync(self.se.request(ids, params, faults=faults, ladder=BARE_LADDER))
                o.token_ids, o.token_rungs, o.text = r.token_ids, r.token_rungs, r.text
                o.prefill_ms = r.timings.get("prefill_ms", 0.0)
                o.finish_reason = str(r.finish_reason)
                if r.finish_reason == FinishReason.ERROR:
                    detail = r.hazards[-1].detail if r.hazards else ""
                    o.status, o.error_kind = "error", f"engine_error: {detail}"[:160]
        except InputError as exc:  # a naive server does not catch the tokenizer's complaint
            o.status, o.error_kind = "error", f"unencodable_text: {exc}"[:160]
        except Exception as exc:  # anything else escaping a naive server is a 500 too
            o.status, o.error_kind = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.wall_ms = (time.perf_counter() - t0) * 1e3
        o.judge(o.finish_reason == "length")
        return o


class Guarded:
    """Sanitizer + step guard + ladder, on the serving engine (`q` only encodes prompts)."""

    name = "guarded"

    def __init__(self, served: ServingEngine, q: Qladder):
        self.se = served
        self.q = q

    def prompt_ids(self, p: Prompt, max_tokens: int) -> list[int]:
        """The ids the ladder sees for this prompt (for the fp32 reference)."""
        ids, _, _ = self.q.prepare(p.prompt, max_tokens)
        return ids

    def run(self, p: Prompt, population: str, fault_name: str, faults: Sequence[Fault],
            params: SamplingParams) -> Outcome:
        o = Outcome("guarded", p.id, p.cls, population, fault_name, "ok")
        t0 = time.perf_counter()
        try:
            ids, text, _ = self.q.prepare(p.prompt, params.max_tokens)
            r = self.se.generate_sync(self.se.request(ids, params, request_id=f"{p.id}:{fault_name}",
                                                      faults=faults, prompt_text=text))
            o.text, o.token_ids, o.token_rungs = r.text, r.token_ids, r.token_rungs
            o.finish_reason, o.fallback, o.prompt_tokens = str(r.finish_reason), r.fallback, r.prompt_tokens
            o.hazards = [h.check for h in r.hazards]
            o.prefill_ms = r.timings.get("prefill_ms", 0.0)
            o.handoff_ms = [h.latency_ms for h in r.handoffs]
        except InputError as exc:
            o.status, o.error_kind = "rejected", f"input: {exc}"[:160]
        except Exception as exc:  # a defended server must not 500: count it, with its type
            o.status, o.error_kind = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.wall_ms = (time.perf_counter() - t0) * 1e3
        o.judge(o.finish_reason == "length")
        return o


def serve(info: ModelInfo, fp32: Engine, settings: Settings, incidents: IncidentSink | None
          ) -> tuple[ServingEngine, Bare, Guarded]:
    """One serving engine (one slot, fp32 standby, faults allowed: this is the test harness) and
    the two configurations over it."""
    from qladder.sanitize import PRESETS

    se = ServingEngine(ServingConfig(slots=1, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                                     standby_threads=settings.n_threads, allow_faults=True),
                       info, settings, incidents, standby_engines=[fp32])
    q = Qladder(engines=[se.int4, fp32], model=info, settings=settings, sanitize_config=PRESETS["default"])
    return se, Bare(se, info), Guarded(se, q)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> tuple[float, float]:
    """(prefix agreement, position agreement) of greedy tokens against a reference.
    prefix: the common prefix over the reference's length; position: equal positions over the
    longer length. Both 1.0 for two empty answers."""
    n = max(len(tokens), len(reference))
    if n == 0:
        return 1.0, 1.0
    prefix = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        prefix += 1
    same = sum(1 for a, b in zip(tokens, reference, strict=False) if a == b)
    return prefix / max(len(reference), 1), same / n
