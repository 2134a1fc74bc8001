"""`qladder` command line: generate, bench. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qladder.errors import ConfigError, QladderError
from qladder.types import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from qladder.config import Settings
    from qladder.incidents import IncidentBackend, IncidentStore
    from qladder.ladder import LadderConfig
    from qladder.sampling import SamplingParams
    from qladder.sanitize import SanitizeConfig
    from qladder.service import Answer
    from qladder.testing.faults import Fault

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="A precision ladder for quantized LLMs.")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks that print JSON.")
app.add_typer(bench_app, name="bench")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"qladder: error: {message}", err=True)
    raise typer.Exit(code)


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The user prompt; '-' reads it from standard input.")],
    rung: Annotated[str | None, typer.Option(help="Run one rung alone: int4, w4a16, fp32 or bf16.")] = None,
    ladder: Annotated[str, typer.Option(help="Rungs in order, e.g. int4,fp32 or int4,w4a16,fp32.")] = "int4",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    seed: int = 0,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    fault: Annotated[list[str] | None, typer.Option(help="Inject a fault on the first rung (repeatable).")] = None,
    guard: Annotated[str, typer.Option(help="Guard preset: default, logits, strict, off.")] = "default",
    sanitize: Annotated[str, typer.Option("--sanitize", help="Input sanitizer preset.")] = "default",
    warm_shadow: Annotated[bool, typer.Option("--warm-shadow", help="Prefill the fallback rung ahead.")] = False,
    return_after: Annotated[int | None, typer.Option("--return-after", help="Return to rung 0 after K tokens.")] = None,
    model: Annotated[Path | None, typer.Option(help="A Llama-family GGUF (default: the embedded model).")] = None,
    incidents: Annotated[Path | None, typer.Option(help="SQLite file for incident records.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    verified: Annotated[bool, typer.Option("--verified", help="Verified decoding: int4 drafts, the next rung "
                                                              "(fp32 when the ladder is int4 alone) decides every "
                                                              "token (its answer).")] = False,
) -> None:
    """Generate an answer to PROMPT through the guarded ladder (or one rung)."""
    try:
        out = _generate(prompt, rung or ladder, max_tokens, temperature, top_p, top_k, seed, stop or [],
                        fault or [], guard, sanitize, warm_shadow, return_after, model, incidents, verified)
    except QladderError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(out, ensure_ascii=False))
    else:
        typer.echo(out["text"])
        if out["hazards"]:
            typer.echo(f"[{len(out['hazards'])} hazard(s); finish: {out['finish_reason']}; rungs: "
                       f"{', '.join(sorted(set(out['token_rungs'])))}]", err=True)


def _generate(prompt: str, ladder: str, max_tokens: int, temperature: float, top_p: float, top_k: int,
              seed: int, stop: list[str], faults: list[str], guard: str, sanitize: str, warm_shadow: bool,
              return_after: int | None, model: Path | None, incidents: Path | None,
              verified: bool = False) -> dict[str, Any]:
    from qladder.config import Settings
    from qladder.errors import ConfigError
    from qladder.health.guard import GUARD_PRESETS
    from qladder.incidents import IncidentStore
    from qladder.ladder import LadderConfig
    from qladder.policy import LadderPolicy
    from qladder.sampling import SamplingParams
    from qladder.sanitize import PRESETS
    from qladder.service import Qladder, parse_ladder
    from qladder.testing import seam as fault_seam

    rungs = parse_ladder(ladder)
    if verified and rungs == ["int4"]:  # a verified answer needs a rung to decide: fp32 by default
        rungs = ["int4", "fp32"]
    from qladder.engines import check_rungs

    check_rungs(rungs)
    if guard not in GUARD_PRESETS:
        raise ConfigError(f"unknown guard preset {guard!r}; choose from {', '.join(GUARD_PRESETS)}")
    if sanitize not in PRESETS:
        raise ConfigError(f"unknown sanitize preset {sanitize!r}; choose from {', '.join(PRESETS)}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    parsed = list(fault_seam.parse(faults))
    _quiet_libraries()
    settings = Settings.from_env()
    store = IncidentStore(incidents or settings.cache_dir / "incidents.sqlite3")
    config = LadderConfig(guard=GUARD_PRESETS[guard], policy=LadderPolicy(return_after=return_after),
                          warm_shadow=warm_shadow)
    text: str | bytes = sys.stdin.buffer.read() if prompt == "-" else prompt
    served = rungs[0] == "int4" and not warm_shadow
    if verified and not (served and len(rungs) > 1):
        raise ConfigError("--verified needs a ladder that starts on int4 with a rung above it "
                          "(e.g. --ladder int4,fp32), without --warm-shadow")
    try:
        if served:  # the serving engine's one decode path (one slot), as the HTTP server uses it
            answer, precisions = _generate_served(text, rungs, params, parsed, config, PRESETS[sanitize], model,
                                                  settings, store, verified)
        else:  # a torch rung first, or a warm shadow: the in-process ladder
            q = Qladder(rungs, model=model, settings=settings, ladder_config=config,
                        sanitize_config=PRESETS[sanitize], incidents=store)
            try:
                answer = q.answer(text, params, parsed)
                precisions = {e.name: e.precision for e in q.engines}
            finally:
                q.close()
    finally:
        store.close()
    out = answer.to_dict()
    out["ladder"] = rungs
    out["precisions"] = precisions
    out["faults"] = [str(f) for f in parsed]
    return out


def _generate_served(text: str | bytes, rungs: list[str], params: SamplingParams, faults: list[Fault],
                     config: LadderConfig, sanitize_config: SanitizeConfig, model: Path | None,
                     settings: Settings, store: IncidentStore, verified: bool = False) -> tuple[Answer, dict[str, str]]:
    """One request through the serving engine (one slot): the decode path the server uses.
    Returns the answer and each rung's precision."""
    from qladder.prepare import Preparer
    from qladder.service import Answer
    from qladder.serving import ServingConfig, ServingEngine

    cfg = ServingConfig(slots=1, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                        standby_threads=settings.n_threads, standby_rungs=tuple(rungs[1:]), ladder=config,
                        allow_faults=True)  # the CLI's user is the operator
    se = ServingEngine(cfg, model=str(model) if model else None, settings=settings, incidents=store)
    try:
        prep = Preparer(se.info, se.int4.tokenize, min(se.n_ctx), sanitize_config)
        ids, prompt_text, reports = prep.prepare(text, params.max_tokens)
        result = se.generate_sync(se.request(ids, params, faults=faults, prompt_text=prompt_text, verified=verified))
        return Answer(result, reports), {e.name: e.precision for e in (se.int4, *se.standby_engines)}
    finally:
        se.close()


