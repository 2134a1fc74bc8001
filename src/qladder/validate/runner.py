"""The whole `qladder validate` run: load once, replay, sweep, model, write results and report.

Phases, in order (one process, the engines loaded once and shared by every configuration):
    warm-up         a few requests through bare and guarded, not counted
    normal          normal prompts, no fault, `rounds` times, bare and guarded interleaved with
                    alternating order (latency, false handoffs)
    reference       fp32 greedy answers to the normal prompts (agreement)
    abnormal        abnormal prompts, no fault, bare and guarded
    faulted         (abnormal prompt, fault model) pairs, bare and guarded
    judge           fp32 likelihood of every abnormal answer (the "implausible" garbage reason)
    precision       the gain sweep over int4, w4a16, fp32
    latency         the check levels, and the fp32 activation monitors' cost
    availability    the standby queueing model from the measured service times, and its simulation
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

from qladder.model import user_prompt_ids
from qladder.validate import queueing
from qladder.validate.boundaries import LEVELS
from qladder.validate.corpora import Prompt, load_corpora, subset
from qladder.validate.environment import load_average, peak_rss_mb, rss_mb, snapshot
from qladder.validate.fault_models import Assignment, FaultModel, assign, by_name
from qladder.validate.replay import Bare, Guarded, Outcome, agreement, greedy
from qladder.validate.stats import mean, paired_ratio, percentile, section

if TYPE_CHECKING:
    from qladder.faults import Fault
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
    rounds: int = 2
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
    servers: int = 10
    standby_share: float = 0.2
    primary_util: float = 0.7
    replay_servers: int = 1  # standby workers of the concurrent replay (this machine: 2 cores)
    replay_utilizations: tuple[float, ...] = (0.5, 0.8)
    replay_jobs: int = 20  # handoffs replayed per point
    replay_max_tokens: int | None = 16  # cap on the fp32 tokens of a replayed handoff
    seed: int = 0
    corpus_dir: Path | None = None

    @classmethod
    def quick_preset(cls, **kw: Any) -> ValidateConfig:
        base = cls(quick=True, max_tokens=24, normal_per_class=3, abnormal_per_class=QUICK_ABNORMAL,
                   prompts_per_fault=2, rounds=3, warmup=2, reference_prompts=8, sweep_prompts=1,
                   sweep_tokens=8, level_prompts=3, level_rounds=2, level_tokens=12, n_ctx=512,
                   replay_jobs=8, replay_max_tokens=4)
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
    times: dict[str, float] = field(default_factory=dict)
    cleanup: list[Path] = field(default_factory=list)  # temporary folders (patched GGUF copies)
    patches: dict[str, dict[str, object]] = field(default_factory=dict)  # what each copy changed
    standby: dict[str, Any] = field(default_factory=dict)  # the concurrent standby replay
    patched: dict[str, tuple[Bare, Guarded]] = field(default_factory=dict)  # fault model -> configs
    served: list[Any] = field(default_factory=list)  # serving engines to close (main, patched copies)

    def total_steps(self) -> int:
        c = self.cfg
        n_fault = len(self.assignments())
        sweep = min(c.sweep_prompts, len(SWEEP_PROMPTS)) * len(c.sweep_xs) * 3
        n_levels = min(c.level_prompts, len(self.normal))
        levels = n_levels * c.level_rounds * len(LEVELS) + min(2, n_levels) * c.monitor_rounds * 2
        return (3 + 2 * c.warmup + 2 * len(self.normal) * c.rounds + len(self.reference_set())
                + 4 * len(self.abnormal) + 4 * n_fault + sweep + levels + len(c.replay_utilizations) + 1)

    def reference_set(self) -> list[Prompt]:
        n = self.cfg.reference_prompts
        return self.normal if n is None else self.normal[:n]

    def assignments(self) -> list[Assignment]:
        return assign(len(self.abnormal), self.models, self.cfg.prompts_per_fault, self.skip(),
                      [p.cls for p in self.abnormal])

    def skip(self) -> list[int]:
        """Over-long prompts take no fault: their fp32 catch-up prefill would dominate the run."""
        return [i for i, p in enumerate(self.abnormal) if p.cls == "over_long"]


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
    run.engines["info"] = inspect_model()
    run.engines["settings"] = settings
    run.memory["baseline"] = rss_mb()
    probe = None
    for rung in ("int4", "fp32", "w4a16"):
        t = time.perf_counter()
        engine = run.engines[rung] = load_engine(rung, run.engines["info"], settings)
        run.times[f"load_{rung}_s"] = time.perf_counter() - t
        probe = probe or user_prompt_ids(run.engines["info"].chat_template, "Say hello.", engine.tokenize)
        greedy(engine, probe, 2)  # touch the weights (mmap, lazy allocation) before reading RSS
        run.memory[f"after_{rung}"] = rss_mb()
        progress.tick()


def configs(run: Run, incidents: Any) -> tuple[Bare, Guarded]:
    from qladder.validate.replay import serve

    e = run.engines
    se, bare, guarded = serve(e["info"], e["fp32"], e["settings"], incidents)
    run.served.append(se)
    return bare, guarded


def patched_configs(run: Run, model: FaultModel, guarded: Guarded) -> tuple[Bare, Guarded]:
    """Bare and guarded on a serving engine loaded on a patched copy of the GGUF (built once)."""
    import tempfile

    from qladder.faults import GGUF_PATCHES
    from qladder.model import inspect_model
    from qladder.validate.replay import serve

    if model.name not in run.patched:
        e = run.engines
        tmp = Path(tempfile.mkdtemp(prefix="qladder-patched-"))
        run.cleanup.append(tmp)
        dst = tmp / f"{model.name}.gguf"
        run.patches[model.name] = GGUF_PATCHES[model.patch](e["info"].path, dst, **dict(model.gguf_patch or ()))
        info = inspect_model(dst, tmp)
        se, b, g = serve(info, e["fp32"], e["settings"], guarded.se.incidents)
        run.served.append(se)
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


def timed(cfg: Bare | Guarded, p: Prompt, population: str, fault_name: str, faults: Sequence[Fault],
          params: SamplingParams) -> Outcome:
    """One request through one configuration, with the collector paused."""
    with paused_gc():
        return cfg.run(p, population, fault_name, faults, params)


def replay(run: Run, bare: Bare, guarded: Guarded, progress: Progress) -> dict[str, Any]:
    """Warm-up, normal rounds, fp32 reference, abnormal, faulted. Returns the agreement sections."""
    from qladder.sampling import SamplingParams

    c = run.cfg
    params = SamplingParams(max_tokens=c.max_tokens, seed=c.seed)
    progress.phase("warm-up")
    for i in range(c.warmup):
        for cfg in (bare, guarded):
            timed(cfg, run.normal[i % len(run.normal)], "normal", "none", [], params)
            progress.tick()
    gc.collect()
    gc.freeze()  # engines, tokenizers and corpora: out of every later collection's way
    progress.phase("normal (bare vs guarded)")
    for r in range(c.rounds):
        for i, p in enumerate(run.normal):
            order = (bare, guarded) if (r + i) % 2 == 0 else (guarded, bare)
            for cfg in order:
                o = timed(cfg, p, "normal", "none", [], params)
                o.round = r
                run.outcomes.append(o)
                progress.tick()
    agreement_sections = reference(run, bare, guarded, progress)
    progress.phase("abnormal (no fault)")
    for p in run.abnormal:
        for cfg in (bare, guarded):
            run.outcomes.append(timed(cfg, p, "abnormal", "none", [], params))
            progress.tick()
    progress.phase("faulted")
    for a in run.assignments():
        p = run.abnormal[a.prompt_index]
        pair = (bare, guarded) if a.model.gguf_patch is None else patched_configs(run, a.model, guarded)
        for cfg in pair:
            run.outcomes.append(timed(cfg, p, "abnormal", a.model.name, a.model.faults, params))
            progress.tick()
    return agreement_sections


def judged(run: Run) -> list[Outcome]:
    """The outcomes the likelihood judge scores: every answered abnormal request (clean and
    faulted), the set the garbage rates cover."""
    return [o for o in run.outcomes if o.population == "abnormal" and o.status == "ok" and o.token_ids]


def judge_likelihood(run: Run, bare: Bare, guarded: Guarded, progress: Progress) -> None:
    """Score each judged answer under fp32, given the ids its configuration fed the engine, and
    judge it again with that score. Identical (prompt, answer) pairs are scored once."""
    from qladder.validate.garbage import mean_nll

    progress.phase("judge (fp32 likelihood)")
    fp32 = run.engines["fp32"]
    prompts = {p.id: p for p in run.abnormal}
    cache: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
    t = time.perf_counter()
    by_config = {"bare": bare, "guarded": guarded}
    for o in judged(run):
        ids = by_config[o.config].prompt_ids(prompts[o.prompt_id], run.cfg.max_tokens)
        key = (tuple(ids), tuple(o.token_ids))
        if key not in cache:
            try:
                cache[key] = mean_nll(fp32.score(ids, o.token_ids))
            except Exception:  # an answer too long to score stays judged by its symptoms alone
                cache[key] = None
        o.nll = cache[key]
        o.judge()
        progress.tick()
    run.times["judge_s"] = time.perf_counter() - t
    run.times["judge_scored"] = float(len(cache))


def attribute_garbage(run: Run, guarded: Guarded) -> None:
    """Whose is each garbage answer of the guarded ladder? The fp32 rung alone answers the same ids
    greedily; if that answer is judged garbage too (the same symptoms), it is the model's own (a
    135M model's loop on a ZWJ emoji run), which no precision climb can fix: counted apart."""
    from qladder.validate.garbage import judge

    fp32 = run.engines["fp32"]
    prompts = {p.id: p for p in [*run.normal, *run.abnormal]}
    cache: dict[tuple[int, ...], tuple[str, ...]] = {}
    for o in run.outcomes:
        if o.config != "guarded" or not o.is_garbage:
            continue
        ids = tuple(guarded.prompt_ids(prompts[o.prompt_id], run.cfg.max_tokens))
        if ids not in cache:
            ref = greedy(fp32, list(ids), run.cfg.max_tokens)
            cache[ids] = judge(fp32.detokenize(ref), ref, len(ref) >= run.cfg.max_tokens).reasons
        o.model_own = bool(set(o.garbage) & set(cache[ids]))


