"""The whole `qladder validate` run: load once, replay, sweep, model, write results and report.

Phases, in order (one process; each configuration on a serving engine of its own, see replay.py):
    warm-up         a few requests through each configuration (written, never counted)
    normal          normal prompts, no fault, `rounds` times, bare, bare_aa (the A/A copy) and
                    guarded, the order rotated per prompt and round (latency, false handoffs)
    abnormal        abnormal prompts, no fault, bare and guarded
    faulted         each fault set's (prompt, model) pairs: the train models on the train half of
                    the abnormal prompts, the held-out test models on the test half
    judge           every answer's symptoms and fp32 likelihood (a scoring failure: unjudged)
    references      fp32 alone, greedy, on the same prompt ids (is a garbage answer fp32's own?),
                    and fp32's continuation of each guarded faulted answer's int4 prefix
    precision       the gain sweep over int4, w4a16, fp32
    latency         the check levels, and the fp32 activation monitors' cost
    availability    the standby queueing model from the measured service times, and its simulation

outcomes.jsonl holds every request; results.json's figures are computed from that file
(`qladder.validate.recompute`); the sweeps and the queueing model go to boundaries.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qladder.environment import load_average, peak_rss_mb, rss_mb, snapshot
from qladder.model import user_prompt_ids
from qladder.percentiles import mean
from qladder.validate import queueing
from qladder.validate.boundaries import LEVELS
from qladder.validate.corpora import Prompt, load_corpora, subset
from qladder.validate.fault_models import FAULT_SETS, FaultModel, assign, by_name
from qladder.validate.outcome import Outcome
from qladder.validate.precision_table import MODES, Runner, known_prompts, run_table
from qladder.validate.replay import RUN, Bare, Guarded, greedy

if TYPE_CHECKING:
    from qladder.sampling import SamplingParams

QUICK_ABNORMAL = {"long_math": 2, "code_block": 2, "control_bytes": 2, "unicode_zero_width_bidi_homoglyph": 2,
                  "emoji_zwj": 2, "long_repeat": 2, "over_long": 1}
# The full run, sized for 45 minutes on 2 cores: int4 prefill (~140 tokens/s here) dominates the
# abnormal prompts, so the classes of long prompts (code blocks ~9 s a request, long math and emoji
# ~5 s, over-long ~10 s) use their first items; the short classes run whole.
FULL_ABNORMAL = {"long_math": 10, "code_block": 10, "control_bytes": 15, "unicode_zero_width_bidi_homoglyph": 15,
                 "emoji_zwj": 10, "long_repeat": 15, "over_long": 3}
SWEEP_PROMPTS = ("Compute 17*23.", "What is the capital of France?", "Name three colors.",
                 "Write a haiku about rain.")


@dataclass(frozen=True)
class ValidateConfig:
    quick: bool = False
    max_tokens: int = 32
    normal_per_class: int = 56
    abnormal_per_class: dict[str, int] | int = field(default_factory=lambda: dict(FULL_ABNORMAL))
    fault_names: tuple[str, ...] = ()
    prompts_per_fault: int = 5
    rounds: int = 5  # 224 normal prompts x 5: >= 500 requests per side for the pooled P99, medians of 5
    warmup: int = 2
    reference_prompts: int | None = 48  # normal prompts answered by fp32 for agreement (None: all)
    sweep_xs: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
    sweep_prompts: int = 4
    sweep_tokens: int = 16
    level_prompts: int = 6
    level_rounds: int = 3
    level_tokens: int = 32
    monitor_rounds: int = 2
    monitor_tokens: int = 8
    n_ctx: int | None = None  # None: the settings' (QLADDER_N_CTX, default 2048)
    threads: int | None = None  # of each engine; None: the settings' (QLADDER_THREADS, default 1)
    servers: int = 10
    standby_share: float = 0.2
    primary_util: float = 0.7
    replay_servers: int = 1  # standby workers of the concurrent replay (this machine: 2 cores)
    replay_utilizations: tuple[float, ...] = (0.5, 0.8)
    replay_jobs: int = 20  # handoffs replayed per point
    replay_max_tokens: int | None = 16  # cap on the fp32 tokens of a replayed handoff
    seed: int = 0
    corpus_dir: Path | None = None
    # the precision table (validate/precision_table.py): normal prompts per class, abnormal prompts,
    # known-answer questions (None: all of them), through int4, guarded, w4a16, verified and fp32
    precision_per_class: int = 4
    precision_abnormal: int = 8
    precision_known: int | None = None
    precision_w4a16: int | None = 12  # W4A16 answers only the first N normal/known prompts (fp16 on a CPU is slow)

    @classmethod
    def quick_preset(cls, **kw: Any) -> ValidateConfig:
        base = cls(quick=True, max_tokens=24, normal_per_class=3, abnormal_per_class=QUICK_ABNORMAL,
                   prompts_per_fault=1, rounds=2, warmup=2, reference_prompts=8, sweep_prompts=1,
                   sweep_tokens=8, level_prompts=3, level_rounds=2, level_tokens=12, n_ctx=512,
                   replay_jobs=8, replay_max_tokens=4, precision_per_class=1, precision_abnormal=2,
                   precision_known=8, precision_w4a16=2)
        return dataclasses.replace(base, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["corpus_dir"] = str(self.corpus_dir) if self.corpus_dir else None
        return d


class Progress:
    """A rich progress bar on stderr (or nothing): one bar for the whole run, a label per phase."""

    def __init__(self, total: int, enabled: bool):
        self._p = None
        self.durations: dict[str, float] = {}
        self._current: tuple[str, float] | None = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._p = RichProgress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), console=Console(stderr=True), transient=False,
                                   refresh_per_second=2)  # its render thread: noise in the timings
            self._p.start()
            self._task = self._p.add_task("starting", total=total)

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self._current is not None:
            self.durations[self._current[0]] = now - self._current[1]
        self._current = (name, now)
        if self._p is not None:
            self._p.update(self._task, description=name)

    def tick(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def close(self) -> None:
        self.phase("done")
        if self._p is not None:
            self._p.stop()


@dataclass
class Run:
    cfg: ValidateConfig
    normal: list[Prompt]
    abnormal: list[Prompt]
    models: list[FaultModel]
    engines: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)  # the prompt ids each outcome fed its engine
    times: dict[str, float] = field(default_factory=dict)
    cleanup: list[Path] = field(default_factory=list)  # temporary folders (patched GGUF copies)
    patches: dict[str, dict[str, object]] = field(default_factory=dict)  # what each copy changed
    standby: dict[str, Any] = field(default_factory=dict)  # the concurrent standby replay
    configs: dict[str, Bare | Guarded] = field(default_factory=dict)  # bare, bare_aa, guarded
    patched: dict[str, tuple[Bare, Guarded]] = field(default_factory=dict)  # fault model -> configs
    served: list[Any] = field(default_factory=list)  # serving engines to close

    def total_steps(self) -> int:
        c = self.cfg
        n_fault = sum(len(self.assignments(fs)) for fs in FAULT_SETS)
        sweep = min(c.sweep_prompts, len(SWEEP_PROMPTS)) * len(c.sweep_xs) * 3
        n_levels = min(c.level_prompts, len(self.normal))
        levels = n_levels * c.level_rounds * len(LEVELS) + min(2, n_levels) * c.monitor_rounds * 2
        return (3 + 3 * c.warmup + 3 * len(self.normal) * c.rounds + 2 * len(self.abnormal) + 2 * n_fault
                + 3 + sweep + levels + len(c.replay_utilizations) + 1 + len(MODES) * len(self.precision_set()))

    def precision_set(self) -> list[Prompt]:
        c = self.cfg
        normal = subset(self.normal, c.precision_per_class)
        abnormal = [p for p in self.abnormal if p.cls != "over_long"][: c.precision_abnormal]
        abnormal = [Prompt(p.id, "abnormal", p.prompt) for p in abnormal]
        return [*normal, *abnormal, *known_prompts(c.precision_known)]

    def reference_set(self) -> list[Prompt]:
        n = self.cfg.reference_prompts
        return self.normal if n is None else self.normal[:n]

    def assignments(self, fault_set: str) -> list[tuple[Prompt, FaultModel]]:
        """(prompt, model) pairs of one fault set: its models on the abnormal prompts of its half
        (over-long prompts take no fault: their fp32 catch-up prefill would dominate the run)."""
        pool = [p for p in self.abnormal if p.split == fault_set]
        models = [m for m in self.models if m.fault_set == fault_set]
        skip = [i for i, p in enumerate(pool) if p.cls == "over_long"]
        return [(pool[a.prompt_index], a.model) for a in assign(len(pool), models, self.cfg.prompts_per_fault,
                                                                  skip, [p.cls for p in pool])]


def select(cfg: ValidateConfig) -> tuple[list[Prompt], list[Prompt]]:
    normal, abnormal = load_corpora(cfg.corpus_dir)
    return subset(normal, cfg.normal_per_class), subset(abnormal, cfg.abnormal_per_class)


def load_engines(run: Run, progress: Progress) -> None:
    from qladder.config import Settings
    from qladder.engines import load_engine
    from qladder.model import inspect_model

    progress.phase("loading engines")
    settings = Settings.from_env()
    if run.cfg.n_ctx is not None:
        settings = dataclasses.replace(settings, n_ctx=run.cfg.n_ctx)
    if run.cfg.threads is not None:
        settings = dataclasses.replace(settings, n_threads=run.cfg.threads)
    run.engines["info"] = inspect_model()
    run.engines["settings"] = settings
    run.memory["baseline"] = rss_mb()
    probe = None
    for rung in ("int4", "fp32", "w4a16"):
        t = time.perf_counter()
        before = rss_mb()
        engine = run.engines[rung] = load_engine(rung, run.engines["info"], settings)
        run.times[f"load_{rung}_s"] = time.perf_counter() - t
        probe = probe or user_prompt_ids(run.engines["info"].chat_template, "Say hello.", engine.tokenize)
        greedy(engine, probe, 2)  # touch the weights (mmap, lazy allocation) before reading RSS
        run.memory[f"{rung}_engine"] = rss_mb() - before
        progress.tick()


def build_configs(run: Run, store: Any) -> None:
    """bare, bare_aa and guarded, each on a serving engine of its own, loaded now; the RSS each adds."""
    from qladder.validate.replay import serve_bare, serve_guarded

    e = run.engines
    for name in ("bare", "bare_aa", "guarded"):
        before = rss_mb()
        cfg = serve_guarded(e["info"], e["fp32"], e["settings"], store) if name == "guarded" \
            else serve_bare(e["info"], e["settings"], name)
        run.served.append(cfg.se)
        run.configs[name] = cfg
        run.memory[f"{name}_serving_engine"] = rss_mb() - before


def patched_configs(run: Run, model: FaultModel) -> tuple[Bare, Guarded]:
    """Bare and guarded on serving engines of their own loaded on a patched copy of the GGUF (built once)."""
    import tempfile

    from qladder.testing.gguf_patch import GGUF_PATCHES
    from qladder.validate.replay import serve_bare, serve_guarded

    if model.name not in run.patched:
        e = run.engines
        tmp = Path(tempfile.mkdtemp(prefix="qladder-patched-"))
        run.cleanup.append(tmp)
        dst = tmp / f"{model.name}.gguf"
        run.patches[model.name] = GGUF_PATCHES[model.patch](e["info"].path, dst, **dict(model.gguf_patch or ()))
        # gguf_patch writes the source's metadata unchanged: the copy's ModelInfo is the source's
        # at the copy's path (parsing the copy's vocabulary again took ~5 s a copy).
        info = dataclasses.replace(e["info"], path=dst.resolve())
        b = serve_bare(info, e["settings"])
        g = serve_guarded(info, e["fp32"], e["settings"], run.configs["guarded"].se.incidents)
        run.served += [b.se, g.se]
        run.patched[model.name] = (b, g)
    return run.patched[model.name]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic collector paused for one timed request, as `timeit` does, and let run right
    after it: a collection, slow because of the harness's own growing result set, is then not
    billed to whichever configuration happened to trigger it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def one(run: Run, cfg: Bare | Guarded, p: Prompt, phase: str, params: SamplingParams, rnd: int = 0,
        model: FaultModel | None = None) -> Outcome:
    """One request through one configuration, with the collector paused; recorded."""
    o = Outcome(RUN, cfg.name, p.id, p.cls, "normal" if phase in ("normal", "warmup") else "abnormal",
                fault=model.name if model else None, round=rnd, phase=phase, split=p.split,
                fault_set=model.fault_set if model else None)
    with paused_gc():
        ids = cfg.run(p, o, model.faults if model else [], params)
    run.outcomes.append(o)
    run.ids.append(ids)
    return o


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= len(items)
    return [*items[k:], *items[:k]]


def replay(run: Run, progress: Progress) -> None:
    """Warm-up; normal rounds (bare, bare_aa and guarded, the order rotated per prompt and round);
    abnormal prompts; each fault set's (prompt, model) pairs, bare and guarded."""
    from qladder.sampling import SamplingParams

    c = run.cfg
    params = SamplingParams(max_tokens=c.max_tokens, seed=c.seed)
    trio = [run.configs[n] for n in ("bare", "bare_aa", "guarded")]
    progress.phase("warm-up")
    for i in range(c.warmup):
        for cfg in trio:
            one(run, cfg, run.normal[i % len(run.normal)], "warmup", params)
            progress.tick()
    gc.collect()
    gc.freeze()  # engines, tokenizers and corpora: out of every later collection's way
    progress.phase("normal (bare, A/A, guarded)")
    t = time.perf_counter()
    for r in range(c.rounds):
        for i, p in enumerate(run.normal):
            for cfg in _rotated(trio, r + i):
                one(run, cfg, p, "normal", params, r)
                progress.tick()
    run.times["normal_s"] = time.perf_counter() - t
    pair = [run.configs["bare"], run.configs["guarded"]]
    progress.phase("abnormal (no fault)")
    for i, p in enumerate(run.abnormal):
        for cfg in _rotated(pair, i):
            one(run, cfg, p, "abnormal", params)
            progress.tick()
    progress.phase("faulted (train, test)")
    t = time.perf_counter()
    for fs in FAULT_SETS:
        for i, (p, model) in enumerate(run.assignments(fs)):
            configs = pair if model.gguf_patch is None else list(patched_configs(run, model))
            for cfg in _rotated(configs, i):
                one(run, cfg, p, "faulted", params, model=model)
                progress.tick()
    run.times["faulted_s"] = time.perf_counter() - t