@bench_app.command("engines")
def bench_engines(
    rungs: Annotated[str, typer.Option(help="Rungs to measure.")] = "int4,w4a16,fp32",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens")] = 64,
    rounds: int = 3,
    as_json: Annotated[bool, typer.Option("--json")] = True,
) -> None:
    """Per rung: decode tok/s, prefill tok/s, RSS, load times, and the memory-bandwidth bound."""
    from qladder.benchmarks.engines import run_engine_bench

    _quiet_libraries()
    try:
        out = run_engine_bench(rungs.split(","), decode_tokens=decode_tokens, rounds=rounds)
    except QladderError as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out, indent=2 if not as_json else None))


@bench_app.command("guard")
def bench_guard(
    steps: Annotated[int, typer.Option(help="Decode steps per configuration.")] = 400,
    as_json: Annotated[bool, typer.Option("--json")] = True,
) -> None:
    """Guarded vs bare int4 step time (interleaved) and handoff latency with and without warm shadow."""
    from qladder.benchmarks.guard import run_guard_bench

    _quiet_libraries()
    try:
        out = run_guard_bench(steps=steps)
    except QladderError as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out, indent=2 if not as_json else None))


@app.command()
def validate(
    quick: Annotated[bool, typer.Option("--quick", help="A small subset that finishes in minutes.")] = False,
    out: Annotated[Path, typer.Option(help="Folder for results.json, report.md, report.html, PNGs.")] = Path(
        "qladder-validate"),
    faults: Annotated[list[str] | None, typer.Option(
        "--faults", help="Fault model names (train: nan_logits, inf_logits, zero_logits, kernel_error, stall, "
                         "massive_activation, corrupted_scale, inf_scale, glitch_tokens; test: nan_logits_late, "
                         "... see qladder.validate.fault_models) or raw fault specs like nan@step=2 (repeatable; "
                         "a raw spec joins the test set).")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Override the answer length.")] = None,
    rounds: Annotated[int | None, typer.Option(
        "--rounds", min=1, help="Override the rounds of normal prompts (the pooled P99 verdict needs >= 500 "
                                "requests per side, else it reads insufficient).")] = None,
    corpus: Annotated[Path | None, typer.Option(help="Folder with normal.jsonl and abnormal.jsonl.")] = None,
    standby_share: Annotated[float, typer.Option("--standby-share", help="Standby share of capacity.")] = 0.2,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    remote: Annotated[bool, typer.Option("--remote", help="On real servers: bare llama-server vs qladder serve "
                                                          "over llama-server + vLLM.")] = False,
    config: Annotated[Path | None, typer.Argument(help="With --remote: a run config (see "
                                                       "qladder/validate/remote_example.toml).")] = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 when a target is missed (the verdicts are "
                                                        "printed and reported either way).")] = False,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads of each engine (default: "
                                                "QLADDER_THREADS, else 1; recorded in results.json).")] = None,
) -> None:
    """Replay the corpora through bare INT4 and the guarded ladder, and measure the three boundaries.

    Writes outcomes.jsonl (every request) and results.json (every figure, computed from it:
    `python -m qladder.validate.recompute OUT` recomputes and compares)."""
    from qladder.validate.fault_models import by_name
    from qladder.validate.runner import ValidateConfig
    from qladder.validate.runner import validate as run_validate

    _quiet_libraries()
    if remote:
        if threads is not None:
            _fail("--threads is for the in-process run (a remote run config sets its servers' threads)")
            return
        _validate_remote(quick, out, config, max_tokens, rounds, corpus, progress, check)
        return
    if config is not None:
        _fail("a CONFIG argument goes with --remote")
        return
    try:
        by_name(faults or [])  # a malformed spec fails before any model loads
        overrides: dict[str, Any] = {"fault_names": tuple(faults or ()), "corpus_dir": corpus,
                                        "standby_share": standby_share,
                                        **_given(max_tokens=max_tokens, rounds=rounds, threads=threads)}
        cfg = ValidateConfig.quick_preset(**overrides) if quick else ValidateConfig(**overrides)
        results = run_validate(cfg, out, show_progress=progress, log=lambda s: typer.echo(s, err=True))
    except QladderError as exc:
        _fail(str(exc))
        return
    _verdicts(results, out, check)


