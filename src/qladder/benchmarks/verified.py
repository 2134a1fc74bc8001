"""`qladder bench verified`: verified decoding against full precision alone and against vLLM's fp32.

Greedy answers (up to `max_tokens`, ending at EOS as a user's would) to the first prompts of each
class of the normal corpus, closed-loop clients at each concurrency, through:
    verified     the serving engine, every request verified, routed as the engine routes by default
                 (ServingConfig.verify_drafting = 1: drafts while nothing else uses the fp32 rung,
                 else fp32 alone): the configuration the verdicts read, because it is what a
                 user of `precision = "verified"` gets
    verified-drafting  the same with every request drafting (verify_drafting = slots): INT4
                 (llama.cpp, 1 thread) drafts, the batched fp32 rung (torch) decides every token
                 on the cores INT4 leaves (ServingConfig.cores = 2: one while a draft decodes,
                 both otherwise); the mechanism's own numbers, beside
    fp32         the same engine's batched fp32 rung alone (requests start on it): torch on both
                 cores (INT4 idle): full-precision answers without drafts
    int4         the same engine's INT4 answers (llama.cpp 1 thread: llama.cpp is not elastic,
                 see serving/cores.py), no drift audit
    int4-audit   the same with the drift audit at `audit_rate` (0.1): the audit's cost is
                 1 - its tok/s over int4's (the audits run on the standby when it is idle)
    vllm-fp32    vLLM's CPU server on the same fp32 weights (OMP_NUM_THREADS = 2, its own process),
                 the peer a user would pick for full-precision answers (its answers are vLLM's
                 fp32 numerics: compared for reading only)
Every configuration has the machine's 2 cores. Each round visits both concurrency levels, the
configurations rotated within each (interleaved). The main thread's torch stays at one thread
(the reference loop runs there: see serving/cores.py for why).

Exactness: every verified answer is compared with fp32's greedy answer from the naive one-token
loop on the one-sequence torch engine (`validate.replay.greedy`, phase "reference"); sampled
requests: `sampled_requests` verified and as many fp32-alone requests (temperature 1, top-k 20,
seeds 0..N-1, 3 tokens) on one prompt, and a two-sample chi-square test per position of the
token's distribution (`qladder.validate.verified_figures`). Every request is one line of
outcomes.jsonl; every figure comes from those lines (`qladder.validate.recompute`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from qladder.benchmarks.common import OutcomeLog, closed_loop, environment
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.vllm import VllmServer
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.validate.corpora import Prompt, load_corpora, subset
from qladder.validate.outcome import Outcome
from qladder.validate.replay import greedy

RUN = "bench-verified"
Job = tuple[Prompt, list[int], int]  # prompt, ids, seed
SAMPLED_PROMPT = "Tell me a story about a dragon."
SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, top_k=20)
THREADS = 2  # the cores every configuration gets
AUDIT_RATE = 0.1


def _outcome(config: str, window: str, p: Prompt, rnd: int, c: int, phase: str) -> Outcome:
    return Outcome(RUN, config, p.id, p.cls, "normal", round=rnd, phase=phase, split=p.split, prompt=str(p.prompt),
                   concurrency=c, window=window)


def _engine_run(se: ServingEngine, params: SamplingParams, log: OutcomeLog, config: str, window: str, rnd: int,
                c: int, phase: str) -> Callable[[Job], None]:
    def run(job: Job) -> None:
        p, ids, seed = job
        o = _outcome(config, window, p, rnd, c, phase)
        o.prompt_tokens = len(ids)
        o.start_s = log.now()
        try:
            par = dataclasses.replace(params, seed=seed)
            r = se.generate_sync(se.request(ids, par, verified=config.startswith("verified"),
                                            start_rung=1 if config.startswith("fp32") else 0, prompt_class=p.cls))
            o.token_ids, o.rungs, o.text = list(r.token_ids), list(r.token_rungs), r.text
            o.finish_reason, o.fallback = str(r.finish_reason), r.fallback
            o.hazards, o.handoff_ms = [h.check for h in r.hazards], [h.latency_ms for h in r.handoffs]
            o.ttft_ms, o.step_ms = r.timings.get("ttft_ms"), list(r.step_ms)
            if "verify_windows" in r.timings:
                o.verify_windows = int(r.timings["verify_windows"])
                o.verify_drafts = int(r.timings["verify_drafts"])
                o.verify_kept = int(r.timings["verify_kept"])
        except Exception as exc:  # counted, never dropped
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.end_s = log.now()
        o.latency_ms = (o.end_s - o.start_s) * 1e3
        log.add(o)

    return run


def _vllm_run(url: str, params: SamplingParams, log: OutcomeLog, window: str, rnd: int, c: int,
              phase: str) -> Callable[[Job], None]:
    client = httpx.Client(timeout=300.0)

    def run(job: Job) -> None:
        p, ids, seed = job
        o = _outcome("vllm-fp32", window, p, rnd, c, phase)
        o.prompt_tokens, o.token_ids_source = len(ids), "server"
        o.start_s = log.now()
        try:
            body = {"model": "fp32", "prompt": ids, "max_tokens": params.max_tokens, "temperature": params.temperature,
                    "seed": seed, "return_token_ids": True}
            r = client.post(f"{url}/v1/completions", json=body)
            o.status = r.status_code
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                o.token_ids = [int(t) for t in choice.get("token_ids") or []]
                o.text, o.finish_reason = choice.get("text", ""), choice.get("finish_reason")
                o.completion_tokens = int(r.json()["usage"]["completion_tokens"])
                o.status = "ok"
        except httpx.HTTPError as exc:
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
        o.end_s = log.now()
        o.latency_ms = (o.end_s - o.start_s) * 1e3
        log.add(o)

    return run


def run_verified_bench(per_class: int = 4, max_tokens: int = 64, concurrency: tuple[int, ...] = (1, 8),
                       rounds: int = 6, sampled_requests: int = 200, vllm: bool = True,
                       out_dir: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; returns results.json's content (and, with `out_dir`, writes outcomes.jsonl
    and results.json there)."""
    from qladder.validate.outcome import read_jsonl, write_jsonl
    from qladder.validate.recompute import figures

    settings = Settings(Settings.from_env().cache_dir, 1, 2048, True)
    info = inspect_model(None, settings.cache_dir)
    slots = max(concurrency)
    fp32 = load_engine("fp32", info, settings)
    torch.set_num_threads(1)
    se = ServingEngine(ServingConfig(slots=slots, n_ctx=2048, int4_threads=1, standby_threads=THREADS, cores=THREADS,
                                     standby_sessions=slots, audit_rate=AUDIT_RATE, audit_queue=256),
                       info, settings, standby_engines=[fp32])
    audits: list[dict[str, Any]] = []
    se.add_audit_observer(lambda a: audits.append(a.to_dict()))
    log = OutcomeLog()
    peer: VllmServer | None = None
    try:
        normal, _ = load_corpora()
        corpus = [p for p in subset(normal, per_class) if isinstance(p.prompt, str)]
        jobs: list[Job] = [(p, user_prompt_ids(info.chat_template, str(p.prompt), se.int4.tokenize), 0) for p in corpus]
        params = SamplingParams(max_tokens=max_tokens)
        # the reference: fp32's greedy answers from the naive one-token loop (one-sequence engine)
        for p, ids, _ in jobs:
            o = _outcome("fp32-naive", "reference", p, 0, 1, "reference")
            o.token_ids = greedy(fp32, ids, max_tokens)
            log.add(o)
        if vllm:
            peer = VllmServer(fp32_checkpoint(info, settings.cache_dir), max_num_seqs=slots, threads=THREADS,
                              log=(out_dir / "vllm.log") if out_dir else None)
            if out_dir:
                out_dir.mkdir(parents=True, exist_ok=True)
            peer.start()
        configs = ["verified", "verified-drafting", "fp32", "int4", "int4-audit", *(["vllm-fp32"] if peer else [])]

        def window_of(config: str, todo: list[Job], c: int, window: str, rnd: int, phase: str,
                      par: SamplingParams) -> None:
            se.draft_limit = slots if config == "verified-drafting" else 1
            se.audit_rate = AUDIT_RATE if config == "int4-audit" else 0.0
            if config == "vllm-fp32":
                assert peer is not None
                closed_loop(c, todo, _vllm_run(peer.base_url, par, log, window, rnd, c, phase))
            else:
                closed_loop(c, todo, _engine_run(se, par, log, config, window, rnd, c, phase))

        for config in configs:  # warm-up: written, never counted
            window_of(config, jobs[:2], 2, f"warmup/{config}", 0, "warmup", SamplingParams(max_tokens=8))
        k = 0
        for r in range(rounds):
            for c in concurrency:
                for config in configs[k % len(configs):] + configs[:k % len(configs)]:
                    window_of(config, jobs, c, f"{config}/c{c}/r{r}", r, "greedy", params)
                k += 1
        # sampled requests: verified vs fp32 alone, seeds 0..N-1, one prompt
        sp = Prompt("sampled-000", "chat", SAMPLED_PROMPT)
        sids = user_prompt_ids(info.chat_template, SAMPLED_PROMPT, se.int4.tokenize)
        seeded = [(sp, sids, s) for s in range(sampled_requests)]
        for config in ("verified", "fp32"):
            window_of(config, seeded, slots, f"sampled/{config}", 0, "sampled", SAMPLED)
        head = {"benchmark": "verified", "environment": environment(1),
                "setup": {"prompts": len(jobs), "per_class": per_class, "max_tokens": max_tokens,
                          "greedy": True, "ends": "at EOS or max_tokens", "concurrency": list(concurrency),
                          "rounds": rounds, "slots": slots, "cores": THREADS,
                          "threads": {"verified": "as routed: verified-drafting's, or fp32's",
                                      "verified-drafting": "int4 1 (llama.cpp) + fp32 1-2 (torch, elastic)",
                                      "fp32": "torch 2 (elastic, int4 idle)",
                                      "int4": "llama.cpp 1 (the other core idle)",
                                      "vllm-fp32": f"OMP_NUM_THREADS={THREADS}"},
                          "vllm": peer.flags() if peer else None,
                          "reference": "validate.replay.greedy on the one-sequence fp32 torch engine",
                          "sampled": {"prompt": SAMPLED_PROMPT, "requests_per_config": sampled_requests,
                                      "params": {"temperature": SAMPLED.temperature, "top_k": SAMPLED.top_k,
                                                 "max_tokens": SAMPLED.max_tokens}, "seeds": "0..N-1",
                                      "test": "two-sample chi-square per position, tokens with >= 5 draws "
                                              "binned, the rest pooled"},
                          "warm_up": "2 prompts x 8 tokens per configuration (written, not counted)",
                          "order": "each round: every concurrency level, the configurations rotated within each",
                          "clients": "closed loop, one thread per client",
                          "audit": {"rate": AUDIT_RATE, "queue": 256,
                                    "records": audits, "engine": se.stats()}}}
    finally:
        if peer is not None:
            peer.stop()
        se.close()
        fp32.close()
    if out_dir is None:
        return {**head, "figures": figures(log.outcomes, RUN)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "outcomes.jsonl", log.outcomes)
    results = {**head, "figures": figures(read_jsonl(out_dir / "outcomes.jsonl"), RUN)}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results
