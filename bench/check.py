"""The one checker behind bench/check_serving.py, check_serve.py, check_verified.py and check_fleet.py.

Usage: python bench/check.py KIND DIR     KIND: bench-serving | bench-serve | bench-verified | bench-fleet

DIR is a run's folder (`qladder bench ... --out DIR`: outcomes.jsonl, results.json). Every figure and
verdict is recomputed from the raw outcomes (and the run's raw observations) by
qladder.validate.recompute; no verdict stored in results.json is read, and a stored figure that
differs from the recomputed one is a failure (a forged or stale file). A results JSON alone cannot
be checked (it holds no raw outcomes): it is refused. Exit status: 0 every verdict passes; 1 a
verdict fails, a figure differs, or DIR is not a run of KIND; 3 nothing failed but a verdict is
inconclusive (an interval that straddles its target, too few windows); 2 a usage error.
"""

import json
import sys
from pathlib import Path

from qladder.validate import recompute


def check(kind: str, path: Path) -> int:
    if not path.is_dir() or not (path / "outcomes.jsonl").is_file():
        print(f"FAIL  {path}: not a run's folder with outcomes.jsonl (a checker recomputes from raw outcomes; "
              "write the run with --out DIR)")
        return 1
    stored = json.loads((path / "results.json").read_text(encoding="utf-8")).get("figures") or {}
    if stored.get("mode") != kind:
        print(f"FAIL  not a {kind} run (mode {stored.get('mode')!r})")
        return 1
    code = recompute.main([str(path)])
    print({0: "PASS", 1: "FAIL", recompute.EXIT_INCONCLUSIVE: "INCONCLUSIVE"}.get(code, "FAIL"))
    return code


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[1], Path(sys.argv[2])))
