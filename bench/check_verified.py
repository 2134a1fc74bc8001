"""Checks `qladder bench verified` against its targets (qladder.validate.verified_figures.TARGETS).

Usage: qladder bench verified --out D && python bench/check_verified.py D     (recomputes from D/outcomes.jsonl)
       qladder bench verified > v.json && python bench/check_verified.py v.json
Prints PASS/FAIL per target; exits 1 if any fails.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import check

if __name__ == "__main__":
    sys.exit(check("bench-verified", Path(sys.argv[1] if len(sys.argv) > 1 else "-")))
