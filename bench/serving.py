"""Many requests at once on the INT4 pool; same as `qladder bench serving`. Prints JSON.

Usage: python bench/serving.py [PROMPTS [MAX_TOKENS [CONCURRENCY]]]   e.g. 32 128 1,4,8,16
"""

import json
import sys

from qladder.benchmarks.serving import run_serving_bench

if __name__ == "__main__":
    a = sys.argv[1:]
    levels = tuple(int(c) for c in (a[2] if len(a) > 2 else "1,4,8,16").split(","))
    print(json.dumps(run_serving_bench(int(a[0]) if a else 32, int(a[1]) if len(a) > 1 else 128, levels), indent=2))
