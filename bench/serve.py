"""Load test of `qladder serve` against llama.cpp's llama-server; same as `qladder bench serve`.

Usage: python bench/serve.py [DURATION_S [WINDOW_S [ROUNDS]]]   e.g. 120 60 2    (prints JSON)
Then:  python bench/check_serve.py result.json                  (the targets, PASS/FAIL)
"""

import json
import sys

from qladder.benchmarks.serve_load import run_serve_bench

if __name__ == "__main__":
    a = sys.argv[1:]
    out = run_serve_bench(duration_s=float(a[0]) if a else 120.0, window_s=float(a[1]) if len(a) > 1 else 60.0,
                          rounds=int(a[2]) if len(a) > 2 else 2, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(out, indent=2))
