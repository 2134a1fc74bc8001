"""What the guard's top-k costs the server: llama-server's tok/s with `n_probs` = 4 (what a remote
INT4 rung asks for, engines/remote_llama.py) against 0 (what a client straight at the server
asks), the same greedy /completion requests, `clients` at once, interleaved rounds.

Usage: python bench/llama_server_nprobs.py [ROUNDS [WINDOW_S [CLIENTS]]]     prints JSON
"""

import asyncio
import json
import statistics
import sys
import time

import httpx

from qladder.engines.llamacpp import LlamaVocab
from qladder.environment import cpu, versions
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.validate.corpora import normal_prompts


async def window(url: str, prompts: list[list[int]], n_probs: int, clients: int, seconds: float) -> float:
    tokens, end = 0, time.perf_counter() + seconds
    t0 = time.perf_counter()

    async def client(k: int) -> None:
        nonlocal tokens
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as h:
            j = k
            while time.perf_counter() < end:
                body = {"prompt": prompts[j % len(prompts)], "n_predict": 64, "temperature": 0, "n_probs": n_probs,
                        "cache_prompt": True, "stream": False}
                r = (await h.post(f"{url}/completion", json=body)).json()
                tokens += int(r["tokens_predicted"])
                j += clients

    await asyncio.gather(*(client(k) for k in range(clients)))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    a = sys.argv[1:]
    rounds = int(a[0]) if a else 3
    seconds = float(a[1]) if len(a) > 1 else 20.0
    clients = int(a[2]) if len(a) > 2 else 8
    info = inspect_model()
    vocab = LlamaVocab(info)
    prompts = [user_prompt_ids(info.chat_template, str(p.prompt), vocab.tokenize)
               for p in normal_prompts(n_per_class=4) if isinstance(p.prompt, str)]
    vocab.close()
    server = LlamaServer(info.path, n_parallel=clients, threads=1, n_ctx_per_slot=2048).start()
    try:
        asyncio.run(window(server.base_url, prompts, 0, clients, 3.0))  # warm-up
        rates: dict[int, list[float]] = {0: [], 4: []}
        for r in range(rounds):
            for n in ((0, 4) if r % 2 == 0 else (4, 0)):
                rates[n].append(asyncio.run(window(server.base_url, prompts, n, clients, seconds)))
    finally:
        server.stop()
    ratios = [b / a for a, b in zip(rates[0], rates[4], strict=True)]
    print(json.dumps({"benchmark": "llama-server n_probs cost", "rounds": rounds, "window_s": seconds,
                      "clients": clients, "threads": 1, "max_tokens": 64, "greedy": True,
                      "tok_s": {"n_probs_0": rates[0], "n_probs_4": rates[4]},
                      "ratio_n_probs_4_over_0_median": statistics.median(ratios), "ratios": ratios,
                      "versions": {**versions(), "llama_server": server.version()}, "cpu": cpu()}, indent=2))


if __name__ == "__main__":
    main()