@app.command()
def sweep(
    quick: Annotated[bool, typer.Option("--quick", help="A prompt of each class per half, short answers "
                                                        "(minutes).")] = False,
    out: Annotated[Path, typer.Option(help="Folder for outcomes.jsonl, results.json, report.md, "
                                           "boundary.png.")] = Path("qladder-sweep"),
    model: Annotated[Path | None, typer.Option(help="The highest-precision GGUF you have (F32/F16/BF16 as it is; a "
                                                     "quantized one is dequantized to F32 first). Default: the "
                                                     "embedded model (its full precision: the fp32 rung's).")] = None,
    levels: Annotated[str | None, typer.Option(help="Comma-separated levels (default: Q2_K,Q3_K_M,Q4_0,Q4_1,"
                                                    "Q4_K_M,Q5_K_M,Q6_K,Q8_0).")] = None,
    reference: Annotated[str, typer.Option(
        help="The level whose train-half intervals are the default bound.")] = "Q8_0",
    min_agreement: Annotated[float | None, typer.Option(
        "--min-agreement", min=0.0, max=1.0,
        help="Your bound instead: teacher-forced top-1 agreement per class.")] = None,
    max_garbage: Annotated[float | None, typer.Option(
        "--max-garbage", min=0.0, max=1.0, help="Your bound instead: the bare garbage rate per class.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads of each engine (default: "
                                                "QLADDER_THREADS, else 1).")] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """The precision boundary over quantization levels: llama.cpp's quantizer makes each level from
    the model's full-precision weights; each is measured for agreement with fp32, garbage (bare and
    guarded), hazards, throughput at c1 and c8, and memory, by prompt class.

    `python -m qladder.validate.sweep_figures OUT` recomputes every figure from outcomes.jsonl."""
    from qladder.validate.sweep import SweepConfig
    from qladder.validate.sweep import sweep as run_sweep

    _quiet_libraries()
    try:
        kw: dict[str, Any] = {"reference_level": reference, "model": model,
                              **_given(min_agreement=min_agreement, max_garbage=max_garbage, threads=threads)}
        if levels:
            kw["levels"] = tuple(x.strip() for x in levels.split(",") if x.strip())
        cfg = SweepConfig.quick_preset(**kw) if quick else SweepConfig(**kw)
        results = run_sweep(cfg, out, show_progress=progress, log=lambda s: typer.echo(s, err=True))
    except QladderError as exc:
        _fail(str(exc))
        return
    rec = results["figures"]["recommendation"]
    typer.echo(json.dumps({"recommendation": rec["level"], "bits_per_weight": rec["bits_per_weight"],
                           "verdicts": rec["verdicts"], "out": str(out)}, indent=2))


def _given(**options: object) -> dict[str, object]:
    """The options the user gave (not None): they override a run config's defaults."""
    return {k: v for k, v in options.items() if v is not None}


def _verdicts(results: dict[str, object], out: Path, check: bool) -> None:
    import sys

    from qladder.validate.recompute import print_verdicts

    f = results["figures"]
    assert isinstance(f, dict)
    if f.get("precision"):
        from qladder.validate.report import precision_table

        head, rows = precision_table(f)
        typer.echo("precision boundary (no fault; identical to fp32 k/n, top-1 agreement, median first divergence):")
        for row in [head, *rows]:
            typer.echo("  " + " | ".join(row))
    print_verdicts(f)
    typer.echo(f"report:  {out / 'report.html'}")
    if check and f["verdict"] != "pass":
        from qladder.validate.recompute import exit_code

        sys.exit(exit_code(f["verdict"]))  # 1 on a FAIL, 3 on INCONCLUSIVE


def _validate_remote(quick: bool, out: Path, config: Path | None, max_tokens: int | None, rounds: int | None,
                     corpus: Path | None, progress: bool, check: bool) -> None:
    import dataclasses

    from qladder.validate.remote import load_remote_config, validate_remote

    try:
        cfg = load_remote_config(config, quick)
        overrides: dict[str, Any] = {"corpus_dir": corpus, **_given(max_tokens=max_tokens, rounds=rounds)}
        cfg = dataclasses.replace(cfg, **overrides)
        if out == Path("qladder-validate"):
            out = Path("qladder-validate-remote")
        results = validate_remote(cfg, out, show_progress=progress, log=lambda s: typer.echo(s, err=True))
    except QladderError as exc:
        _fail(str(exc))
        return
    _verdicts(results, out, check)


@bench_app.command("serving")
def bench_serving(
    prompts: Annotated[int, typer.Option(help="Prompts per configuration and concurrency.")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,4,8,16",
    fault_share: Annotated[float, typer.Option("--fault-share")] = 0.1,
    int4_threads: Annotated[int, typer.Option("--int4-threads")] = 1,
    standby_threads: Annotated[int, typer.Option("--standby-threads")] = 1,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds per level: one window a configuration "
                                                     "each; tok/s pooled over them with a bootstrap interval "
                                                     "(a verdict needs >= 6).")] = 6,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write outcomes.jsonl and results.json "
                                                              "here (bench/check_serving.py OUT recomputes).")] = None,
    elastic: Annotated[int | None, typer.Option("--elastic", help="Also elastic INT4 on N cores "
                                                                  "(serving/cores.py).")] = None,
) -> None:
    """Many requests at once: guarded vs bare vs a raw batched llama.cpp loop, and 10% faulted."""
    from qladder.benchmarks.serving import run_serving_bench

    _quiet_libraries()
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
        out = run_serving_bench(prompts, max_tokens, levels, fault_share, int4_threads, standby_threads,
                                rounds=rounds, out_dir=out_dir, cores=elastic)
    except (QladderError, ValueError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out))


