"""Checks `qladder bench serve --json` output (a file or stdin) against the issue's targets.

Usage: qladder bench serve --json > s.json && python bench/check_serve.py s.json
Prints PASS/FAIL per target; exits 1 if any fails.
"""

import json
import sys

if __name__ == "__main__":
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as fh:
            data = json.load(fh)
    else:
        data = json.load(sys.stdin)
    f, b, r = data["faulted"], data["burst"], data["ratios"]
    checks = [
        ("faulted: no 5xx", f["five_xx"] == 0, f["five_xx"]),
        ("faulted: every request answered or 429", f["answered_or_429"], f["statuses"]),
        ("faulted: incident rows == hazards in /metrics", f["incident_rows_equal_hazards"],
         (f["incident_rows"], f["hazards_metrics_total"])),
        ("faulted: every faulted request answered clean", f["faulted_answered_clean"] == f["faulted_requests"],
         (f["faulted_answered_clean"], f["faulted_requests"])),
        ("burst: the INT4 breaker opened", b["opened"], b["timeline"]),
        ("burst: ... and closed after recovery", b["closed_after"], b["transitions"]),
        ("guarded tok/s >= 0.9x llama-server", r["guarded_over_llama_server_tok_s"] >= 0.9,
         round(r["guarded_over_llama_server_tok_s"], 3)),
        ("guarded P99 e2e <= 1.1x llama-server", r["guarded_over_llama_server_p99"] <= 1.1,
         round(r["guarded_over_llama_server_p99"], 3)),
    ]
    for name, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    sys.exit(0 if all(ok for _, ok, _ in checks) else 1)
