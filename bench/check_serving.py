"""Checks `qladder bench serving` against its targets (qladder.validate.recompute.SERVING_TARGETS).

Usage: qladder bench serving --out D && python bench/check_serving.py D      (recomputes from D/outcomes.jsonl)
       qladder bench serving > s.json && python bench/check_serving.py s.json
Prints PASS/FAIL per target; exits 1 if any fails.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import check

if __name__ == "__main__":
    sys.exit(check("bench-serving", Path(sys.argv[1] if len(sys.argv) > 1 else "-")))
