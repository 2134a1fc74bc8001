"""`qladder sweep`: the precision boundary, measured over quantization levels.

From the model's highest-precision weights (qladder.levels: the embedded model's are its Q4_1
dequantized, the fp32 rung's), llama.cpp's quantizer makes each level; then, for each level, on the
validate corpora's classes (normal, long math, code blocks, abnormal Unicode, raw bytes), both halves:

    bare        the level's llama.cpp engine alone, greedy: its answer, and full precision's
                teacher-forced rows on it (the audit's own computation, qladder.audit.score): top-1
                agreement, first divergence, the KL estimate over the level's top 5, fp32's
                likelihood for the judge; fp32's own greedy answer beside it (whole-answer identity)
    guarded     the same prompt through a guarded serving engine on the level (input defence, step
                guard, the fp32 standby), as `qladder validate` builds it: garbage, stopped, hazards
    throughput  a bare serving engine on each level (8 slots, no prompt cache), windows at c1 and
                c8, the levels' order rotated each round; the RSS each engine added

The judge is the committed calibration (validate/judge_calibration.json, calibrated on a validate
run's train half), fixed before the run. Every figure is computed from outcomes.jsonl by
`qladder.validate.sweep_figures`, which `python -m qladder.validate.sweep_figures DIR` runs again.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qladder.environment import rss_mb, snapshot
from qladder.levels import SWEEP_LEVELS, check_level, describe, full_precision_gguf, level_gguf, level_name
from qladder.model import ModelInfo, user_prompt_ids, user_prompt_ids_bytes
from qladder.validate.corpora import NORMAL_CLASSES, Prompt, load_corpora
from qladder.validate.outcome import Outcome
from qladder.validate.replay import readable, unicode_bytes
from qladder.validate.runner import Progress

RUN = "sweep"
# abnormal classes swept, and how many prompts of each half (train, test)
FULL_ABNORMAL = {"long_math": 5, "code_block": 5, "control_bytes": 5, "unicode_zero_width_bidi_homoglyph": 5}
QUICK_ABNORMAL = {"long_math": 1, "code_block": 1, "control_bytes": 1, "unicode_zero_width_bidi_homoglyph": 1}


@dataclass(frozen=True)
class SweepConfig:
    levels: tuple[str, ...] = SWEEP_LEVELS
    quick: bool = False
    normal_per_half: int = 3  # of each normal class (chat, qa, code, math), in each half
    abnormal_per_half: dict[str, int] = field(default_factory=lambda: dict(FULL_ABNORMAL))
    max_tokens: int = 24  # (sized for 30 minutes on 2 cores; validate's answers are 32)
    throughput_rounds: int = 2
    throughput_requests: int = 8  # per window (c8: one request per slot)
    throughput_tokens: int = 32
    threads: int | None = None  # of each engine; None: the settings' (QLADDER_THREADS)
    n_ctx: int = 2048
    reference_level: str = "Q8_0"  # the default bound: this level's, from the train half
    min_agreement: float | None = None  # a bound the user sets instead (teacher-forced top-1, per class)
    max_garbage: float | None = None  # ... and the bare garbage rate's, per class
    seed: int = 0
    model: Path | None = None  # None: the embedded model

    @classmethod
    def quick_preset(cls, **kw: Any) -> SweepConfig:
        base = cls(quick=True, normal_per_half=1, abnormal_per_half=dict(QUICK_ABNORMAL), max_tokens=16,
                   throughput_rounds=1, throughput_requests=8, throughput_tokens=16, n_ctx=1024)
        return dataclasses.replace(base, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = str(self.model) if self.model else None
        return d


def select(cfg: SweepConfig) -> list[Prompt]:
    """The first prompts of each class in each half (normal: every class of NORMAL_CLASSES)."""
    normal, abnormal = load_corpora(None)
    want = {**{c: cfg.normal_per_half for c in NORMAL_CLASSES}, **cfg.abnormal_per_half}
    out: list[Prompt] = []
    for p in [*normal, *abnormal]:
        n = want.get(p.cls, 0)
        if sum(q.cls == p.cls and q.split == p.split for q in out) < n:
            out.append(p)
    return out


def prompt_ids(info: ModelInfo, engine: Any, p: Prompt) -> list[int]:
    """The ids a plain client's server feeds its engine (the chat template, no input defence;
    raw bytes as their bytes' tokens), as validate's bare configuration does."""
    raw = unicode_bytes(p.prompt)
    if raw is not None:
        return user_prompt_ids_bytes(info.chat_template, raw, engine.tokenize, engine.tokenize_bytes)
    text = p.prompt.decode("utf-8") if isinstance(p.prompt, bytes) else p.prompt
    return user_prompt_ids(info.chat_template, text, engine.tokenize)


def greedy_top(engine: Any, ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[Any]]:
    """Greedy decoding on a single-sequence session, with each accepted token's top 5 (id, logprob)."""
    from qladder.audit import top_k

    out: list[int] = []
    top: list[Any] = []
    s = engine.open(list(ids))
    try:
        while len(out) < max_tokens and len(ids) + len(out) < engine.n_ctx:
            if out:
                s.push(out[-1])
            row = s.logits()
            tok = int(row.argmax())
            if tok in engine.eos_ids:
                break
            out.append(tok)
            top.append(top_k(row))
    finally:
        s.close()
    return out, top