def precision(run: Run, progress: Progress) -> None:
    """The precision table's answers (validate/precision_table.py): every prompt's ids from the
    guarded configuration's input defence, through the five modes, one request at a time."""
    from qladder.sampling import SamplingParams
    from qladder.validate.replay import _fill

    progress.phase("precision table (int4, guarded, w4a16, verified, fp32)")
    e, c = run.engines, run.cfg
    params = SamplingParams(max_tokens=c.max_tokens, seed=c.seed)
    bare, guarded = run.configs["bare"], run.configs["guarded"]
    assert isinstance(guarded, Guarded)

    def served(se: Any, verified: bool = False) -> Runner:
        def go(ids: list[int], o: Outcome) -> list[int]:
            _fill(o, se.generate_sync(se.request(ids, params, verified=verified)))
            return o.token_ids
        return go

    def alone(engine: Any) -> Runner:
        def go(ids: list[int], o: Outcome) -> list[int]:
            answer = greedy(engine, ids, c.max_tokens)
            o.text, o.rungs, o.finish_reason = engine.detokenize(answer), [engine.name] * len(answer), "stop"
            return answer
        return go

    runners = {"int4": served(bare.se), "guarded": served(guarded.se), "verified": served(guarded.se, True),
               "w4a16": alone(e["w4a16"]), "fp32": alone(e["fp32"])}
    prompts = []
    for p in run.precision_set():
        ids, _, _ = guarded.q.prepare(p.prompt, c.max_tokens)
        prompts.append((p, ids))
    t = time.perf_counter()
    w4a16 = [p.id for p, _ in prompts if p.cls != "abnormal"][: c.precision_w4a16]
    with paused_gc():
        outs = run_table(prompts, runners, e["fp32"], RUN, progress.tick, only={"w4a16": set(w4a16)})
    run.outcomes += outs
    run.ids += [ids for p, ids in prompts for m in MODES if m != "w4a16" or p.id in w4a16]
    run.times["precision_table_s"] = time.perf_counter() - t