def judge_summary(run: Run) -> dict[str, Any]:
    """The likelihood judge's threshold against the scores it saw: clean answers' largest score is
    its false-positive margin."""
    from qladder.validate.garbage import IMPLAUSIBLE_NLL

    scored = [o for o in run.outcomes if o.nll is not None]
    clean = [o.nll for o in scored if o.fault == "none" and o.nll is not None]
    by_fault: dict[str, dict[str, list[float]]] = {}
    for o in scored:
        if o.fault != "none" and o.nll is not None:
            by_fault.setdefault(o.fault, {}).setdefault(o.config, []).append(round(o.nll, 3))
    return {"threshold_nll": IMPLAUSIBLE_NLL, "scored": len(scored), "clean_scored": len(clean),
            "clean_max_nll": max(clean, default=None), "clean_p50_nll": percentile(clean, 50),
            "clean_flagged": sum(x > IMPLAUSIBLE_NLL for x in clean), "faulted_nll": by_fault,
            "note": "mean negative log-likelihood (nats/token) of each abnormal answer under the fp32 "
                    "rung, given the ids its configuration fed the engine"}


def reference(run: Run, bare: Bare, guarded: Guarded, progress: Progress) -> dict[str, Any]:
    """fp32 greedy answers on the ids each configuration fed its engine; agreement of round 0."""
    progress.phase("fp32 reference")
    fp32 = run.engines["fp32"]
    first = {(o.config, o.prompt_id): o for o in run.outcomes if o.round == 0}
    scores: dict[str, list[tuple[float, float]]] = {"bare": [], "guarded": []}
    decode_ms: list[float] = []
    for p in run.reference_set():
        ids = {cfg.name: cfg.prompt_ids(p, run.cfg.max_tokens) for cfg in (bare, guarded)}
        refs: dict[tuple[int, ...], list[int]] = {}
        for name in ("bare", "guarded"):
            key = tuple(ids[name])
            if key not in refs:
                timings: dict[str, float] = {}
                refs[key] = greedy(fp32, ids[name], run.cfg.max_tokens, timings=timings)
                if refs[key]:
                    decode_ms.append(timings["decode_ms"] / len(refs[key]))
            o = first.get((name, p.id))
            if o is not None and o.status == "ok":
                scores[name].append(agreement(o.token_ids, refs[key]))
        progress.tick()
    run.times["fp32_decode_ms_per_token"] = mean(decode_ms) or 0.0
    return {name: {"prefix": mean(s[0] for s in v), "position": mean(s[1] for s in v),
                   "exact": mean(float(s[0] == 1.0 and s[1] == 1.0) for s in v), "prompts": len(v)}
            for name, v in scores.items()}


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


