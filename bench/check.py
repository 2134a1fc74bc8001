"""The one checker behind bench/check_serving.py and bench/check_serve.py (and any run's folder).

Usage: python bench/check.py KIND PATH     KIND: bench-serving | bench-serve | bench-verified | bench-fleet
PATH is a run's folder (outcomes.jsonl + results.json: every figure is recomputed from the outcomes
first, and a difference is a failure) or a results JSON (`qladder bench ... --json` output). Prints
each target's verdict; exits 1 when a figure differs, the JSON is not of that benchmark, or any
target is not a pass (a missing figure is not a pass either).
"""

import json
import sys
from pathlib import Path

from qladder.validate import recompute


def check(kind: str, path: Path) -> int:
    if path.is_dir():
        results = json.loads((path / "results.json").read_text(encoding="utf-8"))
        if recompute.main([str(path)]) != 0:
            return 1
    else:
        results = json.loads(path.read_text(encoding="utf-8") if str(path) != "-" else sys.stdin.read())
    f = results.get("figures") or {}
    if f.get("mode") != kind:
        print(f"FAIL  not a {kind} result (mode {f.get('mode')!r})")
        return 1
    verdicts = f.get("verdicts") or []
    if not path.is_dir():  # (a folder's were printed by recompute, from the outcomes)
        for v in verdicts:
            print(f"{v['status'].upper():>12}  {v['name']}: {v['value']} (limit {v['limit']}) {v.get('note', '')}")
    ok = bool(verdicts) and all(v["status"] == "pass" for v in verdicts) and f.get("verdict") == "pass"
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[1], Path(sys.argv[2])))