class _Scorer:
    """fp32's teacher-forced work, each (ids, answer) once: rows -> the audit's record and the
    judge's mean log-likelihood; fp32's own greedy answers. Used only while no serving engine
    holds the fp32 engine (one owner at a time)."""

    def __init__(self, fp32: Any, max_tokens: int):
        self.fp32, self.max_tokens = fp32, max_tokens
        self._refs: dict[tuple[int, ...], list[int]] = {}
        self._rows: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}  # the last answer's rows only

    def reference(self, ids: Sequence[int]) -> list[int]:
        from qladder.validate.replay import greedy

        key = tuple(ids)
        if key not in self._refs:
            self._refs[key] = greedy(self.fp32, ids, self.max_tokens)
        return self._refs[key]

    def audit(self, o: Outcome, ids: Sequence[int], top: Sequence[Any]) -> None:
        """The audit's scores of the answer in `o` (top: the level's top 5 at each token; () none)."""
        import torch

        from qladder.audit import AuditJob, score
        from qladder.validate.garbage import mean_nll

        if not o.token_ids:
            o.fp32_nll, o.score_failed = None, False
            return
        key = (tuple(ids), tuple(o.token_ids))
        try:
            if key not in self._rows:
                self._rows = {key: self.fp32.rows(ids, o.token_ids)}  # (bare and guarded often agree)
            rows = self._rows[key]
        except Exception:  # counted: unjudged unless a symptom decides
            o.fp32_nll, o.score_failed = None, True
            return
        logp = torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(o.token_ids).unsqueeze(1)).squeeze(1)
        o.fp32_nll, o.score_failed = mean_nll(logp.tolist()), False
        rec = score(AuditJob(f"{o.level}:{o.prompt_id}", o.prompt_class, o.config, tuple(ids), tuple(o.token_ids),
                             tuple(top)), rows)
        o.fp32_top1_agreement, o.fp32_first_divergence = rec.agreement, rec.first_divergence
        o.kl_top5 = rec.kl_top5 if top else None


def _outcome(level: str, config: str, p: Prompt, phase: str = "sweep") -> Outcome:
    return Outcome(RUN, config, p.id, p.cls, "normal" if p.cls in NORMAL_CLASSES else "abnormal", phase=phase,
                   split=p.split, prompt=readable(p.prompt), level=level)