def counted(run: Run) -> list[tuple[Outcome, list[int]]]:
    return [(o, ids) for o, ids in zip(run.outcomes, run.ids, strict=True) if o.phase != "warmup"]


def judge_all(run: Run, progress: Progress) -> None:
    """Every answer scored: its fp32 likelihood given the ids its configuration fed the engine
    (identical pairs scored once; a scoring failure leaves the answer unjudged unless a symptom
    decides), then judged with the threshold the train half's normal answers give
    (calibration.rejudge, which recompute calls again on what it reads)."""
    from qladder.validate.calibration import rejudge
    from qladder.validate.garbage import mean_nll

    progress.phase("judge (fp32 likelihood)")
    fp32 = run.engines["fp32"]
    cache: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
    t = time.perf_counter()
    for o, ids in zip(run.outcomes, run.ids, strict=True):
        if not o.ok or not o.token_ids or o.fallback or o.phase in ("warmup", "precision"):
            o.fp32_nll, o.score_failed = None, False  # the precision table's answers are compared with fp32's
            continue
        key = (tuple(ids), tuple(o.token_ids))
        if key not in cache:
            try:
                cache[key] = mean_nll(fp32.score(ids, o.token_ids))
            except Exception:  # counted: the answer is unjudged unless a symptom decides
                cache[key] = None
        o.fp32_nll, o.score_failed = cache[key], cache[key] is None
    rejudge(run.outcomes)
    progress.tick()
    run.times["judge_s"] = time.perf_counter() - t
    run.times["judge_scored"] = float(len(cache))


