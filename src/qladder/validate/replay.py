"""The configurations the in-process validation compares, and one request through each.

Each configuration owns a serving engine of its own (`qladder.serving`: a batched int4 context, one
slot, its scheduler), built fresh for the run, so nothing one configuration did (a cached slot, a
watchdog's probe) carries into another's requests:

bare:     the int4 engine served naively, as a plain llama.cpp server would: no sanitizer, the chat
          template, greedy decoding of every row as it comes (argmax of an all-NaN row returns
          index 0), guard "off" (no checks, no deadline, no watchdog), no standby, and an engine
          failure ends the request as a 5xx (`LadderPolicy.fail_on_engine_error`); a prompt longer
          than the context is refused (a 4xx). A prompt that is not valid Unicode (raw bytes, a
          lone surrogate) is sent as its bytes' tokens (`tokenize_bytes`), as a client of a plain
          server can only send it. No incident records.
bare_aa:  a second, identical bare engine: the A/A pair that shows the latency noise floor.
guarded:  sanitizer "default" + step guard "default" + ladder int4 -> fp32 standby, the engine's
          defaults. Any exception escaping it is counted as a 5xx, with its type.

Faults are applied identically to bare and guarded (`Request.faults`, on the request's own row or
slot). `greedy` is the naive loop over a single-sequence session: the fp32 references.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from qladder.config import Settings
from qladder.engines.base import Engine
from qladder.errors import InputError
from qladder.health.guard import GUARD_PRESETS
from qladder.incidents import IncidentSink
from qladder.model import ModelInfo, user_prompt_ids, user_prompt_ids_bytes
from qladder.policy import LadderConfig, LadderPolicy
from qladder.prepare import Preparer
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.testing.faults import Fault, FaultySession, engine_faults, step_faults
from qladder.types import FinishReason, GenerationResult
from qladder.validate.corpora import Prompt
from qladder.validate.outcome import Outcome

RUN = "validate"


def greedy(engine: Engine, ids: Sequence[int], max_tokens: int, faults: Sequence[Fault] = (),
           timings: dict[str, float] | None = None) -> list[int]:
    """Naive greedy decoding of every row as it comes. Raises EngineError from the engine.
    `timings`, when given, receives prefill_ms and decode_ms."""
    steps = step_faults(faults)
    out: list[int] = []
    with engine_faults(engine, faults):  # (it takes the gain faults among them)
        t0 = time.perf_counter()
        s = engine.open(list(ids))
        t1 = time.perf_counter()
        if steps:
            s = FaultySession(s, steps, len(ids))
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


def unicode_bytes(prompt: str | bytes) -> bytes | None:
    """The raw bytes of a prompt that is not valid Unicode (bytes that do not decode, or a str with
    a lone surrogate); None for a prompt a client can send as text."""
    if isinstance(prompt, bytes):
        try:
            prompt.decode("utf-8")
            return None
        except UnicodeDecodeError:
            return prompt
    try:
        prompt.encode("utf-8")
        return None
    except UnicodeEncodeError:
        return prompt.encode("utf-8", "surrogatepass")


def as_sent(prompt: str | bytes) -> str:
    """A prompt as a client's JSON can carry it: valid UTF-8, invalid bytes and lone surrogates
    replaced (U+FFFD)."""
    raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def readable(prompt: str | bytes) -> str:
    """A prompt as valid text for the outcome record (undecodable bytes as backslash escapes)."""
    raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "backslashreplace")


def _fill(o: Outcome, r: GenerationResult) -> None:
    o.token_ids, o.rungs, o.text = list(r.token_ids), list(r.token_rungs), r.text
    o.finish_reason, o.fallback = str(r.finish_reason), r.fallback
    o.hazards = [h.check for h in r.hazards]
    o.handoff_ms = [h.latency_ms for h in r.handoffs]
    o.prefill_ms = r.timings.get("prefill_ms")
    o.ttft_ms = r.timings.get("ttft_ms")


BARE_LADDER = LadderConfig(guard=GUARD_PRESETS["off"], policy=LadderPolicy(fail_on_engine_error=True),
                           record_incidents=False)


class Bare:
    """The int4 engine served naively (see the module docstring)."""

    def __init__(self, served: ServingEngine, info: ModelInfo, name: str = "bare"):
        self.se = served
        self.info = info
        self.name = name

    def prompt_ids(self, p: Prompt, max_tokens: int = 0) -> list[int]:
        """The ids this configuration feeds its engine for a prompt."""
        raw = unicode_bytes(p.prompt)
        if raw is not None:
            return user_prompt_ids_bytes(self.info.chat_template, raw, self.se.int4.tokenize,
                                         self.se.int4.tokenize_bytes)
        text = p.prompt.decode("utf-8") if isinstance(p.prompt, bytes) else p.prompt
        return user_prompt_ids(self.info.chat_template, text, self.se.int4.tokenize)

    def run(self, p: Prompt, o: Outcome, faults: Sequence[Fault], params: SamplingParams) -> list[int]:
        """Fill `o` with one request; returns the prompt ids fed to the engine."""
        o.prompt = readable(p.prompt)
        ids: list[int] = []
        t0 = time.perf_counter()
        try:
            ids = self.prompt_ids(p)
            o.prompt_tokens = len(ids)
            if len(ids) >= self.se.int4.n_ctx:
                o.status, o.error = "rejected", "context_overflow"
            else:
                r = self.se.generate_sync(self.se.request(ids, params, faults=faults, ladder=BARE_LADDER))
                _fill(o, r)
                if r.finish_reason == FinishReason.ERROR:
                    detail = r.hazards[-1].detail if r.hazards else ""
                    o.status, o.error = "error", f"engine_error: {detail}"[:160]
        except Exception as exc:  # anything escaping a naive server is a 500
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.latency_ms = (time.perf_counter() - t0) * 1e3
        return ids


class Guarded:
    """Sanitizer + step guard + ladder, on its serving engine (`q` encodes prompts)."""

    name = "guarded"

    def __init__(self, served: ServingEngine, q: Preparer):
        self.se = served
        self.q = q

    def prompt_ids(self, p: Prompt, max_tokens: int) -> list[int]:
        """The ids the ladder sees for this prompt (after the input defence)."""
        ids, _, _ = self.q.prepare(p.prompt, max_tokens)
        return ids

    def run(self, p: Prompt, o: Outcome, faults: Sequence[Fault], params: SamplingParams) -> list[int]:
        ids: list[int] = []
        t0 = time.perf_counter()
        try:
            ids, text, reports = self.q.prepare(p.prompt, params.max_tokens)
            o.prompt, o.prompt_tokens = reports[-1].text if reports else readable(text), len(ids)  # the sanitized text
            r = self.se.generate_sync(self.se.request(ids, params, request_id=f"{p.id}:{o.fault}:{o.round}",
                                                      faults=faults, prompt_text=text))
            _fill(o, r)
        except InputError as exc:
            o.status, o.error = "rejected", f"input: {exc}"[:160]
        except Exception as exc:  # a defended server must not 500: count it, with its type
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.latency_ms = (time.perf_counter() - t0) * 1e3
        if not o.prompt:
            o.prompt = readable(p.prompt)
        return ids


def serve_bare(info: ModelInfo, settings: Settings, name: str = "bare") -> Bare:
    """A bare configuration on a serving engine of its own (no standby: nothing to hand off to)."""
    se = ServingEngine(ServingConfig(slots=1, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                                     standby_rungs=(), allow_faults=True, ladder=BARE_LADDER), info, settings)
    return Bare(se, info, name)


def serve_guarded(info: ModelInfo, fp32: Engine, settings: Settings, incidents: IncidentSink | None) -> Guarded:
    """The guarded configuration on a serving engine of its own: one slot, the fp32 standby, faults
    allowed (this is the test harness), and the audit as `qladder serve`'s defaults run it (its
    floor, its spare share within its budget: its cost is in the latency figures). Not the
    endpoint detector: the harness faults single requests on purpose, which a test for a
    persistently broken pool is meant to see (bench/detection_c8.py measures it)."""
    from qladder.sanitize import PRESETS
    from qladder.server.topology import default_pools

    int4, standby = default_pools()
    audit = int4.audit_share(standby)
    se = ServingEngine(ServingConfig(slots=1, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                                     standby_threads=settings.n_threads, allow_faults=True, audit_rate=audit,
                                     audit_spare_rate=int4.audit_spare_rate, audit_budget=int4.audit_budget),
                       info, settings, incidents, standby_engines=[fp32])
    return Guarded(se, Preparer(info, se.int4.tokenize, min(se.n_ctx), PRESETS["default"]))


def continuation_identical(answer: Sequence[int], prefix: int, reference: Sequence[int], finish: str | None) -> bool:
    """Is the answer after its first `prefix` tokens the reference continuation (fp32's greedy
    answer to prompt + answer[:prefix], for the tokens left)? One cut by max_tokens drops the tokens
    of a character it ended inside (at most 3); one the guard ended early (a confirmed loop) is the
    reference's only when it holds the whole of it: a prefix is not the continuation."""
    rest, n = list(answer[prefix:]), len(answer) - prefix
    return rest == list(reference[:n]) and (len(reference) == n
                                            or (finish == "length" and len(reference) - n <= 3))
