"""`qladder` command line: generate, bench. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qladder.errors import QladderError

if TYPE_CHECKING:
    from qladder.config import Settings
    from qladder.faults import Fault
    from qladder.incidents import IncidentStore
    from qladder.ladder import LadderConfig
    from qladder.sampling import SamplingParams
    from qladder.sanitize import SanitizeConfig
    from qladder.service import Answer, Qladder

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
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
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
) -> None:
    """Generate an answer to PROMPT through the guarded ladder (or one rung)."""
    try:
        out = _generate(prompt, rung or ladder, max_tokens, temperature, top_p, top_k, seed, stop or [],
                        fault or [], guard, sanitize, warm_shadow, return_after, model, incidents)
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
              return_after: int | None, model: Path | None, incidents: Path | None) -> dict[str, object]:
    from qladder.config import Settings
    from qladder.errors import ConfigError
    from qladder.faults import parse_fault
    from qladder.health.guard import GUARD_PRESETS
    from qladder.incidents import IncidentStore
    from qladder.ladder import LadderConfig
    from qladder.policy import LadderPolicy
    from qladder.sampling import SamplingParams
    from qladder.sanitize import PRESETS
    from qladder.service import Qladder, parse_ladder

    rungs = parse_ladder(ladder)
    from qladder.engines import RUNGS

    for r in rungs:
        if r not in RUNGS:
            raise ConfigError(f"unknown rung {r!r}; choose from {', '.join(RUNGS)}")
    if guard not in GUARD_PRESETS:
        raise ConfigError(f"unknown guard preset {guard!r}; choose from {', '.join(GUARD_PRESETS)}")
    if sanitize not in PRESETS:
        raise ConfigError(f"unknown sanitize preset {sanitize!r}; choose from {', '.join(PRESETS)}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    parsed = [parse_fault(f) for f in faults]
    _quiet_libraries()
    settings = Settings.from_env()
    store = IncidentStore(incidents or settings.cache_dir / "incidents.sqlite3")
    config = LadderConfig(guard=GUARD_PRESETS[guard], policy=LadderPolicy(return_after=return_after),
                          warm_shadow=warm_shadow)
    text: str | bytes = sys.stdin.buffer.read() if prompt == "-" else prompt
    served = rungs[0] == "int4" and not warm_shadow
    try:
        if served:  # the serving engine's one decode path (one slot), as the HTTP server uses it
            answer, q = _generate_served(text, rungs, params, parsed, config, PRESETS[sanitize], model,
                                         settings, store)
        else:  # a torch rung first, or a warm shadow: the in-process ladder
            q = Qladder(rungs, model=model, settings=settings, ladder_config=config,
                        sanitize_config=PRESETS[sanitize], incidents=store)
            try:
                answer = q.answer(text, params, parsed)
            finally:
                q.close()
    finally:
        store.close()
    out = answer.to_dict()
    out["ladder"] = rungs
    out["precisions"] = {e.name: e.precision for e in q.engines}
    out["faults"] = [str(f) for f in parsed]
    return out


def _generate_served(text: str | bytes, rungs: list[str], params: SamplingParams, faults: list[Fault],
                     config: LadderConfig, sanitize_config: SanitizeConfig, model: Path | None,
                     settings: Settings, store: IncidentStore) -> tuple[Answer, Qladder]:
    """One request through the serving engine (one slot): the decode path the server uses."""
    from qladder.service import Answer, Qladder
    from qladder.serving import ServingConfig, ServingEngine

    cfg = ServingConfig(slots=1, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                        standby_threads=settings.n_threads, standby_rungs=tuple(rungs[1:]), ladder=config,
                        allow_faults=True)  # the CLI's user is the operator
    se = ServingEngine(cfg, model=str(model) if model else None, settings=settings, incidents=store)
    try:
        q = Qladder(rungs, model=se.info, settings=settings, sanitize_config=sanitize_config,
                    engines=[se.int4, *se.standby_engines])
        ids, prompt_text, reports = q.prepare(text, params.max_tokens)
        result = se.generate_sync(se.request(ids, params, faults=faults, prompt_text=prompt_text))
        return Answer(result, reports), q
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
        "--faults", help="Fault model names (nan_logits, inf_logits, zero_logits, kernel_error, stall, "
                         "massive_activation, corrupted_scale, glitch_tokens) or raw fault specs like "
                         "nan@step=2 (repeatable).")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Override the answer length.")] = None,
    corpus: Annotated[Path | None, typer.Option(help="Folder with normal.jsonl and abnormal.jsonl.")] = None,
    standby_share: Annotated[float, typer.Option("--standby-share", help="Standby share of capacity.")] = 0.2,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """Replay the corpora through bare INT4 and the guarded ladder, and measure the three boundaries."""
    from qladder.validate.fault_models import by_name
    from qladder.validate.runner import ValidateConfig
    from qladder.validate.runner import validate as run_validate

    _quiet_libraries()
    try:
        by_name(faults or [])  # a malformed spec fails before any model loads
        overrides: dict[str, object] = {"fault_names": tuple(faults or ()), "corpus_dir": corpus,
                                        "standby_share": standby_share}
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        cfg = ValidateConfig.quick_preset(**overrides) if quick else ValidateConfig(**overrides)  # type: ignore[arg-type]
        results = run_validate(cfg, out, show_progress=progress, log=lambda s: typer.echo(s, err=True))
    except QladderError as exc:
        _fail(str(exc))
        return
    b, g = results["bare"], results["guarded"]
    typer.echo(f"bare:    garbage {b['garbage_rate']:.1%}  5xx {b['error_rate']:.1%}")
    typer.echo(f"guarded: garbage {g['garbage_rate']:.1%}  5xx {g['error_rate']:.1%}  "
               f"false handoffs {g['false_handoff_rate']:.1%}")
    typer.echo(f"report:  {out / 'report.html'}")


@bench_app.command("serving")
def bench_serving(
    prompts: Annotated[int, typer.Option(help="Prompts per configuration and concurrency.")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,4,8,16",
    fault_share: Annotated[float, typer.Option("--fault-share")] = 0.1,
    int4_threads: Annotated[int, typer.Option("--int4-threads")] = 1,
    standby_threads: Annotated[int, typer.Option("--standby-threads")] = 1,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds per level (tok/s: their median).")] = 2,
) -> None:
    """Many requests at once: guarded vs bare vs a raw batched llama.cpp loop, and 10% faulted."""
    from qladder.benchmarks.serving import run_serving_bench

    _quiet_libraries()
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
        out = run_serving_bench(prompts, max_tokens, levels, fault_share, int4_threads, standby_threads,
                                rounds=rounds)
    except (QladderError, ValueError) as exc:
        _fail(str(exc))
        return
    typer.echo(json.dumps(out))


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


def main() -> None:  # pragma: no cover
    app()