@bench_app.command("verified")
def bench_verified(
    per_class: Annotated[int, typer.Option("--per-class", help="Normal prompts per class (chat, qa, code, math).")] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,8",
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds per level: one window a configuration "
                                                     "each; tok/s pooled over them with a bootstrap interval "
                                                     "(a verdict needs >= 6).")] = 6,
    sampled: Annotated[int, typer.Option("--sampled", help="Sampled requests per configuration (the "
                                                           "distribution test).")] = 200,
    vllm: Annotated[bool, typer.Option("--vllm/--no-vllm", help="Compare with vLLM's CPU fp32 server.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results JSON (the default).")] = True,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write outcomes.jsonl and results.json "
                                                              "here (bench/check_verified.py OUT recomputes).")] = None,
) -> None:
    """Verified decoding against full precision alone and vLLM's fp32: tok/s, P99, exactness, acceptance."""
    from qladder.benchmarks.verified import run_verified_bench

    _quiet_libraries()
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
        out = run_verified_bench(per_class, max_tokens, levels, rounds, sampled, vllm, out_dir)
    except (QladderError, ValueError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out, default=str))


@bench_app.command("calibrate")
def bench_calibrate(
    limit: Annotated[int | None, typer.Option(help="Use only the first N normal prompts.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 48,
) -> None:
    """Guard statistics on clean traffic against the preset thresholds; the false-handoff rate."""
    from qladder.benchmarks.calibrate import run_calibration

    _quiet_libraries()
    try:
        out = run_calibration(limit=limit, max_tokens=max_tokens)
    except QladderError as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out))


