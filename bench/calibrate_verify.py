"""Calibrate the standby's check of an answer's first tokens (`verify`): llama-server drafts the
first DRAFT tokens of each corpus answer, vLLM (the fp32 standby) scores them in one prefill
(`prompt_logprobs`), and per draft token we record the gap `lq - lp` (llama-server's own logprob
of the token minus the fp32 model's) and `lp`.

Populations, greedy (as the validation replays), on the train half of the corpora only (the
validation's held-out test faults run on the other half): the embedded GGUF on every normal and
abnormal train prompt; the corrupted-scale copy (x1000, finite garbage) and the
glitch-token copy on the prompts that meet them. Prompts are rendered as qladder serve renders
them (sanitized, the chat template). Prints JSON: per population the percentiles of each draft's
largest gap, and how many drafts each candidate bound would refuse.

"own_mean": the draft's mean logprob on llama-server itself; "suspect": how many drafts a bound
on it would send to the standby, and how many refusals it would miss. Prompts over
MAX_CONTEXT tokens are left out, as the guard leaves their drafts unchecked.

Usage: python bench/calibrate_verify.py [DRAFT [STRIDE]]   (8, 1)
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
from qladder.model import inspect_model
from qladder.peers.llama_server import LlamaServer
from qladder.peers.vllm import VllmServer
from qladder.percentiles import percentile
from qladder.validate.corpora import Prompt
from train_populations import populations, train_prompts

GAPS = (4.0, 5.0, 6.0, 8.0, 10.0, 12.0)
SUSPECT = (-0.5, -0.75, -1.0, -1.25, -1.5)  # candidate bounds on the draft's mean own logprob
GAP = 5.0  # the bound chosen (GuardConfig.draft.verify_gap)
MAX_CONTEXT = 512  # GuardConfig.draft.verify_max_context


def draft(url: str, ids: list[int], n: int) -> list[tuple[int, float]]:
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 1, "return_tokens": True}).json()
    probs = r.get("completion_probabilities") or []
    return [(int(p["id"]), float(p["logprob"])) for p in probs if p.get("logprob") is not None]


def score(url: str, model: str, ids: list[int], toks: list[int]) -> list[float]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json=score_body(model, ids, toks))
    r.raise_for_status()
    return [s.logprob for s in draft_scores(r.json(), len(ids), toks)]


def summary(drafts: list[list[tuple[float, float]]]) -> dict[str, object]:
    """drafts: per answer, per token (lq, lp)."""
    drafts = [d for d in drafts if d]
    gaps = [max(lq - lp for lq, lp in d) for d in drafts]
    lows = [min(lp for _, lp in d) for d in drafts]
    own = [sum(lq for lq, _ in d) / len(d) for d in drafts]
    return {"answers": len(gaps),
            "own_mean": {"p1": percentile(own, 1), "p10": percentile(own, 10), "p50": percentile(own, 50),
                         "p90": percentile(own, 90), "max": max(own, default=None)},
            # drafts a suspicion bound would send to the standby, and refusals (at GAP) it would miss
            "suspect": {str(b): {"checked": sum(o < b for o in own),
                                 "missed_refusals": sum(o >= b and g > GAP for o, g in zip(own, gaps, strict=True))}
                        for b in SUSPECT},
            "max_gap": {"p50": percentile(gaps, 50), "p90": percentile(gaps, 90), "p99": percentile(gaps, 99),
                        "max": max(gaps, default=None), "min": min(gaps, default=None)},
            "min_fp32_logprob": {"min": min(lows, default=None), "p1": percentile(lows, 1),
                                 "p50": percentile(lows, 50)},
            "refused_at_gap": {str(g): sum(x > g for x in gaps) for g in GAPS}}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    stride = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    normal, abnormal, ids = train_prompts(info, n)
    t0 = time.perf_counter()
    out: dict[str, object] = {"draft": n, "stride": stride, "max_context": MAX_CONTEXT,
                              "slots": 4, "llama_threads": 1, "vllm_threads": 1,
                              "vllm": "0.32.0 eager, fp32", "machine": platform.processor() or platform.machine()}
    with tempfile.TemporaryDirectory() as d, VllmServer(fp32_checkpoint(info, settings.cache_dir), threads=1,
                                                       extra=("--enforce-eager",)) as vllm:
        model = httpx.get(f"{vllm.base_url}/v1/models").json()["data"][0]["id"]
        runs = populations(info, Path(d), normal, abnormal, stride)
        for name, gguf, prompts in runs:
            todo = [p for p in prompts if ids[p.id] and len(ids[p.id]) <= MAX_CONTEXT]  # type: ignore[arg-type]
            with LlamaServer(gguf, n_parallel=4, threads=1, n_ctx_per_slot=2048) as ls, cf.ThreadPoolExecutor(4) as ex:
                def one(p: Prompt, u: str = ls.base_url) -> list[tuple[float, float]]:
                    dr = draft(u, ids[p.id], n)  # type: ignore[arg-type]
                    lps = score(vllm.base_url, model, ids[p.id], [tok for tok, _ in dr])  # type: ignore[arg-type]
                    return [(lq, lp) for (_, lq), lp in zip(dr, lps, strict=True)]
                drafts = list(ex.map(one, todo))
            out[name] = summary(drafts)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
