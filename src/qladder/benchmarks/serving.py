"""`qladder bench serving`: many requests at once on the INT4 pool, guarded vs bare vs a raw loop.

The same prompts (EOS ignored, so every answer runs to `max_tokens` unless the guard ends it) run
at each concurrency through the configurations below, on two prompt sets:
    all        the first `n_prompts` normal prompts, loops and all: forced past its end a 135M model
               often loops, and the guard then ends the answer on its repetition rule (a check on the
               next rung's greedy token); that is the guard's work, and it counts
    screened   the prompts whose raw greedy answer never loops by the guard's rules (`_loop_free`), so
               every configuration does the same work: beside the first, for reading
Configurations:
    guarded          the serving engine with the default guard, standby fp32
    bare             the serving engine with the guard off and no standby (scheduler cost only)
    raw              a batched llama.cpp loop over the same engine API with no scheduler: decode
                     every active row, prefill one waiting prompt alone (after the same cached
                     system-turn prefix), argmax (the ceiling)
    guarded_faulted  guarded, with `fault_share` of the requests given `nan@step=K` (K seeded,
                     uniform in [1, max_tokens / 2]): they must end clean through the standby
With `cores` (--elastic N: the server's default, `[cores] int4 = "elastic"`), one more:
    elastic            guarded, INT4 leasing up to `cores` threads (every core the standby is not
                       using: serving/cores.py), the standby its `standby_threads`
Clients are closed-loop: `concurrency` threads each take the next prompt when their last answer is
done. Each round visits every prompt set and concurrency level, the configurations rotated inside
each (interleaved: slow drift of the machine hits them alike). Every request is one line of
outcomes.jsonl (its window, start and end, TTFT, token intervals, ids, rungs); every figure,
tok/s included (a window's tokens over its span), is computed from those lines by
`qladder.validate.recompute` (`figures(outcomes, "bench-serving")`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qladder.benchmarks.common import OutcomeLog, closed_loop, environment
from qladder.config import Settings
from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry
from qladder.health.guard import GUARD_PRESETS, GuardConfig
from qladder.health.repetition import find_repetition
from qladder.model import inspect_model, user_prompt_ids
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.serving import SchedulerConfig, ServingConfig, ServingEngine
from qladder.serving.engine import template_prefix
from qladder.testing.faults import Fault, parse_fault
from qladder.validate.corpora import Prompt, load_corpora, subset
from qladder.validate.outcome import Outcome

RUN = "bench-serving"
Job = tuple[Prompt, list[int], Fault | None]


def _outcome(config: str, window: str, p: Prompt, fault: Fault | None, rnd: int, c: int, phase: str) -> Outcome:
    return Outcome(RUN, config, p.id, p.cls, "normal", fault=str(fault) if fault else None, round=rnd, phase=phase,
                   split=p.split, prompt=str(p.prompt), concurrency=c, window=window)


def _serve(se: ServingEngine, params: SamplingParams, rec: OutcomeLog, config: str, window: str, rnd: int, c: int,
           phase: str) -> Callable[[Job], None]:
    def run(job: Job) -> None:
        p, ids, fault = job
        o = _outcome(config, window, p, fault, rnd, c, phase)
        o.start_s = rec.now()
        try:
            r = se.generate_sync(se.request(ids, params, faults=[fault] if fault is not None else []))
            o.token_ids, o.rungs, o.text = list(r.token_ids), list(r.token_rungs), r.text
            o.finish_reason, o.fallback = str(r.finish_reason), r.fallback
            o.hazards, o.handoff_ms = [h.check for h in r.hazards], [h.latency_ms for h in r.handoffs]
            o.ttft_ms, o.step_ms = r.timings.get("ttft_ms"), list(r.step_ms)
            o.prompt_tokens = len(ids)
        except Exception as exc:  # counted, never dropped
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.end_s = rec.now()
        o.latency_ms = (o.end_s - o.start_s) * 1e3
        o.judge()
        rec.add(o)

    return run


def _raw(engine: BatchedLlamaCpp, jobs: list[Job], concurrency: int, max_tokens: int, rec: OutcomeLog, window: str,
         rnd: int, phase: str) -> None:
    """A batched greedy loop with no scheduler, no guard, no events: the ceiling."""
    waiting = list(range(len(jobs)))
    free = list(range(engine.n_slots))[:concurrency]
    active: dict[int, dict[str, Any]] = {}
    asked = [rec.now()] * concurrency  # when each client's next request was sent (closed loop)
    while waiting or active:
        rows = [(slot, a) for slot, a in sorted(active.items()) if a["n"] > 0]
        if rows:
            engine.decode([Entry(slot, [a["ids"][-1]], a["pos"]) for slot, a in rows])
        now = rec.now()
        for slot, a in rows:
            a["pos"] += 1
            a["ids"].append(int(np.argmax(engine.row(slot).numpy())))
            a["n"] += 1
            a["times"].append(now)
        for slot, a in list(active.items()):
            if a["n"] >= max_tokens:
                ts = a["times"]
                o = _outcome("raw", window, a["prompt"], None, rnd, concurrency, phase)
                o.start_s, o.end_s, o.latency_ms = a["t"], now, (now - a["t"]) * 1e3
                o.ttft_ms, o.step_ms = (ts[0] - a["t"]) * 1e3, [(b - x) * 1e3 for x, b in itertools.pairwise(ts)]
                o.token_ids, o.rungs = a["ids"], ["int4"] * len(a["ids"])
                o.text, o.finish_reason, o.prompt_tokens = engine.detokenize(a["ids"]), "length", a["pos"]
                o.judge()
                rec.add(o)
                engine.truncate(slot, 0)
                free.append(slot)
                del active[slot]
                asked.append(now)  # that client sends its next request now
        if waiting and free:
            k, slot, t = waiting.pop(0), free.pop(0), asked.pop(0)
            p, ids, _ = jobs[k]
            held = engine.copy_prefix(slot) if tuple(ids[:len(engine.prefix)]) == engine.prefix else 0
            engine.decode([Entry(slot, ids[held:], held)])  # a prompt alone, as the scheduler does
            first = int(np.argmax(engine.row(slot).numpy()))
            active[slot] = {"pos": len(ids), "ids": [first], "n": 1, "t": t, "times": [rec.now()], "prompt": p}


def _loops(toks: list[int], guard: GuardConfig) -> bool:
    rules = ((guard.repetition_short_max_period, guard.repetition_short_min_repeats, guard.repetition_short_min_span),
             (guard.repetition_max_period, guard.repetition_min_repeats, guard.repetition_min_span))
    return any(find_repetition(toks[:i], guard.repetition_min_period, mp, rep, span) is not None
               for mp, rep, span in rules for i in range(span, len(toks) + 1))


def _loop_free(engine: BatchedLlamaCpp, candidates: list[list[int]], max_tokens: int, n: int,
               guard: GuardConfig) -> tuple[list[int], dict[str, Any]]:
    """The indices of the first n candidates whose `max_tokens`-token greedy answer (EOS ignored)
    never repeats itself by the guard's loop rules. Greedy answers are bit-identical on every
    configuration (one KV stream per slot), so the raw loop's tokens tell what the guard would see."""
    kept: list[int] = []
    start = 0
    slots = engine.n_slots
    for start in range(0, len(candidates), slots):
        answers = _raw_answers(engine, candidates[start:start + slots], max_tokens)
        kept += [start + k for k, toks in enumerate(answers) if not _loops(toks, guard)]
        if len(kept) >= n:
            break
    return kept[:n], {"candidates_screened": min(len(candidates), start + slots),
                      "rule": "no loop by the default guard's repetition rules within the answer (raw greedy, "
                              "EOS ignored)"}


