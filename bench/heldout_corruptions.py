"""Weight corruptions the guard was never calibrated on, through qladder serve over a real
llama-server with a real vLLM standby: what the bare server answers, what qladder forwards by
default, and whether verified decoding gives vLLM's own answer.

Corruptions (GGUF copies, real llama.cpp kernels): the validation's held-out test set
(`fault_models.TEST_FAULT_MODELS`, the scale patches) and four more written here, one per kind
the issue names, used nowhere else in the project (no bound was set on them):
    attn_q_rows_x8       a moderate scale on a few rows of an attention projection
    attn_out_row_x300    a large scale on one row of an attention output
    ffn_up_many_x3       a small scale on many rows of an early FFN projection
    inf_block_l8         one block scale set to +inf (the NaN path)
Prompts: the first PROMPTS normal test-half prompts and the project's known-answer questions
(alternating). Per corruption and prompt, greedy, ANSWER tokens:
    bare      llama-server alone (/completion)
    default   qladder's serving engine with the topology's defaults (fast: the step guard, a flagged
              input's draft check)
    verified  the same with verified decoding
    fp32      vLLM alone, greedy (the reference)
Every answer is judged by the validation's judge (validate/garbage.py: symptoms from ids and text,
and the fp32 likelihood scored on vLLM). Verdicts, chosen before the run (exit 1 on a miss):
    default_garbage_beyond_fp32 == 0   a default answer that is garbage and not fp32's own answer
    verified_identical == 1.0          verified answers equal to vLLM's greedy answer (token ids)
Prints JSON (and writes it, with every answer, to OUT/results.json when OUT is given).

`--in-process`: the same corruptions, prompts and verdicts on qladder's own engines (no server):
    bare      the patched GGUF on the in-process INT4 rung alone (llama.cpp, no guard)
    default   the serving engine with its defaults over the patched GGUF and the clean fp32 rung
              (fast: the step guard on every token, no full-precision work on a clean answer's path)
    verified  the same with verified decoding
    fp32      the clean fp32 rung alone, greedy (the reference; it scores the judge's likelihood)

Usage: python bench/heldout_corruptions.py [OUT] [--prompts N] [--answer N] [--in-process]
       (6 prompts, 48 tokens)
"""

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from qladder.config import Settings
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.peers.vllm import VllmServer
from qladder.sampling import SamplingParams
from qladder.server.serve import build_server
from qladder.server.topology import remote_topology
from qladder.testing.gguf_patch import patch_scales
from qladder.validate.corpora import load_corpora
from qladder.validate.fault_models import TEST_FAULT_MODELS
from qladder.validate.garbage import judge, mean_nll
from qladder.validate.precision_table import known_prompts
from qladder.validate.remote import Fp32Judge

EXTRA: tuple[tuple[str, dict[str, object]], ...] = (
    ("attn_q_rows_x8", {"tensor": "blk.9.attn_q.weight", "rows": "0-63", "blocks": "all", "x": 8.0}),
    ("attn_out_row_x300", {"tensor": "blk.14.attn_output.weight", "rows": "100", "blocks": "all", "x": 300.0}),
    ("ffn_up_many_x3", {"tensor": "blk.2.ffn_up.weight", "rows": "0-511", "blocks": "all", "x": 3.0}),
    ("inf_block_l8", {"tensor": "blk.8.ffn_gate.weight", "rows": "7", "blocks": "0", "value": float("inf")}),
)


def corruptions() -> list[tuple[str, dict[str, object]]]:
    held = [(m.name, dict(m.gguf_patch)) for m in TEST_FAULT_MODELS if m.gguf_patch and m.patch == "scales"]
    return [*held, *EXTRA]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--answer", type=int, default=48)
    ap.add_argument("--in-process", action="store_true", help="qladder's own engines, no peer server")
    a = ap.parse_args()
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    normal = [p for p in load_corpora()[0] if p.split == "test"]
    known = known_prompts()
    texts = [str(x.prompt) for pair in zip(normal, known, strict=False) for x in pair][:a.prompts]
    t0 = time.perf_counter()
    rows: list[dict[str, object]] = []
    summary: dict[str, dict[str, int]] = {}
    if a.in_process:
        in_process(a, settings, info, texts, rows, summary)
        return report(a, texts, rows, summary, t0, in_process=True)
    with tempfile.TemporaryDirectory() as d, \
            VllmServer(fp32_checkpoint(info, settings.cache_dir), threads=1, extra=("--enforce-eager",)) as vllm:
        model = httpx.get(f"{vllm.base_url}/v1/models").json()["data"][0]["id"]
        fp32 = Fp32Judge(vllm.base_url, model)
        for name, patch in corruptions():
            gguf = Path(d) / f"{name}.gguf"
            patch_scales(info.path, gguf, **patch)  # type: ignore[arg-type]
            with LlamaServer(gguf, n_parallel=4, threads=1, n_ctx_per_slot=2048) as ls:
                server = build_server(remote_topology(ls.base_url, vllm.base_url, incidents=f"{d}/{name}.db"),
                                      settings)
                se = server.engine
                counts = new_counts()
                try:
                    for text in texts:
                        ids = user_prompt_ids(info.chat_template, text, se.int4.tokenize)
                        ref = fp32.greedy(ids, a.answer) or []
                        bare = httpx.post(f"{ls.base_url}/completion", timeout=300, json={
                            "prompt": ids, "n_predict": a.answer, "temperature": 0, "n_probs": 1,
                            "return_tokens": True, "cache_prompt": False}).json()
                        bare_ids = [int(p["id"]) for p in bare.get("completion_probabilities") or []]
                        tally(se, a, name, text, ids, ref, bare["content"], bare_ids, fp32.nll, counts, rows)
                finally:
                    server.close()
                summary[name] = counts
                print(name, json.dumps(counts), file=sys.stderr, flush=True)
    return report(a, texts, rows, summary, t0, in_process=False)


