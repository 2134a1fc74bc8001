"""Checks `qladder bench fleet` against its targets (qladder.validate.fleet_figures).

Usage: qladder bench fleet --out D && python bench/check_fleet.py D          (recomputes from D/outcomes.jsonl)
       qladder bench fleet --json > f.json && python bench/check_fleet.py f.json
Prints PASS/FAIL per target; exits 1 if any fails.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import check

if __name__ == "__main__":
    sys.exit(check("bench-fleet", Path(sys.argv[1] if len(sys.argv) > 1 else "-")))
