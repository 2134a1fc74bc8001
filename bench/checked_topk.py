"""What a checked draft's drift measure costs INT4: `audit.top_k` (log-softmax and top 5 over the
vocabulary) on each drafted row, against the INT4 decode step that made the row.

One INT4 session (llama.cpp, the embedded Q4_1 GGUF) decodes greedily after a short chat prompt;
for each step the script times the decode (push + logits) and, on that step's row, `top_k`.
Rounds interleave the two (decode, then top_k on its row) so both see the same machine state;
the figures are medians over all steps after a warm-up. Prints JSON: per-step medians (ms), the
ratio, and the environment (versions, CPU, threads).

Usage: python bench/checked_topk.py [STEPS [THREADS]]   (256, 1)
"""

import dataclasses
import json
import platform
import statistics
import sys
import time

import torch

from qladder.audit import top_k
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.model import user_prompt_ids


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(threads)
    settings = dataclasses.replace(Settings.from_env(), n_threads=threads)
    int4 = load_engine("int4", settings=settings)
    warmup = 16
    decode_ms: list[float] = []
    topk_ms: list[float] = []
    try:
        ids = user_prompt_ids(int4.info.chat_template, "Write a long story about a lighthouse keeper.",
                              int4.tokenize)
        s = int4.open(ids)
        row = s.logits()
        for k in range(steps + warmup):
            t0 = time.perf_counter()
            top = top_k(row)
            t1 = time.perf_counter()
            s.push(int(row.argmax()))
            row = s.logits()
            t2 = time.perf_counter()
            if k >= warmup:
                topk_ms.append((t1 - t0) * 1e3)
                decode_ms.append((t2 - t1) * 1e3)
            assert len(top) == 5
            if len(ids) + k + 2 >= int4.n_ctx:
                break
        s.close()
    finally:
        int4.close()
    d, t = statistics.median(decode_ms), statistics.median(topk_ms)
    print(json.dumps({
        "steps": len(decode_ms), "warmup": warmup, "threads": threads,
        "decode_ms_median": round(d, 3), "top_k_ms_median": round(t, 4), "top_k_over_decode": round(t / d, 4),
        "top_k_ms_p90": round(sorted(topk_ms)[int(0.9 * (len(topk_ms) - 1))], 4),
        "vocab": int(row.numel()),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads()},
    }, indent=1))


if __name__ == "__main__":
    main()