def new_counts() -> dict[str, int]:
    return {"prompts": 0, "bare_garbage": 0, "default_garbage": 0, "default_garbage_beyond_fp32": 0,
            "default_fp32_identical": 0, "verified_identical": 0, "default_handed_off": 0}


def tally(se: Any, a: argparse.Namespace, name: str, text: str, ids: list[int], ref: list[int], bare_text: str,
          bare_ids: list[int], nll: Callable[[list[int], list[int]], float | None], counts: dict[str, int],
          rows: list[dict[str, object]]) -> None:
    """One prompt on one corruption: the default and verified answers of `se`, judged beside the bare one."""
    default = se.generate_sync(se.request(ids, SamplingParams(max_tokens=a.answer)))
    verified = se.generate_sync(se.request(ids, SamplingParams(max_tokens=a.answer), verified=True))
    vb = judge(bare_text, bare_ids, text, nll(ids, bare_ids) if bare_ids else None)
    vd = judge(default.text, default.token_ids, text, nll(ids, default.token_ids) if default.token_ids else None)
    same = default.token_ids == ref[:len(default.token_ids)] and bool(default.token_ids)
    counts["prompts"] += 1
    counts["bare_garbage"] += vb.garbage
    counts["default_garbage"] += vd.garbage
    counts["default_garbage_beyond_fp32"] += vd.garbage and not same
    counts["default_fp32_identical"] += same
    counts["default_handed_off"] += bool(default.handoffs)
    counts["verified_identical"] += verified.token_ids == ref
    rows.append({"corruption": name, "prompt": text, "fp32": se.int4.detokenize(ref),
                 "bare": bare_text, "bare_verdict": vb.to_dict(),
                 "default": default.text, "default_verdict": vd.to_dict(),
                 "default_hazards": [(h.check, h.rung, h.step) for h in default.hazards],
                 "default_rungs": sorted(set(default.token_rungs)),
                 "verified": verified.text, "verified_identical": verified.token_ids == ref,
                 "verified_hazards": len(verified.hazards)})


def in_process(a: argparse.Namespace, settings: Settings, info: Any, texts: list[str],
               rows: list[dict[str, object]], summary: dict[str, dict[str, int]]) -> None:
    """Every corruption on qladder's own engines: a bare INT4 engine and a serving engine over the
    patched copy, the clean fp32 rung as the standby, the reference and the judge's scorer."""
    from qladder.engines import load_engine
    from qladder.serving import ServingConfig, ServingEngine
    from qladder.validate.replay import greedy, serve_bare

    fp32 = load_engine("fp32", info, settings)
    refs: dict[str, list[int]] = {}

    def nll(prompt: list[int], answer: list[int]) -> float | None:
        return mean_nll(fp32.score(prompt, answer))

    with tempfile.TemporaryDirectory() as d:
        for name, patch in corruptions():
            gguf = Path(d) / f"{name}.gguf"
            patch_scales(info.path, gguf, **patch)  # type: ignore[arg-type]
            patched = dataclasses.replace(info, path=gguf.resolve())  # the copy keeps the source's metadata
            bare = serve_bare(patched, settings).se
            cfg = ServingConfig(slots=4, n_ctx=settings.n_ctx, int4_threads=settings.n_threads,
                                standby_threads=settings.n_threads)
            se = ServingEngine(cfg, patched, settings, standby_engines=[fp32])
            counts = new_counts()
            try:
                for text in texts:
                    ids = user_prompt_ids(info.chat_template, text, se.int4.tokenize)
                    if text not in refs:
                        refs[text] = greedy(fp32, ids, a.answer)
                    b = bare.generate_sync(bare.request(ids, SamplingParams(max_tokens=a.answer)))
                    tally(se, a, name, text, ids, refs[text], b.text, b.token_ids, nll, counts, rows)
            finally:
                se.close()
                bare.close()
            summary[name] = counts
            print(name, json.dumps(counts), file=sys.stderr, flush=True)
    fp32.close()


def report(a: argparse.Namespace, texts: list[str], rows: list[dict[str, object]],
           summary: dict[str, dict[str, int]], t0: float, in_process: bool) -> int:
    total = {k: sum(c[k] for c in summary.values()) for k in next(iter(summary.values()))}
    verdicts = {"default_garbage_beyond_fp32": {"value": total["default_garbage_beyond_fp32"], "limit": 0,
                                                "pass": total["default_garbage_beyond_fp32"] == 0},
                "verified_identical": {"value": total["verified_identical"] / max(1, total["prompts"]), "limit": 1.0,
                                       "pass": total["verified_identical"] == total["prompts"]}}
    where = ({"benchmark": "held-out weight corruptions on qladder's in-process engines (llama.cpp int4 + torch fp32)",
              "engines": "ServingEngine defaults, 4 slots; int4 and fp32 threads as QLADDER_THREADS",
              "threads": Settings.from_env().n_threads} if in_process else
             {"benchmark": "held-out weight corruptions through qladder serve (llama-server + vLLM)",
              "llama_server": "-np 4 -t 1", "vllm": "0.32.0 CPU fp32, 1 thread, eager"})
    out = {**where, "answer_tokens": a.answer, "prompts": texts, "corruptions": dict(corruptions()),
           "mode": "fast (the default)",
           "machine": platform.processor() or platform.machine(), "wall_s": round(time.perf_counter() - t0, 1),
           "by_corruption": summary, "total": total, "verdicts": verdicts}
    print(json.dumps(out, indent=2, default=str))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps({**out, "answers": rows}, indent=1, default=str))
    return 0 if all(v["pass"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