@bench_app.command("serve")
def bench_serve(
    duration: Annotated[float, typer.Option(help="Seconds of the faulted load.")] = 120.0,
    window: Annotated[float, typer.Option(help="Seconds per server per round in the comparison.")] = 60.0,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds of the comparison, one window per server "
                                                    "each (tok/s pooled with a bootstrap interval: a verdict needs "
                                                    ">= 6; the pooled P99 needs >= 500 requests per server, "
                                                    "--rounds 9 on a 2-core box).")] = 6,
    clients: Annotated[int, typer.Option(help="Concurrent streaming clients.")] = 16,
    fault_share: Annotated[float, typer.Option("--fault-share")] = 0.1,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    slots: Annotated[int, typer.Option(help="INT4 slots (llama-server -np).")] = 8,
    threads: Annotated[int, typer.Option(help="INT4 threads (llama-server -t/-tb).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (always JSON).")] = True,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write outcomes.jsonl and results.json "
                                                              "here (bench/check_serve.py OUT recomputes).")] = None,
    box: Annotated[bool, typer.Option("--box", help="The whole machine: qladder on its default (elastic) cores, "
                                                    "llama-server on every core (--threads ignored).")] = False,
) -> None:
    """Load test of `qladder serve` (guarded, faulted, burst; then guarded vs guard-off vs llama-server)."""
    from qladder.benchmarks.serve_load import run_serve_bench

    _quiet_libraries()
    try:
        out = run_serve_bench(duration, window, rounds, clients, fault_share, max_tokens, slots, threads,
                              log=lambda m: typer.echo(m, err=True), out_dir=out_dir, box=box)
    except (QladderError, RuntimeError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out, indent=None if as_json else 2))


