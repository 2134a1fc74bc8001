"""Per-rung decode/prefill speed and bandwidth bound; same as `qladder bench engines`. Prints JSON."""

import json
import sys

from qladder.benchmarks.engines import run_engine_bench

if __name__ == "__main__":
    rungs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["int4", "w4a16", "fp32"]
    print(json.dumps(run_engine_bench(rungs), indent=2))
