"""Checks `qladder bench verified` against its targets (qladder.validate.verified_figures.TARGETS).

Usage: qladder bench verified --out D && python bench/check_verified.py D     (recomputes from D/outcomes.jsonl)
Every verdict recomputed from the raw outcomes (bench/check.py); exit 0 pass, 1 fail or a stored figure
that differs, 3 inconclusive.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import check

if __name__ == "__main__":
    sys.exit(check("bench-verified", Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
