"""Guard overhead and handoff latency; same as `qladder bench guard`. Prints JSON."""

import json
import sys

from qladder.benchmarks.guard import run_guard_bench

if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    print(json.dumps(run_guard_bench(steps=steps), indent=2))
