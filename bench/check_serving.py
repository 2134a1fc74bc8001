"""Checks the JSON shape of `qladder bench serving` (read from a file or stdin) and its targets.

Usage: qladder bench serving > s.json && python bench/check_serving.py s.json
Exit 0 when the shape is right; the targets are printed as PASS/FAIL lines.
"""

import json
import sys

KEYS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "token_p50_ms", "token_p99_ms")

if __name__ == "__main__":
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as fh:
            data = json.load(fh)
    else:
        data = json.load(sys.stdin)
    for config in ("guarded", "bare", "raw", "guarded_faulted"):
        for c, row in data["results"][config].items():
            missing = [k for k in KEYS if k not in row]
            assert not missing, f"results[{config}][{c}] lacks {missing}"
    r = data["ratios"]
    for k in ("guarded_c8_over_c1", "guarded_over_raw_c8"):
        assert k in r, f"ratios lacks {k}"
    for key, target in (("guarded_c8_over_c1", 1.3), ("guarded_over_raw_c8", 0.95)):
        v = r[key]
        print(f"{key} = {v:.3f}  {'PASS' if v is not None and v >= target else 'FAIL'} (>= {target})")
    f = data["results"]["guarded_faulted"]
    for c, row in f.items():
        print(f"faulted c{c}: {row['faulted_clean_via_standby']}/{row['faulted']} faulted answered clean through"
              f" the standby; {row['clean_answers']}/{row['requests']} clean in all")
