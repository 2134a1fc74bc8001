"""Re-judge committed runs with today's judge and verdicts, from their raw outcomes.

    python -m qladder.validate.rejudge DIR [DIR ...]

For each run folder (outcomes.jsonl + results.json): recompute every figure and verdict from the raw
outcomes (recompute.figures: the calibrated judge, stopped answers, intervals), replace results.json's
"figures" with them, and say so in results.json's "rejudged" (the commit, the verdict before and
after, what the old outcomes lack). A validation folder's report.md / report.html are drawn again
from the new figures (validate --remote's, and validate's with its boundaries.json). outcomes.jsonl
is never touched: its stored verdict fields are the old judge's, for reading, and no figure reads
them. Afterwards `python -m qladder.validate.recompute DIR` reproduces results.json exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qladder.validate.outcome import read_jsonl
from qladder.validate.recompute import figures, normalized


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def lacks(outcomes: Sequence[Any]) -> list[str]:
    """What these outcomes cannot give the figures that a run written today does."""
    out = []
    if any(o.fp32_identical is not None and o.fp32_reference_ids is None for o in outcomes):
        out.append("fp32 reference ids (identity is the stored flag, a guard-ended answer never counted identical)")
    if any(o.finish_reason in ("repetition", "degraded") and o.fp32_reference_ids is None for o in outcomes):
        out.append("a reference length for guard-ended answers (each counts as stopped)")
    return out


def rejudge(folder: Path) -> dict[str, Any]:
    path = folder / "results.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    before = results.get("figures") or {}
    outcomes = read_jsonl(folder / "outcomes.jsonl")
    after = normalized(figures(outcomes, before["mode"], results.get("observations")))
    results["figures"] = after
    note: dict[str, Any] = {"commit": _commit(), "verdict_before": before.get("verdict"),
                           "verdict_after": after["verdict"], "lacks": lacks(outcomes),
                           "note": "figures recomputed from outcomes.jsonl by qladder.validate.rejudge; the "
                                   "outcomes' stored verdict fields are the old judge's, read by no figure"}
    results["rejudged"] = note
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
    if before["mode"] == "remote":
        from qladder.validate.report import write_remote_report

        write_remote_report(results, folder)
    elif before["mode"] == "in-process" and (folder / "boundaries.json").is_file():
        from qladder.validate.report import write_report

        write_report(results, json.loads((folder / "boundaries.json").read_text(encoding="utf-8")), folder)
    return note


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(__doc__)
        return 2
    for d in args:
        r = rejudge(Path(d))
        print(f"{d}: {r['verdict_before']} -> {r['verdict_after']}" + (f" (lacks: {'; '.join(r['lacks'])})"
                                                                       if r["lacks"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