def references(run: Run, progress: Progress) -> None:
    """fp32 alone, greedy, on each configuration's prompt ids: is an answer fp32's own? For every
    abnormal answer, every garbage answer and the normal reference prompts. Then, for each guarded
    faulted answer, fp32's greedy continuation of its int4 prefix (the quality row)."""
    from qladder.validate.garbage import GUARD_ENDED, same_answer
    from qladder.validate.replay import continuation_identical

    progress.phase("fp32 references")
    fp32, c = run.engines["fp32"], run.cfg
    refs = {p.id for p in run.reference_set()}
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: Sequence[int], n: int) -> list[int]:
        key = (*ids, -n)
        if key not in cache:
            cache[key] = greedy(fp32, ids, n) if n > 0 else []
        return cache[key]

    t = time.perf_counter()
    for o, ids in counted(run):
        if not o.ok or o.fallback or not ids or o.phase == "precision":  # (the table has its own)
            continue
        if o.population == "abnormal" or o.garbage or o.finish_reason in GUARD_ENDED or o.prompt_id in refs:
            o.fp32_reference_ids = ref(ids, c.max_tokens)
            o.fp32_identical = same_answer(o.token_ids, o.fp32_reference_ids, finish=o.finish_reason)
        if o.config == "guarded" and o.fault is not None:
            k = 0
            while k < len(o.rungs) and o.rungs[k] == "int4":
                k += 1
            o.fp32_continuation_identical = continuation_identical(
                o.token_ids, k, ref([*ids, *o.token_ids[:k]], c.max_tokens - k), o.finish_reason)
    progress.tick()
    run.times["references_s"] = time.perf_counter() - t
    run.times["references_computed"] = float(len(cache))


