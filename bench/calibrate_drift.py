"""Calibrate the drift window (GuardConfig.draft.drift_*): how often INT4's greedy tokens are the
fp32 model's own argmax, window by window, on clean answers and on the train faults' answers.

llama-server (the embedded Q4_1 GGUF, or a train fault's patched copy) answers each prompt greedily
(ANSWER tokens); vLLM (the fp32 standby) scores the whole answer in one prefill
(`prompt_logprobs`: each token's logprob and its rank under fp32, rank 1 = fp32's argmax on the
answer's own context, teacher-forced). Per answer and per window of W tokens (the first window is
the held draft, `verify_tokens` long; then windows of W), the window's agreement is the share of
its tokens of rank 1.

Populations, greedy, on the train half of the corpora only (the validation's held-out test faults
run on the other half): the embedded GGUF on every normal and abnormal train prompt (the bound's
false refusals); the corrupted-scale copy (x1000: finite garbage) and the glitch-token copy (the
train faults: the refusals it must make). Prints JSON: per population and window size, the
percentiles of each answer's lowest window agreement, and per candidate bound how many answers
it refuses (a clean answer refused is a false handoff; a corrupted one not refused is a miss).

Usage: python bench/calibrate_drift.py [ANSWER [STRIDE]]   (32, 1)
"""

import concurrent.futures as cf
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

from qladder.config import Settings
from qladder.engines.remote_vllm import draft_scores, score_body
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.health.drift import window_agreements
from qladder.model import inspect_model
from qladder.peers.llama_server import LlamaServer
from qladder.peers.vllm import VllmServer
from qladder.percentiles import percentile
from qladder.validate.corpora import Prompt
from train_populations import populations, train_prompts

FIRST = 8  # GuardConfig.draft.verify_tokens: the held draft
WINDOWS = (8, 16, 32)
BOUNDS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
MAX_CONTEXT = 512


def answer(url: str, ids: list[int], n: int) -> list[int]:
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 1, "return_tokens": True}).json()
    return [int(p["id"]) for p in r.get("completion_probabilities") or []]


def ranks(url: str, model: str, ids: list[int], toks: list[int]) -> list[int]:
    if not toks:
        return []
    r = httpx.post(f"{url}/v1/completions", timeout=300, json=score_body(model, ids, toks))
    r.raise_for_status()
    return [s.rank for s in draft_scores(r.json(), len(ids), toks)]


def summary(answers: list[list[int]]) -> dict[str, object]:
    """answers: per answer, the fp32 rank of each of its tokens."""
    answers = [a for a in answers if a]
    shares = [sum(r == 1 for r in a) / len(a) for a in answers]
    out: dict[str, object] = {"answers": len(answers), "agreement_mean": sum(shares) / max(1, len(shares))}
    for w in WINDOWS:
        lows = [min(window_agreements([r == 1 for r in a], FIRST, w)) for a in answers]
        out[f"window_{w}"] = {
            "lowest_window": {"min": min(lows, default=None), "p1": percentile(lows, 1), "p5": percentile(lows, 5),
                              "p10": percentile(lows, 10), "p50": percentile(lows, 50)},
            "refused_below": {str(b): sum(x < b for x in lows) for b in BOUNDS}}
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    stride = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    normal, abnormal, ids = train_prompts(info, n)
    t0 = time.perf_counter()
    out: dict[str, object] = {"answer_tokens": n, "first_window": FIRST, "stride": stride, "max_context": MAX_CONTEXT,
                              "slots": 4, "llama_threads": 1, "vllm_threads": 1,
                              "vllm": "0.32.0 eager, fp32", "machine": platform.processor() or platform.machine()}
    with tempfile.TemporaryDirectory() as d, VllmServer(fp32_checkpoint(info, settings.cache_dir), threads=1,
                                                       extra=("--enforce-eager",)) as vllm:
        model = httpx.get(f"{vllm.base_url}/v1/models").json()["data"][0]["id"]
        runs = populations(info, Path(d), normal, abnormal, stride)
        for name, gguf, prompts in runs:
            todo = [p for p in prompts if ids[p.id] and len(ids[p.id]) <= MAX_CONTEXT]  # type: ignore[arg-type]
            with LlamaServer(gguf, n_parallel=4, threads=1, n_ctx_per_slot=2048) as ls, cf.ThreadPoolExecutor(4) as ex:
                def one(p: Prompt, u: str = ls.base_url) -> list[int]:
                    a = answer(u, ids[p.id], n)  # type: ignore[arg-type]
                    return ranks(vllm.base_url, model, ids[p.id], a)  # type: ignore[arg-type]
                out[name] = summary(list(ex.map(one, todo)))
            print(name, json.dumps(out[name]), file=sys.stderr, flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
