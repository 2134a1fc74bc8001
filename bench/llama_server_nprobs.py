"""What the guard's top-k costs the server: llama-server's tok/s for the same greedy /completion
requests, `clients` at once, interleaved rounds, sent three ways:

  client       what a client straight at the server asks: no `n_probs`, the server's samplers
  rung         what a remote INT4 rung sends (engines/remote_llama.LlamaServerRung.body):
               `n_probs` 4, top_k 1 for a greedy answer
  rung_top_k0  the same with top_k 0 (the rung's body before 2026-12-05: the server's sampler
               chain ran over the whole vocabulary for every token)

Usage: python bench/llama_server_nprobs.py [ROUNDS [WINDOW_S [CLIENTS]]]     prints JSON
"""

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from qladder.engines.llamacpp import LlamaVocab
from qladder.engines.remote_llama import LlamaServerRung
from qladder.environment import cpu, versions
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.sampling import SamplingParams
from qladder.validate.corpora import normal_prompts


async def window(url: str, prompts: list[list[int]], body: Callable[[list[int]], dict[str, Any]], clients: int,
                 seconds: float) -> float:
    tokens, end = 0, time.perf_counter() + seconds
    t0 = time.perf_counter()

    async def client(k: int) -> None:
        nonlocal tokens
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as h:
            j = k
            while time.perf_counter() < end:
                r = (await h.post(f"{url}/completion", json=body(prompts[j % len(prompts)]))).json()
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
    rung: LlamaServerRung | None = None
    try:
        rung = live = LlamaServerRung(info, server.base_url)
        greedy = SamplingParams(max_tokens=64)
        bodies: dict[str, Callable[[list[int]], dict[str, Any]]] = {
            "client": lambda ids: {"prompt": ids, "n_predict": 64, "temperature": 0, "cache_prompt": True},
            "rung": lambda ids: {**live.body(ids, greedy, 64), "stream": False},
            "rung_top_k0": lambda ids: {**live.body(ids, greedy, 64), "stream": False, "top_k": 0},
        }
        names = list(bodies)
        asyncio.run(window(server.base_url, prompts, bodies["client"], clients, 3.0))  # warm-up
        rates: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                rates[n].append(asyncio.run(window(server.base_url, prompts, bodies[n], clients, seconds)))
    finally:
        if rung is not None:
            rung.close()
        server.stop()

    def ratios(a: str, b: str) -> list[float]:
        return [y / x for x, y in zip(rates[a], rates[b], strict=True)]

    print(json.dumps({"benchmark": "llama-server: the rung's request against a client's", "rounds": rounds,
                      "window_s": seconds, "clients": clients, "threads": 1, "max_tokens": 64, "greedy": True,
                      "warm_up_s": 3.0, "order": "interleaved, reversed every other round",
                      "bodies": {n: {k: v for k, v in bodies[n](prompts[0]).items() if k != "prompt"} for n in names},
                      "tok_s": rates,
                      "median_ratios": {"rung_over_client": statistics.median(ratios("client", "rung")),
                                        "rung_top_k0_over_client": statistics.median(ratios("client", "rung_top_k0")),
                                        "rung_over_rung_top_k0": statistics.median(ratios("rung_top_k0", "rung"))},
                      "versions": {**versions(), "llama_server": server.version()}, "cpu": cpu()}, indent=2))


if __name__ == "__main__":
    main()