def quality(level: str, info: ModelInfo, fp32: Any, settings: Any, prompts: Sequence[Prompt], cfg: SweepConfig,
            scorer: _Scorer, tick: Callable[[], None]) -> list[Outcome]:
    """One level's answers: guarded (its serving engine holds fp32 as its standby meanwhile), then
    bare on the level's engine alone, then fp32's scores of both."""
    from qladder.engines.llamacpp import LlamaCppEngine
    from qladder.sampling import SamplingParams
    from qladder.validate.replay import serve_guarded

    params = SamplingParams(max_tokens=cfg.max_tokens, seed=cfg.seed)
    guarded = serve_guarded(info, fp32, settings, None)
    out: list[tuple[Outcome, list[int], Sequence[Any]]] = []
    try:
        for p in prompts:
            o = _outcome(level, "guarded", p)
            ids = guarded.run(p, o, [], params)
            out.append((o, ids, ()))
            tick()
    finally:
        guarded.se.close()
    engine = LlamaCppEngine(info, n_ctx=settings.n_ctx, n_threads=settings.n_threads, name=level)
    try:
        for p in prompts:
            o = _outcome(level, "bare", p)
            t0 = time.perf_counter()
            ids = prompt_ids(info, engine, p)
            o.prompt_tokens = len(ids)
            top: list[Any] = []
            if len(ids) >= engine.n_ctx:
                o.status, o.error = "rejected", "context_overflow"
            else:
                o.token_ids, top = greedy_top(engine, ids, cfg.max_tokens)
                o.text = engine.detokenize(o.token_ids)
                o.rungs = [level] * len(o.token_ids)
                o.finish_reason = "length" if len(o.token_ids) >= cfg.max_tokens else "stop"
            o.latency_ms = (time.perf_counter() - t0) * 1e3
            out.append((o, ids, top))
            tick()
    finally:
        engine.close()
    n = len(prompts)
    for o, ids, tops in [x for i in range(n) for x in (out[n + i], out[i])]:  # a prompt's bare, then guarded
        if o.ok and ids:
            scorer.audit(o, ids, tops)
            o.fp32_reference_ids = scorer.reference(ids)
    return [o for o, _, _ in out]


def throughput(levels: dict[str, ModelInfo], settings: Any, prompts: Sequence[Prompt], cfg: SweepConfig,
               tick: Callable[[], None], memory: dict[str, float]) -> list[Outcome]:
    """Closed-loop windows at c1 and c8 on a bare serving engine per level (all loaded at once),
    the levels' order rotated each round; each window `throughput_requests` requests."""
    from qladder.sampling import SamplingParams
    from qladder.serving import ServingConfig, ServingEngine
    from qladder.serving.scheduler import SchedulerConfig
    from qladder.validate.replay import BARE_LADDER

    params = SamplingParams(max_tokens=cfg.throughput_tokens, seed=cfg.seed)
    engines: dict[str, Any] = {}
    out: list[Outcome] = []
    t_run = time.perf_counter()
    try:
        for level, info in levels.items():
            before = rss_mb()
            engines[level] = ServingEngine(ServingConfig(
                slots=8, n_ctx=min(settings.n_ctx, 1024), int4_threads=settings.n_threads, standby_rungs=(),
                ladder=BARE_LADDER, scheduler=SchedulerConfig(prompt_cache_bytes=0)), info, settings)
            se = engines[level]
            se.generate_sync(se.request(prompt_ids(info, se.int4, prompts[0]), params))  # touch the weights
            memory[level] = rss_mb() - before
        names = list(levels)
        lock = threading.Lock()  # guards `out` (the pool's threads append to it)
        for r in range(cfg.throughput_rounds):
            k = r % len(names)
            for level in [*names[k:], *names[:k]]:
                se, info = engines[level], levels[level]
                for c in (1, 8):
                    window = f"r{r}"

                    def one(p: Prompt, se: Any = se, info: ModelInfo = info, level: str = level, c: int = c,
                            window: str = window) -> None:
                        o = _outcome(level, "throughput", p, "throughput")
                        o.concurrency, o.window = c, window
                        ids = prompt_ids(info, se.int4, p)
                        o.prompt_tokens = len(ids)
                        o.start_s = time.perf_counter() - t_run
                        try:
                            res = se.generate_sync(se.request(ids, params))
                            o.token_ids, o.finish_reason = list(res.token_ids), str(res.finish_reason)
                        except Exception as exc:  # counted: an error, the slowest latency
                            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
                        o.end_s = time.perf_counter() - t_run
                        o.latency_ms = (o.end_s - o.start_s) * 1e3
                        with lock:
                            out.append(o)

                    batch = [prompts[(r * cfg.throughput_requests + i) % len(prompts)]
                             for i in range(cfg.throughput_requests)]
                    with ThreadPoolExecutor(c) as pool:
                        list(pool.map(one, batch))
                    tick()
    finally:
        for se in engines.values():
            se.close()
    return out


