"""vLLM's CPU server on the fp32 folder, compiled (its default) and eager (`--enforce-eager`):
start-up time and greedy decode throughput at concurrency 1 and 8, each mode started in turn,
the load run twice per mode (medians). Prints JSON.

Usage: python bench/vllm_modes.py [N_TOKENS]     (64 by default)
"""

import asyncio
import json
import platform
import statistics
import sys
import time

import httpx

from qladder.config import Settings
from qladder.engines.llamacpp import LlamaVocab
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.vllm import VLLM_VERSION, VllmServer

PROMPTS = ["Name three colors.", "Write a haiku about rain.", "What is 17 times 3?", "Explain gravity briefly.",
           "List four fruits.", "Describe a cat.", "Why is the sky blue?", "Give me a short greeting."]


async def load(url: str, ids: list[list[int]], concurrency: int, n: int) -> float:
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(p: list[int]) -> int:
            r = await c.post(f"{url}/v1/completions", json={"model": "fp32", "prompt": p, "max_tokens": n,
                                                            "temperature": 0, "ignore_eos": True})
            return int(r.json()["usage"]["completion_tokens"])

        t = time.perf_counter()
        toks = await asyncio.gather(*(one(ids[k % len(ids)]) for k in range(concurrency)))
        return sum(toks) / (time.perf_counter() - t)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    info = inspect_model()
    folder = fp32_checkpoint(info, Settings.from_env().cache_dir)
    vocab = LlamaVocab(info)
    ids = [user_prompt_ids(info.chat_template, p, vocab.tokenize) for p in PROMPTS]
    out: dict[str, object] = {"vllm": VLLM_VERSION, "machine": platform.processor() or platform.machine(),
                              "n_tokens": n, "threads": 1, "max_num_seqs": 8, "kv_cache_gib": 1, "modes": {}}
    for mode, extra in (("compiled", ()), ("eager", ("--enforce-eager",))):
        t = time.perf_counter()
        with VllmServer(folder, extra=extra) as vs:
            startup = time.perf_counter() - t
            asyncio.run(load(vs.base_url, ids, 1, 8))  # warm-up
            runs = {c: [asyncio.run(load(vs.base_url, ids, c, n)) for _ in range(2)] for c in (1, 8)}
        out["modes"][mode] = {"startup_s": round(startup, 1),  # type: ignore[index]
                              **{f"tok_s_c{c}": round(statistics.median(v), 1) for c, v in runs.items()},
                              "runs": {f"c{c}": [round(x, 1) for x in v] for c, v in runs.items()}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
