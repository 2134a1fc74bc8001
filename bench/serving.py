"""Many requests at once on the INT4 pool; same as `qladder bench serving`. Prints JSON.

Usage: python bench/serving.py [OUT [PROMPTS [MAX_TOKENS [CONCURRENCY]]]]   e.g. out/serving 32 128 1,4,8,16
Then:  python bench/check_serving.py OUT                                    (recomputes, the targets, exit 1 on a miss)
"""

import json
import sys
from pathlib import Path

from qladder.benchmarks.serving import run_serving_bench

if __name__ == "__main__":
    a = sys.argv[1:]
    levels = tuple(int(c) for c in (a[3] if len(a) > 3 else "1,4,8,16").split(","))
    out = run_serving_bench(int(a[1]) if len(a) > 1 else 32, int(a[2]) if len(a) > 2 else 128, levels,
                            out_dir=Path(a[0]) if a else None)
    print(json.dumps(out, indent=2, default=str))