def _raw_answers(engine: BatchedLlamaCpp, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out: list[list[int]] = []
    for slot, p in enumerate(prompts):
        engine.decode([Entry(slot, p, 0)])
        out.append([int(np.argmax(engine.row(slot).numpy()))])
    for _ in range(max_tokens - 1):
        engine.decode([Entry(slot, [toks[-1]], len(prompts[slot]) + len(toks) - 1)
                       for slot, toks in enumerate(out)])
        for slot, toks in enumerate(out):
            toks.append(int(np.argmax(engine.row(slot).numpy())))
    for slot in range(len(prompts)):
        engine.truncate(slot, 0)
    return out


def _faulted(jobs: list[Job], share: float, max_tokens: int, rng: random.Random) -> list[Job]:
    """Exactly round(share x prompts) of the jobs (at least one) given `nan@step=K`, K seeded."""
    hit = set(rng.sample(range(len(jobs)), min(len(jobs), max(1, round(share * len(jobs))))) if share else ())
    return [(p, ids, parse_fault(f"nan@step={rng.randint(1, max(1, max_tokens // 2))}") if k in hit else None)
            for k, (p, ids, _) in enumerate(jobs)]


def run_serving_bench(n_prompts: int = 32, max_tokens: int = 128, concurrency: tuple[int, ...] = (1, 4, 8, 16),
                      fault_share: float = 0.1, int4_threads: int = 1, standby_threads: int = 1,
                      seed: int = 0, rounds: int = 6, out_dir: Path | None = None,
                      cores: int | None = None) -> dict[str, Any]:
    """Run the benchmark; returns results.json's content (and, with `out_dir`, writes outcomes.jsonl
    and results.json there)."""
    from qladder.validate.outcome import read_jsonl, write_jsonl
    from qladder.validate.recompute import figures

    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    slots = max(concurrency)
    n_ctx = 1024
    sched = SchedulerConfig(max_queue=4 * slots)
    common = ServingConfig(slots=slots, n_ctx=n_ctx, int4_threads=int4_threads, standby_threads=standby_threads,
                           scheduler=sched)
    guarded = ServingEngine(dataclasses.replace(common, allow_faults=True), info, settings)
    bare = ServingEngine(dataclasses.replace(common, standby_rungs=(), ladder=LadderConfig(guard=GUARD_PRESETS["off"])),
                         info, settings)
    extra: dict[str, ServingEngine] = {}
    if cores is not None:
        extra = {"elastic": ServingEngine(dataclasses.replace(common, int4_threads=cores, cores=cores), info, settings)}
    raw = BatchedLlamaCpp(info, n_slots=slots, n_ctx=n_ctx, n_threads=int4_threads, native_dir=None)
    raw.cache_prefix(template_prefix(info, raw.tokenize))  # the same prefill work as the engine's
    rec = OutcomeLog()
    try:
        normal, _ = load_corpora()
        corpus = [p for p in subset(normal, max(1, -(-3 * n_prompts // 8))) if isinstance(p.prompt, str)]
        candidates = [user_prompt_ids(info.chat_template, str(p.prompt), raw.tokenize) for p in corpus]
        kept, screened = _loop_free(raw, candidates, max_tokens, n_prompts, GUARD_PRESETS["default"])
        sets: dict[str, list[Job]] = {
            "all": [(corpus[k], candidates[k], None) for k in range(min(n_prompts, len(corpus)))],
            "screened": [(corpus[k], candidates[k], None) for k in kept]}
        screened["kept"] = [corpus[k].id for k in kept]
        rng = random.Random(seed)
        faulted = {name: _faulted(jobs, fault_share, max_tokens, rng) for name, jobs in sets.items()}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        # Warm-up: one short pass of each configuration (page faults, caches, first-call costs).
        short = SamplingParams(max_tokens=8, ignore_eos=True)
        warm = sets["all"][:2]
        engines = {"guarded": guarded, "bare": bare, "guarded_faulted": guarded, **extra}
        for name, se in (("guarded", guarded), ("bare", bare), *extra.items()):
            closed_loop(2, warm, _serve(se, short, rec, name, f"warmup/{name}", 0, 2, "warmup"))
        _raw(raw, warm, 2, 8, rec, "warmup/raw", 0, "warmup")
        order = ["guarded", "bare", "raw", "guarded_faulted", *extra]
        k = 0
        for r in range(rounds):
            for name, jobs in sets.items():
                for c in concurrency:
                    for config in order[k % len(order):] + order[:k % len(order)]:  # rotated: interleaved
                        window = f"{name}/{config}/c{c}/r{r}"
                        if config == "raw":
                            _raw(raw, jobs, c, max_tokens, rec, window, r, name)
                        else:
                            se = engines[config]
                            todo = faulted[name] if config == "guarded_faulted" else jobs
                            closed_loop(c, todo, _serve(se, params, rec, config, window, r, c, name))
                    k += 1
        head = {"benchmark": "serving", "environment": environment(int4_threads),
                "setup": {"prompt_sets": {n: len(j) for n, j in sets.items()}, "prompt_screen": screened,
                          "max_tokens": max_tokens, "ignore_eos": True, "greedy": True,
                          "concurrency": list(concurrency), "slots": slots, "n_ctx_per_slot": n_ctx,
                          "int4_threads": int4_threads, "standby_threads": standby_threads,
                          "elastic_cores": cores,
                          "standby": "fp32, 4 sessions round-robin",
                          "faulted_requests": {n: sum(f is not None for _, _, f in j) for n, j in faulted.items()},
                          "fault": "nan@step=K, K uniform in [1, max_tokens/2], seeded", "seed": seed,
                          "warm_up": "2 prompts x 8 tokens per configuration (written, not counted)",
                          "order": "each round: every prompt set and concurrency level, the configurations "
                                   "rotated within each", "rounds": rounds,
                          "clients": "closed loop, one thread per client"}}
    finally:
        guarded.close()
        bare.close()
        for se in extra.values():
            se.close()
        raw.close()
    if out_dir is None:
        return {**head, "figures": figures(rec.outcomes, RUN)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "outcomes.jsonl", rec.outcomes)
    results = {**head, "figures": figures(read_jsonl(out_dir / "outcomes.jsonl"), RUN)}
    import json

    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results