def standby_jobs(run: Run, guarded: Guarded) -> list[Any]:
    """The standby's share of every measured handoff: the context at the handoff, and the fp32
    tokens served after it (capped by `replay_max_tokens`)."""
    from qladder.validate.standby_replay import Job

    prompts = {p.id: p for p in (*run.normal, *run.abnormal)}
    jobs = []
    for o in run.outcomes:
        if o.config != "guarded" or not o.handoff_ms or "fp32" not in o.token_rungs:
            continue
        first = o.token_rungs.index("fp32")
        ids = guarded.prompt_ids(prompts[o.prompt_id], run.cfg.max_tokens) + o.token_ids[:first]
        n = len(o.token_ids) - first
        if run.cfg.replay_max_tokens is not None:
            n = min(n, run.cfg.replay_max_tokens)
        jobs.append(Job(tuple(ids), n))
    return jobs


def standby_confirmation(run: Run, guarded: Guarded, progress: Progress) -> dict[str, Any]:
    from qladder.engines import instrument
    from qladder.validate.standby_replay import confirm

    c = run.cfg
    fp32 = run.engines["fp32"]
    instrument(fp32, activations=False, row_stats=False)
    t = time.perf_counter()
    out = confirm(fp32, standby_jobs(run, guarded), c.replay_utilizations, c.replay_servers, c.replay_jobs,
                  c.seed, progress.tick)
    run.times["standby_replay_s"] = time.perf_counter() - t
    return out