def boundaries(run: Run, progress: Progress) -> dict[str, Any]:
    from qladder.validate.boundaries import latency_levels, monitor_cost, precision_sweep

    c, e = run.cfg, run.engines
    progress.phase("precision sweep")
    prompts = [(f"sweep-{i}", user_prompt_ids(e["info"].chat_template, t, e["int4"].tokenize))
               for i, t in enumerate(SWEEP_PROMPTS[: c.sweep_prompts])]
    rungs = {r: e[r] for r in ("int4", "w4a16", "fp32")}
    t = time.perf_counter()
    precision = precision_sweep(rungs, prompts, c.sweep_xs, c.sweep_tokens, progress.tick)
    run.times["precision_s"] = time.perf_counter() - t
    progress.phase("latency levels")
    level_ids = [user_prompt_ids(e["info"].chat_template, p.prompt, e["int4"].tokenize)
                 for p in run.normal[: c.level_prompts] if isinstance(p.prompt, str)]
    t = time.perf_counter()
    latency = latency_levels(e["int4"], e["fp32"], level_ids, c.level_rounds, c.level_tokens, progress.tick)
    latency["fp32_activation_monitors"] = monitor_cost(e["fp32"], level_ids[:2], c.monitor_rounds,
                                                       c.monitor_tokens, progress.tick)
    run.times["latency_s"] = time.perf_counter() - t
    return {"precision": precision, "latency": latency}