def sweep(cfg: SweepConfig, out_dir: Path, show_progress: bool = True,
          log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Make the levels, run every phase, write outcomes.jsonl, levels.json, results.json (every
    figure from outcomes.jsonl), report.md and boundary.png."""
    from qladder.config import Settings
    from qladder.engines import load_engine
    from qladder.model import inspect_model
    from qladder.validate.calibration import committed
    from qladder.validate.outcome import read_jsonl, write_jsonl
    from qladder.validate.sweep_figures import figures, write_report

    for level in cfg.levels:
        check_level(level)
    if cfg.reference_level not in cfg.levels:
        from qladder.errors import ConfigError

        raise ConfigError(f"the reference level {cfg.reference_level} is not among the levels swept")
    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings.from_env()
    settings = dataclasses.replace(settings, n_ctx=cfg.n_ctx,
                                   n_threads=cfg.threads if cfg.threads is not None else settings.n_threads)
    info = inspect_model(cfg.model, settings.cache_dir)
    prompts = select(cfg)
    total = len(cfg.levels) * (1 + 2 * len(prompts)) + 1 + cfg.throughput_rounds * len(cfg.levels) * 2
    progress = Progress(total, show_progress)
    outcomes: list[Outcome] = []
    memory: dict[str, float] = {}
    made: dict[str, Any] = {}
    try:
        progress.phase("making levels (llama.cpp)")
        source = full_precision_gguf(info, settings.cache_dir)
        levels: dict[str, ModelInfo] = {}
        for level in cfg.levels:
            t = time.perf_counter()
            path = level_gguf(info, level, settings.cache_dir, threads=settings.n_threads)
            levels[level] = inspect_model(path, settings.cache_dir)
            made[level] = {**describe(level, path).to_dict(), "made_or_found_s": time.perf_counter() - t}
            progress.tick()
        env = snapshot(settings.n_threads, settings.n_ctx)
        fp32 = load_engine("fp32", info, settings)
        progress.tick()
        scorer = _Scorer(fp32, cfg.max_tokens)
        try:
            for level in cfg.levels:
                progress.phase(f"answers {level}")
                outcomes += quality(level, levels[level], fp32, settings, prompts, cfg, scorer, progress.tick)
        finally:
            fp32.close()
        progress.phase("throughput (c1, c8)")
        outcomes += throughput(levels, settings, [p for p in prompts if p.cls in NORMAL_CLASSES], cfg,
                               progress.tick, memory)
    finally:
        progress.close()
    threshold = committed().threshold
    for o in outcomes:
        o.judge(o.score, o.score_failed, threshold)
    write_jsonl(out_dir / "outcomes.jsonl", outcomes)
    for level, mb in memory.items():
        made[level]["serving_engine_rss_mb"] = mb
    head = {"kind": "sweep", "config": cfg.to_dict(), "environment": env, "model": str(info.path),
            "source": {"path": str(source), **describe("source", source).to_dict(),
                       "dequantized_from": None if source == info.path else level_name(info.file_type)},
            "levels": made,
            "judge": {**committed().to_dict(), "note": "the committed calibration, fixed before the run"},
            "elapsed_s": time.perf_counter() - t_start, "phase_durations_s": progress.durations}
    (out_dir / "levels.json").write_text(json.dumps(head, indent=2, ensure_ascii=False, default=str))
    results = {**head, "figures": figures(read_jsonl(out_dir / "outcomes.jsonl"), made, cfg.to_dict())}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    write_report(results, out_dir)
    log(f"wrote {out_dir / 'outcomes.jsonl'}, levels.json, results.json, report.md, boundary.png")
    return results