def availability(run: Run, guarded: Sequence[Outcome]) -> dict[str, Any]:
    c = run.cfg
    normal = [o.wall_ms / 1e3 for o in guarded if o.population == "normal" and o.fault == "none"
              and o.status == "ok"]
    per_tok = run.times.get("fp32_decode_ms_per_token", 0.0)
    standby = [(sum(o.handoff_ms) + per_tok * sum(r == "fp32" for r in o.token_rungs)) / 1e3
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
            "simulation": checks, "standby_samples_ms": [s * 1e3 for s in standby],
            "concurrent_replay": run.standby,
            "note": "standby service = handoff latency + fp32 tokens x measured fp32 ms/token; M/G/c "
                    "simulation draws from these samples; concurrent_replay runs real handoffs on "
                    "real fp32 standby workers at two loads and checks the M/G/c model against them"}


def validate(cfg: ValidateConfig, out_dir: Path, show_progress: bool = True,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run everything and write results.json, report.md, report.html and the PNGs into out_dir."""
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
        bare, guarded = configs(run, store)
        agree = replay(run, bare, guarded, progress)
        judge_likelihood(run, bare, guarded, progress)
        attribute_garbage(run, guarded)
        bounds = boundaries(run, progress)
        progress.phase("standby replay (concurrent)")
        run.standby = standby_confirmation(run, guarded, progress)
        progress.phase("availability model")
        results = assemble(run, env, agree, bounds, store.count())
        progress.tick()
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
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_durations_s"] = progress.durations
    write_outputs(out_dir, results, run.outcomes)
    write_report(results, out_dir)
    log(f"wrote {out_dir / 'results.json'}, report.md, report.html")
    return results


def write_outputs(out_dir: Path, results: dict[str, Any], outcomes: Sequence[Outcome]) -> None:
    """results.json, and outcomes.jsonl (every request, one a line), of either validation run."""
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    (out_dir / "outcomes.jsonl").write_text("".join(json.dumps(o.to_dict(), ensure_ascii=False) + "\n"
                                                    for o in outcomes))


def assemble(run: Run, env: dict[str, Any], agree: dict[str, Any], bounds: dict[str, Any],
             incidents: int) -> dict[str, Any]:
    bare = [o for o in run.outcomes if o.config == "bare"]
    guarded = [o for o in run.outcomes if o.config == "guarded"]
    m = run.memory
    mem_bare, mem_guarded = m["after_int4"], m["after_fp32"]  # loaded in that order, w4a16 last
    env["load_average_end"] = load_average()
    env["peak_rss_mb_process"] = peak_rss_mb()
    env["memory_rss_mb"] = m
    env["load_times_s"] = {k: v for k, v in run.times.items() if k.startswith("load_")}
    failure_paths = sorted({o.error_kind.split(":")[0] for o in run.outcomes if o.error_kind}
                           | {f"hazard:{h}" for o in guarded for h in o.hazards}
                           | {f"finish:{o.finish_reason}" for o in run.outcomes if o.finish_reason})
    return {
        "config": run.cfg.to_dict(),
        "environment": env,
        "method": {"warmup_requests_per_config": run.cfg.warmup, "rounds_normal": run.cfg.rounds,
                   "seeds": {"sampling": run.cfg.seed, "corpus": "qladder.validate.corpora.SEED",
                             "simulation": run.cfg.seed},
                   "sampling": "greedy", "gc": "paused during each timed request (as timeit does), run between "
                                               "them; objects alive after the warm-up frozen (gc.freeze)",
                   "prompts": {"normal": len(run.normal), "abnormal": len(run.abnormal)},
                   "memory_note": "RSS of this process after loading and touching each engine (two greedy "
                                  "tokens): bare = after int4; guarded = after int4 and fp32 (w4a16, for "
                                  "the sweep only, is loaded last)"},
        "fault_models": [{**fm.to_dict(), "applied_patch": run.patches.get(fm.name)} for fm in run.models],
        "bare": section(bare, agree.get("bare"), mem_bare),
        "guarded": section(guarded, agree.get("guarded"), mem_guarded),
        "latency_ratio_guarded_over_bare": paired_ratio(bare, guarded),
        "precision_boundary": bounds["precision"],
        "latency_boundary": bounds["latency"],
        "availability_boundary": availability(run, guarded),
        "latency_samples_normal_ms": {cfg: [o.wall_ms for o in outs if o.population == "normal"
                                            and o.fault == "none" and o.status == "ok"]
                                      for cfg, outs in (("bare", bare), ("guarded", guarded))},
        "garbage_judge": judge_summary(run),
        "incidents_recorded": incidents,
        "failure_paths_seen": failure_paths,
        "phase_times_s": run.times,
    }