@bench_app.command("fleet")
def bench_fleet(
    window: Annotated[float, typer.Option(help="Seconds per side per round in the comparison.")] = 30.0,
    rounds: Annotated[int, typer.Option(min=1, help="Interleaved rounds of the comparison, one window a side "
                                                    "each (a verdict needs >= 6).")] = 6,
    clients: Annotated[int, typer.Option(help="Concurrent streaming clients, half on each gateway.")] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    phase: Annotated[float, typer.Option(help="Seconds of load in the kill and Redis phases.")] = 20.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (always JSON).")] = True,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write outcomes.jsonl and results.json "
                                                              "here (bench/check_fleet.py OUT recomputes).")] = None,
) -> None:
    """Two gateways sharing Redis over two llama-server replicas: throughput against the replicas
    straight, a replica killed mid-load, Redis killed, a faulted burst on one gateway, incidents
    in PostgreSQL (benchmarks/fleet.py)."""
    from qladder.benchmarks.fleet import run_fleet_bench

    _quiet_libraries()
    try:
        out = run_fleet_bench(window, rounds, clients, max_tokens, phase_s=phase,
                              log=lambda m: typer.echo(m, err=True), out_dir=out_dir)
    except (QladderError, RuntimeError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out, indent=None if as_json else 2, default=str))


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="Topology TOML file (pools, breakers, ...).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    api_key: Annotated[list[str] | None, typer.Option("--api-key", help="Accepted bearer key (repeatable).")] = None,
    api_keys_file: Annotated[Path | None, typer.Option("--api-keys-file", help="Bearer keys, one a line.")] = None,
    allow_faults: Annotated[bool, typer.Option("--allow-faults", help="Let requests inject faults.")] = False,
    redact: Annotated[bool, typer.Option("--redact", help="Store prompt fingerprints only.")] = False,
    incidents: Annotated[str | None, typer.Option(help="Incident records: a SQLite file, or a PostgreSQL URL "
                                                      "(postgresql://user@host:port/db).")] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    workers: Annotated[int, typer.Option(help="Gateway processes on the one port (remote pools only; they "
                                              "share breakers and quarantine through [state]).")] = 1,
) -> None:
    """Serve the ladder over HTTP, OpenAI-compatible (chat/completions, completions, models, metrics).
    Every key of the --config file: `qladder config reference` (docs/CONFIG.md)."""
    import dataclasses
    import logging

    from qladder.server.serve import build_server, check_workers, is_loopback, run, run_workers
    from qladder.server.topology import load_topology

    _quiet_libraries()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        t = load_topology(config)
        over: dict[str, Any] = {}
        if allow_faults:
            over["allow_faults"] = True
        if redact:
            over["redact"] = True
        if incidents is not None:
            over["incidents"] = incidents
        t = dataclasses.replace(t, server=dataclasses.replace(t.server, **over))
        keys = list(api_key or [])
        if api_keys_file is not None:
            try:
                keys += [k.strip() for k in api_keys_file.read_text().splitlines() if k.strip()]
            except OSError as exc:
                raise QladderError(f"cannot read the keys file {api_keys_file}: {exc.strerror}") from exc
        if not keys and not is_loopback(host):
            typer.echo(f"qladder: warning: serving on {host} beyond loopback with no API key; "
                       "anyone who can reach it can use it (--api-key or --api-keys-file)", err=True)
        if t.server.allow_faults:
            typer.echo("qladder: warning: --allow-faults: clients can inject faults (validation and load tests only)",
                       err=True)
        warning = check_workers(t, workers)
        if warning is not None:
            typer.echo(f"qladder: warning: {warning}", err=True)
        if workers == 1:
            server = build_server(t, api_keys=keys)
    except QladderError as exc:
        _fail(str(exc))
        return
    if workers > 1:
        typer.echo(f"qladder: serving {t.server.model_name} on http://{host}:{port}/v1 with {workers} workers "
                   f"(pools: {', '.join(p.name + '=' + '+'.join(p.rungs) for p in t.pools)})", err=True)
        try:
            run_workers(t, keys, workers, host, port, log_level)
        except QladderError as exc:  # a worker could not build its server: every worker stopped
            _fail(str(exc))
        return
    typer.echo(f"qladder: serving {t.server.model_name} on http://{host}:{port}/v1 "
               f"(pools: {', '.join(p.name + '=' + '+'.join(p.rungs) for p in t.pools)})", err=True)
    run(server, host, port, log_level)


