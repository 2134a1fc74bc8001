"""Load test of `qladder serve` against llama.cpp's llama-server; same as `qladder bench serve`.

Usage: python bench/serve.py [OUT [DURATION_S [WINDOW_S [ROUNDS]]]]   e.g. out/serve 120 60 5   (prints JSON)
Then:  python bench/check_serve.py OUT                                (recomputes, the targets, exit 1 on a miss)
"""

import json
import sys
from pathlib import Path

from qladder.benchmarks.serve_load import run_serve_bench

if __name__ == "__main__":
    a = sys.argv[1:]
    out = run_serve_bench(duration_s=float(a[1]) if len(a) > 1 else 120.0, window_s=float(a[2]) if len(a) > 2 else 60.0,
                          rounds=int(a[3]) if len(a) > 3 else 5, log=lambda m: print(m, file=sys.stderr),
                          out_dir=Path(a[0]) if a else None)
    print(json.dumps(out, indent=2, default=str))