def standby_jobs(run: Run) -> list[Any]:
    """The standby's share of every measured handoff: the context at the handoff, and the fp32
    tokens served after it (capped by `replay_max_tokens`)."""
    from qladder.validate.standby_replay import Job

    jobs = []
    for o, ids in counted(run):
        if o.config != "guarded" or not o.handoff_ms or "fp32" not in o.rungs:
            continue
        first = o.rungs.index("fp32")
        n = len(o.token_ids) - first
        if run.cfg.replay_max_tokens is not None:
            n = min(n, run.cfg.replay_max_tokens)
        jobs.append(Job(tuple(ids + o.token_ids[:first]), n))
    return jobs


def standby_confirmation(run: Run, progress: Progress) -> dict[str, Any]:
    from qladder.engines import instrument
    from qladder.validate.standby_replay import confirm

    c = run.cfg
    fp32 = run.engines["fp32"]
    instrument(fp32, activations=False, row_stats=False)
    t = time.perf_counter()
    out = confirm(fp32, standby_jobs(run), c.replay_utilizations, c.replay_servers, c.replay_jobs,
                  c.seed, progress.tick)
    run.times["standby_replay_s"] = time.perf_counter() - t
    return out


def fp32_decode_ms(run: Run) -> float:
    """fp32's decode time per token, measured on two normal prompts (for the availability model)."""
    e = run.engines
    samples = []
    for p in run.normal[:2]:
        timings: dict[str, float] = {}
        ids = user_prompt_ids(e["info"].chat_template, str(p.prompt), e["fp32"].tokenize)
        toks = greedy(e["fp32"], ids, 16, timings=timings)
        if toks:
            samples.append(timings["decode_ms"] / len(toks))
    return mean(samples) or 0.0


def availability(run: Run) -> dict[str, Any]:
    c = run.cfg
    guarded = [o for o, _ in counted(run) if o.config == "guarded"]
    normal = [o.latency_ms / 1e3 for o in guarded if o.phase == "normal" and o.ok]
    per_tok = fp32_decode_ms(run)
    standby = [(sum(o.handoff_ms) + per_tok * sum(r == "fp32" for r in o.rungs)) / 1e3
               for o in guarded if o.handoff_ms]
    if not normal or not standby:
        return {"error": "no handoffs or no clean requests were measured"}
    model = queueing.StandbyModel(mean(normal) or 0.0, mean(standby) or 0.0, c.servers, c.standby_share,
                                  c.primary_util)
    budget = (mean([x for o in guarded for x in o.handoff_ms]) or 0.0) / 1e3
    star = model.saturation_share
    curve = [model.point(star * f) for f in (*[k / 20 for k in range(19)], 0.97, 0.99)]
    checks = []
    for frac in (0.5, 0.9):
        lam_h = star * frac * model.arrival_rate
        checks.append({"share": star * frac, "model_wait_ms": queueing.mmc_wait(model.c_standby, lam_h,
                                                                                 model.s_standby) * 1e3,
                       "simulated_wait_ms": queueing.simulate(model.c_standby, lam_h, standby,
                                                              seed=c.seed) * 1e3})
    return {"model": model.to_dict(), "curve": curve, "wait_budget_ms": budget * 1e3,
            "share_at_wait_budget": model.share_at_wait(budget) if budget > 0 else None,
            "simulation": checks, "standby_samples_ms": [s * 1e3 for s in standby], "fp32_decode_ms": per_tok,
            "concurrent_replay": run.standby,
            "note": "standby service = handoff latency + fp32 tokens x measured fp32 ms/token; M/G/c "
                    "simulation draws from these samples; concurrent_replay runs real handoffs on "
                    "real fp32 standby workers at two loads and checks the M/G/c model against them"}