config_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="The topology file: its reference, and a file's effective configuration.")
app.add_typer(config_app, name="config")


@config_app.command("reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown; docs/CONFIG.md is this output)."""
    from qladder.server.config_reference import render_markdown

    typer.echo(render_markdown(), nl=False)


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Argument(help="A topology TOML file (none: the defaults).")] = None,
    bare: Annotated[bool, typer.Option("--bare", help="Keys and values only, no docs.")] = False,
) -> None:
    """Print a file's effective configuration, every key with its value (its mistakes: exit 2)."""
    from qladder.server.config_reference import render_toml
    from qladder.server.topology import load_topology

    try:
        t = load_topology(config)
    except ConfigError as exc:
        _fail(str(exc))
    typer.echo(render_toml(t, comments=not bare), nl=False)


faults_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Faults for testing a guard on one's own model (validation tools).")
app.add_typer(faults_app, name="faults")


@faults_app.command("patch-gguf")
def faults_patch_gguf(
    model: Annotated[Path, typer.Argument(help="The GGUF to copy (Q4_0, Q4_1 or Q8_0 tensors).")],
    out: Annotated[Path, typer.Argument(help="Where to write the patched copy.")],
    tensor: Annotated[str | None, typer.Option(help="The tensor whose block scales to patch, e.g. "
                                                    "blk.11.ffn_down.weight.")] = None,
    rows: Annotated[str, typer.Option(help="Rows: all, 5, 0-3 or 0-3,7,10-12.")] = "all",
    blocks: Annotated[str, typer.Option(help="Quantization blocks of each row: all, 0, 0-3, ...")] = "all",
    scale: Annotated[float | None, typer.Option(help="Multiply each chosen block's scale (or, with "
                                                     "--glitch-tokens, each embedding) by this.")] = None,
    set_value: Annotated[str | None, typer.Option("--set", help="Set each chosen block's scale to this "
                                                                "(a number, or inf).")] = None,
    glitch_tokens: Annotated[str | None, typer.Option(
        "--glitch-tokens", help="Instead of a tensor: scale the input embeddings of these tokens (byte-fallback, "
                                "partial-utf8, or ids like 100,200-210) by --scale, the output matrix untied.")] = None,
) -> None:
    """Write a patched copy of a GGUF: corrupted quantization scales or glitch-token embeddings,
    to run through llama.cpp's real kernels (llama-server -m OUT, or `qladder validate`)."""
    from qladder.testing.gguf_patch import glitch_gguf, patch_scales

    try:
        if glitch_tokens is not None:
            if tensor is not None or set_value is not None or scale is None:
                raise ConfigError("--glitch-tokens takes --scale X, and no --tensor or --set")
            change = glitch_gguf(model, out, x=scale, tokens=glitch_tokens)
        else:
            if tensor is None or (scale is None) == (set_value is None):
                raise ConfigError("give --tensor and exactly one of --scale X or --set VALUE (or --glitch-tokens)")
            try:
                value = None if set_value is None else float(set_value)
            except ValueError as exc:
                raise ConfigError(f"--set {set_value!r} is not a number") from exc
            change = patch_scales(model, out, tensor, rows, blocks, x=scale, value=value)
    except (QladderError, OSError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps({"wrote": str(out), **change}, default=str))


incidents_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The incident store: list, show, replay.")
app.add_typer(incidents_app, name="incidents")


def _store(db: str | None) -> IncidentBackend:
    from qladder.config import Settings
    from qladder.incidents import is_postgres_url, open_incident_store

    if db is not None and is_postgres_url(db):
        return open_incident_store(db)
    path = Path(db) if db else Settings.from_env().cache_dir / "incidents.sqlite3"
    if not path.exists():
        raise QladderError(f"no incident store at {path}")
    return open_incident_store(path)


