"""Verified decoding over llama-server and vLLM against vLLM alone, one client, greedy.

One run, interleaved per prompt (so both see the same machine state): for each of the first N normal
test prompts (the chat template applied), in turn
    verified   qladder's serving engine, remote pools (llama-server drafts, vLLM decides)
    vllm       vLLM's /v1/completions alone, greedy (the full-precision answer it must equal)
    fast       qladder's serving engine, the same request without `verified` (INT4's answer, guarded:
               the pool as it streams)
Each answer ANSWER tokens at most, one request at a time; warm-up: one request of each first.
Prints JSON: per mode the tokens, seconds and tok/s (sum of tokens over sum of latencies) and the
median per-prompt latency; the ratio verified / vllm in tok/s (medians of per-prompt ratios too);
exactness (verified text equal to vLLM's, per prompt); the windows, drafts and drafts that stood.

Usage: python bench/remote_verified.py [N [ANSWER]]   (12, 64)
"""

import json
import platform
import statistics
import sys
import tempfile
import time

import httpx

from qladder.config import Settings
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.peers.vllm import VllmServer
from qladder.sampling import SamplingParams
from qladder.server.serve import build_server
from qladder.server.topology import remote_topology
from qladder.validate.corpora import load_corpora


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    answer = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    prompts = [p for p in load_corpora()[0] if p.split == "test"][:n]
    out: dict[str, object] = {"benchmark": "remote verified decoding, c1, greedy", "prompts": len(prompts),
                              "answer_tokens": answer, "llama_server": "-np 4 -t 1",
                              "vllm_server": "0.32.0 CPU fp32, 1 thread (compiled, not eager)",
                              "machine": platform.processor() or platform.machine(), "interleaved": "per prompt",
                              "warmup": "one request per mode"}
    with tempfile.TemporaryDirectory() as d, \
            VllmServer(fp32_checkpoint(info, settings.cache_dir), threads=1) as vllm, \
            LlamaServer(info.path, n_parallel=4, threads=1, n_ctx_per_slot=2048) as ls:
        t = remote_topology(ls.base_url, vllm.base_url, incidents=f"{d}/incidents.db")
        server = build_server(t, settings)
        se = server.engine
        try:
            def verified(ids: list[int]) -> list[int]:
                return se.generate_sync(se.request(ids, SamplingParams(max_tokens=answer), verified=True)).token_ids

            def fast(ids: list[int]) -> list[int]:
                return se.generate_sync(se.request(ids, SamplingParams(max_tokens=answer))).token_ids

            def alone(ids: list[int]) -> list[int]:
                r = httpx.post(f"{vllm.base_url}/v1/completions", timeout=300, json={
                    "model": "fp32", "prompt": ids, "max_tokens": answer, "temperature": 0,
                    "return_token_ids": True, "skip_special_tokens": False}).json()
                return [t for t in r["choices"][0]["token_ids"] if t not in se.int4.eos_ids]

            modes = {"verified": verified, "vllm": alone, "fast": fast}
            warm = user_prompt_ids(info.chat_template, "Hello!", se.int4.tokenize)
            for f in modes.values():
                f(warm)
            rows: dict[str, list[tuple[int, float]]] = {k: [] for k in modes}
            same = []
            for p in prompts:
                ids = user_prompt_ids(info.chat_template, str(p.prompt), se.int4.tokenize)
                got = {}
                for name, f in modes.items():
                    t0 = time.perf_counter()
                    got[name] = f(ids)
                    rows[name].append((len(got[name]), time.perf_counter() - t0))
                same.append(got["verified"] == got["vllm"])
            stats = dict(se.remote.verified) if se.remote else {}
        finally:
            server.close()
    for name, r in rows.items():
        toks, secs = sum(k for k, _ in r), sum(s for _, s in r)
        out[name] = {"tokens": toks, "seconds": round(secs, 2), "tok_s": toks / secs,
                     "latency_p50_s": statistics.median(s for _, s in r)}
    per = [(a[0] / a[1]) / (b[0] / b[1]) for a, b in zip(rows["verified"], rows["vllm"], strict=True) if a[0] and b[0]]
    out["ratios"] = {"verified_over_vllm_tok_s": out["verified"]["tok_s"] / out["vllm"]["tok_s"],  # type: ignore[index]
                     "verified_over_vllm_median_of_prompts": statistics.median(per),
                     "fast_over_vllm_tok_s": out["fast"]["tok_s"] / out["vllm"]["tok_s"]}  # type: ignore[index]
    out["exactness"] = {"identical": sum(same), "prompts": len(same)}
    out["verified_windows"] = stats
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
