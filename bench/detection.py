"""How soon the audit's test takes a broken in-process INT4 pool out, and that it leaves a clean one in.

For each weight corruption made with the validation's own patches (qladder.validate.fault_models:
the held-out test kinds, which nothing was tuned on, and the train kinds), a copy of the embedded
GGUF is patched and served by a ServingEngine with the committed detector thresholds and the
real fp32 standby; the test half's prompts (normal ones; a glitch kind's own abnormal classes)
are asked one after another, cycling, until the pool is ejected or MAX answers. Then the clean
GGUF answers CLEAN prompts the same way: its alarms are false alarms. Two audit settings:
    quiet   audit_rate 0.05, audit_spare_rate 0.5 (qladder serve's defaults, a pool with spare slots)
    busy    audit_rate 0.05 alone (the floor a saturated pool keeps to)

Each answer is one line of DIR/outcomes.jsonl (setting, kind, its index, rungs, hazards, whether
it was audited and its excess, whether the pool was out when it was asked); DIR/results.json holds
the figures, computed from those lines by `figures` (`--recompute DIR` does it again and exits 1
if they differ or the verdict fails). The figure per kind: the answers INT4 served up to the
ejection (all of them if it never came; every one possibly broken: an upper bound on the broken
answers clients got; a kind the step guard hands off whole serves none) and the audited ones
among them. Verdicts, fixed before the run: over the held-out kinds, the median of INT4 answers
served up to the ejection <= 8 in the quiet setting (the busy one's is reported); 0 alarms on the
clean pool in every setting. Usage:
    python bench/detection.py --out DIR [--clean 200] [--max 120] [--settings quiet,busy]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qladder.benchmarks.common import AuditLog, recompute_figures
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.environment import snapshot
from qladder.health.detector import committed
from qladder.model import inspect_model, user_prompt_ids
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.testing.gguf_patch import GGUF_PATCHES
from qladder.validate.corpora import load_corpora, split_of
from qladder.validate.fault_models import FAULT_MODELS, TEST_FAULT_MODELS
from qladder.validate.replay import as_sent

SETTINGS = {"quiet": (0.05, 0.5), "busy": (0.05, 0.0)}
TARGET_MEDIAN = 8


def serve(se: ServingEngine, prompts: list[Any], limit: int, until_alarm: bool, setting: str, kind: str,
          split: str) -> list[dict[str, Any]]:
    audits = AuditLog(se)
    alarms: list[Any] = []
    se.alarm_observers.append(alarms.append)
    rows: list[dict[str, Any]] = []
    for n in range(limit):
        if until_alarm and alarms:
            break
        p = prompts[n % len(prompts)]
        text = as_sent(p.prompt)  # what a client's JSON can carry
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        out = bool(alarms)
        req = se.request(ids, SamplingParams(max_tokens=32), prompt_text=text, prompt_class=p.cls)
        r = se.generate_sync(req)
        audits.drain(120)
        a = audits.get(req.request_id)
        rows.append({"setting": setting, "kind": kind, "split": split, "n": n, "prompt_id": p.id,
                     "rungs": sorted(set(r.token_rungs)), "tokens": len(r.token_ids),
                     "hazards": [h.check for h in r.hazards], "audited": a is not None,
                     "excess": a.excess if a else None, "ejected_before": out, "alarm_after": bool(alarms)})
    return rows


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure and verdict from the outcome lines alone."""
    out: dict[str, Any] = {"kinds": {}, "clean": {}}
    for (setting, kind) in sorted({(r["setting"], r["kind"]) for r in rows}):
        mine = sorted((r for r in rows if r["setting"] == setting and r["kind"] == kind), key=lambda r: r["n"])
        alarm = next((r["n"] for r in mine if r["alarm_after"]), None)
        served = [r for r in mine if alarm is None or r["n"] <= alarm]  # up to the answer whose audit alarmed
        fig = {"split": mine[0]["split"], "answers": len(mine), "alarm_at_answer": alarm,
               "int4_served_before_ejection": sum(r["rungs"] == ["int4"] for r in served),
               "audited_before_ejection": sum(r["audited"] for r in served),
               "handed_off": sum(r["rungs"] != ["int4"] for r in mine), "alarms": int(alarm is not None)}
        (out["clean"] if kind == "clean" else out["kinds"]).setdefault(setting, {})[kind] = fig
    verdicts = {}
    for setting, figs in out["kinds"].items():
        held = [f["int4_served_before_ejection"] for f in figs.values() if f["split"] == "test"]
        if held and setting == "quiet":
            median = statistics.median(held)
            verdicts["held_out_median_int4_answers_before_ejection_quiet"] = {
                "value": median, "target": f"<= {TARGET_MEDIAN}", "kinds": len(held),
                "verdict": "PASS" if median <= TARGET_MEDIAN else "FAIL"}
        elif held:  # the busy setting: reported, no target (the floor rate sets it: about 1 / 0.05)
            verdicts[f"held_out_median_int4_answers_before_ejection_{setting}"] = {
                "value": statistics.median(held), "kinds": len(held), "verdict": "REPORTED"}
    for setting, figs in out["clean"].items():
        c = figs["clean"]
        audited = sum(r["audited"] for r in rows if r["kind"] == "clean" and r["setting"] == setting)
        verdicts[f"clean_false_alarms_{setting}"] = {"value": c["alarms"], "answers": c["answers"],
                                                     "audited": audited, "target": "0",
                                                     "verdict": "PASS" if c["alarms"] == 0 else "FAIL"}
    out["verdicts"] = verdicts
    out["verdict"] = "FAIL" if any(v["verdict"] == "FAIL" for v in verdicts.values()) else "PASS"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--clean", type=int, default=200)
    ap.add_argument("--max", type=int, default=120, help="answers per broken kind at most")
    ap.add_argument("--settings", default="quiet,busy")
    ap.add_argument("--recompute", type=Path, help="recompute DIR's figures from its outcomes; exit 1 on a change")
    a = ap.parse_args()
    if a.recompute:
        return recompute_figures(a.recompute, figures)
    assert a.out is not None, "--out DIR"
    a.out.mkdir(parents=True, exist_ok=True)
    s = Settings.from_env()
    info = inspect_model(None, s.cache_dir)
    normal, abnormal = load_corpora()
    test_normal = [p for p in normal if split_of(p.id) == "test"]
    fp32 = load_engine("fp32", info, s)
    t0 = time.perf_counter()
    kinds = [(m, "test") for m in TEST_FAULT_MODELS if m.gguf_patch] + \
        [(m, "train") for m in FAULT_MODELS if m.gguf_patch]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for setting in a.settings.split(","):
            rate, spare = SETTINGS[setting]
            jobs: list[tuple[str, str, Path, list[Any], int, bool]] = []
            for m, split in kinds:
                gguf = Path(d) / f"{m.name}.gguf"
                if not gguf.exists():
                    GGUF_PATCHES[m.patch](info.path, gguf, **dict(m.gguf_patch or ()))
                prompts = [p for p in abnormal if split_of(p.id) == "test" and p.cls in m.classes] \
                    if m.classes else test_normal
                jobs.append((m.name, split, gguf, prompts or test_normal, a.max, True))
            jobs.append(("clean", "test", info.path, test_normal, a.clean, False))
            for kind, split, gguf, prompts, limit, until in jobs:
                cfg = ServingConfig(slots=4, audit_rate=rate, audit_spare_rate=spare, detector=committed(),
                                    probe_every_s=1e9, int4_threads=s.n_threads, standby_threads=s.n_threads)
                se = ServingEngine(cfg, dataclasses.replace(info, path=Path(gguf).resolve()), s, standby_engines=[fp32])
                try:
                    rows += serve(se, prompts, limit, until, setting, kind, split)
                finally:
                    se.close()
                print(f"{setting} {kind}: {sum(r['kind'] == kind and r['setting'] == setting for r in rows)} answers, "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    fp32.close()
    (a.out / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"benchmark": "detection", "command": " ".join(["python bench/detection.py", *sys.argv[1:]]),
              "thresholds": committed().to_dict(), "settings": {k: SETTINGS[k] for k in a.settings.split(",")},
              "environment": snapshot(s.n_threads, 2048), "wall_s": round(time.perf_counter() - t0, 1),
              "figures": figures(rows)}
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"], indent=1))
    return 0 if result["figures"]["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