DbOption = Annotated[str | None, typer.Option("--db", help="The SQLite file (default: <cache>/incidents.sqlite3) "
                                                            "or a PostgreSQL URL (postgresql://user@host:port/db).")]
SinceOption = Annotated[str | None, typer.Option(help="Only incidents since: an ISO time, or an age like 30m, 2h, 1d.")]


@incidents_app.command("list")
def incidents_list(db: DbOption = None, limit: int = 50, since: SinceOption = None,
                   as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The newest incidents, one line each."""
    from qladder.incident_replay import parse_since

    try:
        store = _store(db)
        rows = store.rows(limit, parse_since(since))
        store.close()
    except QladderError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(rows, default=str))
        return
    import datetime as dt

    for r in rows:
        when = dt.datetime.fromtimestamp(r["ts"], dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        typer.echo(f"{r['id']:>6}  {when}  {r['rung']:<6} {r['check_name']:<11} step {r['step']:<4} "
                   f"{r['action']:<16} prompt {r['prompt_hash']}  req {r['request_id']}")


@incidents_app.command("audits")
def incidents_audits(db: DbOption = None, limit: int = 50, since: SinceOption = None,
                     as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The newest drift audits (INT4's agreement with full precision per answer, and fp32's mean
    excess surprise at its tokens), per class and source."""
    from qladder.incident_replay import parse_since

    try:
        store = _store(db)
        rows = store.audits(limit, parse_since(since))
        store.close()
    except QladderError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(rows, default=str))
        return
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}  # each source apart
    for r in rows:
        by.setdefault((r["prompt_class"], r["source"]), []).append(r)
    for (cls, source), rs in sorted(by.items()):
        tokens = sum(r["tokens"] for r in rs)
        agree = sum(r["tokens"] * r["agreement"] for r in rs) / tokens if tokens else float("nan")
        scored = [r["excess"] for r in rs if r.get("excess") is not None]
        excess = f"  excess {sum(scored) / len(scored):+.3f}" if scored else ""
        typer.echo(f"{cls:<9} {source:<7} {len(rs):>5} answers  {tokens:>7} tokens  agreement {agree:.3f}  "
                   f"diverged {sum(r['first_divergence'] is not None for r in rs)}{excess}")


@incidents_app.command("show")
def incidents_show(incident_id: Annotated[int, typer.Argument(help="The incident's id.")], db: DbOption = None) -> None:
    """One incident in full, as JSON."""
    try:
        store = _store(db)
        row = store.get(incident_id)
        store.close()
        if row is None:
            raise QladderError(f"no incident {incident_id}")
    except QladderError as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(row, indent=2, default=str, ensure_ascii=False))


@incidents_app.command("replay")
def incidents_replay(
    db: DbOption = None,
    rungs: Annotated[str, typer.Option(help="Rungs to replay the stored prompts on.")] = "int4,fp32",
    since: SinceOption = None,
    limit: Annotated[int, typer.Option(help="At most this many distinct prompts.")] = 20,
    with_faults: Annotated[bool, typer.Option("--with-faults", help="Inject the recorded faults again.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Replay stored prompts against chosen rungs (greedy) and say whether each hazard reproduces."""
    from qladder.incident_replay import parse_since, replay_incidents

    _quiet_libraries()
    try:
        store = _store(db)
        rows = store.rows(100_000, parse_since(since))
        store.close()
        out = replay_incidents(rows, [r.strip() for r in rungs.split(",") if r.strip()], limit, with_faults)
    except QladderError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(out))
        return
    for r in out["replays"]:
        verdicts = "  ".join(f"{rung}: {v['verdict']}" for rung, v in r["rungs"].items())
        typer.echo(f"prompt {r['prompt_hash']}  (incidents {','.join(map(str, r['incident_ids']))}; "
                   f"was {r['check']} on {r['rung']} at step {r['step']})  {verdicts}")


def main() -> None:  # pragma: no cover
    app()
