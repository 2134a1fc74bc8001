"""Calibrate the remote guard's `diffuse` check: llama-server's own top-1 log-probability, averaged
over a window of streamed tokens, on clean traffic (the embedded GGUF: the train half of the normal
and abnormal corpora; `qladder validate` scores the other half) and on the corrupted-scale copy
(one Q4_1 block scale x1000, finite garbage the stream's logprobs are otherwise silent on).
Greedy, 32 tokens. Prints JSON: per population the lowest window mean of each answer (its
percentiles), and how many answers a bound would flag.

"first_tokens": the same over the answer's first 2..WINDOW-1 tokens (the prefix mean), the
windows a check can judge before the first full one.

Usage: python bench/calibrate_diffuse.py [WINDOW [STRIDE]]   (8, 1: every prompt; 4: every 4th)
"""

import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from qladder.engines.llamacpp import LlamaVocab
from qladder.model import inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.percentiles import percentile
from qladder.testing.gguf_patch import corrupt_gguf_scale
from qladder.validate.corpora import Prompt, load_corpora, train
from qladder.validate.replay import as_sent

BOUNDS = (-1.8, -2.0, -2.2, -2.5)


def lowest_window(url: str, ids: list[int], window: int) -> tuple[float | None, float | None]:
    """(the lowest mean over full windows, the lowest mean over the answer's first 2..window-1 tokens)."""
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": 32, "temperature": 0, "n_probs": 1, "return_tokens": True}).json()
    top1 = [p["top_logprobs"][0]["logprob"] for p in r.get("completion_probabilities") or [] if p.get("top_logprobs")]
    prefix = min((statistics.mean(top1[:k]) for k in range(2, min(window, len(top1) + 1))), default=None)
    if len(top1) < window:
        return None, prefix
    return min(statistics.mean(top1[i:i + window]) for i in range(len(top1) - window + 1)), prefix


def summary(lows: list[float]) -> dict[str, object]:
    return {"answers": len(lows), "p0": min(lows, default=None), "p1": percentile(lows, 1),
            "p50": percentile(lows, 50), "p99": percentile(lows, 99), "max": max(lows, default=None),
            "flagged": {str(b): sum(x < b for x in lows) for b in BOUNDS}}


def main() -> None:
    window = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    stride = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    info = inspect_model()
    vocab = LlamaVocab(info)
    normal, abnormal = (train(ps) for ps in load_corpora())  # the train half only: validation scores the test half
    def text(p: Prompt) -> str:  # as a client would send it
        return as_sent(p.prompt)

    enc = {p.id: user_prompt_ids(info.chat_template, text(p), vocab.tokenize)[:1900] for p in normal + abnormal}
    out: dict[str, object] = {"window": window, "stride": stride, "n_predict": 32, "slots": 4, "threads": 1}
    with tempfile.TemporaryDirectory() as d:
        bad = Path(d) / "corrupted.gguf"
        corrupt_gguf_scale(info.path, bad, x=1000.0)
        for name, gguf, prompts in (("clean_normal", info.path, normal[::stride]),
                                    ("clean_abnormal", info.path, abnormal[::stride]),
                                    ("corrupted_abnormal", bad, abnormal[::3 * stride]),
                                    ("corrupted_normal", bad, normal[::6 * stride])):
            with LlamaServer(gguf, n_parallel=4, threads=1, n_ctx_per_slot=2048) as ls, cf.ThreadPoolExecutor(4) as ex:
                pairs = list(ex.map(lambda p, u=ls.base_url: lowest_window(u, enc[p.id], window), prompts))
            out[name] = {"window": summary([w for w, _ in pairs if w is not None]),
                         "first_tokens": summary([f for _, f in pairs if f is not None])}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