def validate(cfg: ValidateConfig, out_dir: Path, show_progress: bool = True,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run everything; write outcomes.jsonl, results.json (every figure, from those outcomes),
    boundaries.json (the sweeps and the availability model), report.md, report.html, the PNGs."""
    from qladder.incidents import IncidentStore
    from qladder.validate.report import write_report

    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    normal, abnormal = select(cfg)
    run = Run(cfg, normal, abnormal, by_name(list(cfg.fault_names), quick=cfg.quick))
    progress = Progress(run.total_steps(), show_progress)
    store = IncidentStore(out_dir / "incidents.sqlite3")
    try:
        load_engines(run, progress)
        env = snapshot(run.engines["settings"].n_threads, run.engines["settings"].n_ctx)
        int4 = run.engines["int4"]
        env["int4_activation_monitor"] = {"built": getattr(int4, "monitor", None) is not None,
                                          "error": getattr(int4, "monitor_error", None)}
        build_configs(run, store)
        replay(run, progress)
        precision(run, progress)
        for se in run.served:  # the standby's fp32 engine is the references' now
            se.close()
        run.served.clear()
        judge_all(run, progress)
        references(run, progress)
        bounds = boundaries(run, progress)
        progress.phase("standby replay (concurrent)")
        run.standby = standby_confirmation(run, progress)
        progress.phase("availability model")
        bounds["availability"] = availability(run)
        progress.tick()
        incidents = store.count()
    finally:
        gc.unfreeze()  # frozen by replay(): hand those objects back to the collector
        progress.close()
        store.close()
        for name in ("int4", "fp32", "w4a16"):
            if name in run.engines:
                run.engines[name].close()
        for se in run.served:
            se.close()
        for folder in run.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
    results = write_outputs(out_dir, run.outcomes, "in-process", header(run, env, incidents))
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_durations_s"] = progress.durations
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    (out_dir / "boundaries.json").write_text(json.dumps(bounds, indent=2, ensure_ascii=False, default=str))
    write_report(results, bounds, out_dir)
    log(f"wrote {out_dir / 'outcomes.jsonl'}, results.json, boundaries.json, report.md, report.html")
    return results


def write_outputs(out_dir: Path, outcomes: Sequence[Outcome], mode: str, head: dict[str, Any]) -> dict[str, Any]:
    """outcomes.jsonl (every request, one a line), then results.json: `head` (what the run was)
    plus the figures, computed from the file as written (`qladder.validate.recompute`)."""
    from qladder.validate.outcome import read_jsonl, write_jsonl
    from qladder.validate.recompute import figures

    write_jsonl(out_dir / "outcomes.jsonl", outcomes)
    results = {**head, "figures": figures(read_jsonl(out_dir / "outcomes.jsonl"), mode)}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    return results


def header(run: Run, env: dict[str, Any], incidents: int) -> dict[str, Any]:
    env["load_average_end"] = load_average()
    env["peak_rss_mb_process"] = peak_rss_mb()
    env["memory_mb"] = run.memory
    env["load_times_s"] = {k: v for k, v in run.times.items() if k.startswith("load_")}
    m = run.memory
    return {
        "kind": "in-process",
        "config": run.cfg.to_dict(),
        "environment": env,
        "method": {"warmup_requests_per_config": run.cfg.warmup, "rounds_normal": run.cfg.rounds,
                   "seeds": {"sampling": run.cfg.seed, "corpus": "qladder.validate.corpora.SEED",
                             "simulation": run.cfg.seed},
                   "sampling": "greedy", "gc": "paused during each timed request (as timeit does), run between "
                                               "them; objects alive after the warm-up frozen (gc.freeze)",
                   "order": "normal rounds: bare, bare_aa and guarded, the order rotated per prompt and round; "
                            "abnormal and faulted: bare and guarded, the order alternating",
                   "engines": "each configuration on a serving engine of its own, built for the run",
                   "prompts": {"normal": len(run.normal), "abnormal": len(run.abnormal),
                               "abnormal_by_split": {fs: sum(p.split == fs for p in run.abnormal)
                                                     for fs in FAULT_SETS}},
                   "memory_note": "RSS added by loading each engine and touching it, measured by the harness (not "
                                  "per request): bare = the int4 engine (the GGUF's weights and a context); "
                                  "guarded = the int4 engine + the fp32 engine it hands off to. The serving "
                                  "engines loaded after them share the weights' pages (environment.memory_mb)"},
        "memory_mb": {"bare": m.get("int4_engine"),
                      "guarded": (m.get("int4_engine") or 0.0) + (m.get("fp32_engine") or 0.0)},
        "fault_models": [{**fm.to_dict(), "applied_patch": run.patches.get(fm.name)} for fm in run.models],
        "incidents_recorded": incidents,
        "phase_times_s": run.times,
    }
