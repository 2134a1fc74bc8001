"""How many broken answers a corrupted INT4 endpoint forwards before the audit's test takes it out,
at eight clients: a pool of two real llama-server replicas of which one is corrupted, and the
in-process INT4 pool, each behind a ServingEngine with qladder serve's audit defaults.

For each weight corruption with a GGUF patch (qladder.validate.fault_models: the held-out test
kinds, which nothing was tuned on, and the train kinds) a patched copy of the embedded GGUF is
made, and:
    replicas    two llama-servers (-np 4, -t 1 each): replica A on the patched GGUF, B on the
                clean one (2048 context a slot, as in-process), one pool (remote_url = (A, B)); the
                in-process fp32 standby audits
    in-process  the batched llama.cpp pool (8 slots) on the patched GGUF; the fp32 standby audits
Both: audit_rate 0.05 and audit_spare_rate 0.5 (the defaults), the committed detector
thresholds, probes every 5 s; 8 clients in a closed loop over N test-half prompts (normal ones;
a glitch kind's own abnormal classes), 32-token greedy answers, each read whole (not streamed, as
the openai client asks by default: an answer in flight when its endpoint is ejected is withdrawn
and starts again at full precision, none of its INT4 tokens kept). Then the clean GGUF (both
replicas clean) answers CLEAN prompts the same way: its alarms are false alarms.

Every answer is one line of DIR/outcomes.jsonl: topology, kind, the endpoints that wrote it, its
rungs, hazards, when it was submitted and ended (s from the kind's start), whether it was audited
and its score (and excess) and when its record came, whether it was withdrawn, the alarm time,
an error (a refusal: a row, never dropped; no answer forwarded), and the calibrated judge's
verdict (validate.garbage.judge with fp32's NLL of the answer, scored after the kind's run).
DIR/results.json holds the figures, computed from those lines by `figures` (`--recompute DIR`
does it again; exit 1 if they differ or a verdict fails).

The figure per kind: the broken answers forwarded from the corrupted endpoint (INT4-written,
judged garbage) of requests submitted before its ejection, and of those submitted after; the
upper bound beside it (every INT4 answer of that endpoint before the ejection). Verdicts, fixed
before the run (the issue's targets), per topology over the held-out kinds: the median of broken
answers forwarded before the ejection <= 8 and none over 16; 0 broken answers forwarded after it
in every kind; 0 alarms on the clean pool. Usage:
    python bench/detection_c8.py --out DIR [--n 64] [--clean 200] [--topologies replicas,in-process]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from qladder.benchmarks.common import AuditLog, closed_loop, recompute_figures
from qladder.config import Settings
from qladder.engines import load_engine
from qladder.environment import snapshot
from qladder.errors import QladderError
from qladder.health.detector import committed
from qladder.model import ModelInfo, inspect_model, user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.testing.gguf_patch import GGUF_PATCHES
from qladder.validate.calibration import committed as judge_calibration
from qladder.validate.corpora import load_corpora, split_of
from qladder.validate.fault_models import FAULT_MODELS, TEST_FAULT_MODELS
from qladder.validate.garbage import judge, mean_nll
from qladder.validate.replay import as_sent

CLIENTS = 8
TARGET_MEDIAN, TARGET_MAX = 8, 16
AUDIT_RATE, AUDIT_SPARE = 0.05, 0.5



def serve(se: ServingEngine, prompts: list[Any], n: int, topology: str, kind: str, split: str,
          bad: str | None) -> list[dict[str, Any]]:
    """`n` answers at CLIENTS clients (closed loop); `bad`: the corrupted endpoint's name."""
    audits = AuditLog(se)
    alarms: list[tuple[float, Any]] = []
    t0 = time.monotonic()
    se.alarm_observers.append(lambda a: alarms.append((time.monotonic() - t0, a)))
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run(k: int) -> None:
        p = prompts[k % len(prompts)]
        text = as_sent(p.prompt)
        ids = user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)
        req = se.request(ids, SamplingParams(max_tokens=32), prompt_text=text, prompt_class=p.cls, streamed=False)
        sent = time.monotonic() - t0
        try:
            r = se.generate_sync(req)
        except QladderError as exc:  # a well-formed refusal (a prompt past the context): a row, never dropped
            with lock:
                rows.append({"topology": topology, "kind": kind, "split": split, "n": k, "prompt_id": p.id,
                             "request_id": req.request_id, "bad_endpoint": bad, "error": f"{type(exc).__name__}: {exc}",
                             "endpoints": [], "rungs": [], "int4_tokens": 0, "tokens": 0, "hazards": [],
                             "withdrawn": False,
                             "submitted_s": round(sent, 4), "ended_s": round(time.monotonic() - t0, 4),
                             "prompt_ids": list(ids), "token_ids": [], "text": "", "prompt_text": text})
            return
        row = {"error": None, "topology": topology, "kind": kind, "split": split, "n": k, "prompt_id": p.id,
               "request_id": req.request_id, "bad_endpoint": bad,
               "endpoints": r.endpoints or ([se.int4.name] if r.token_rungs and r.token_rungs[0] == "int4" else []),
               "rungs": sorted(set(r.token_rungs)),
               "int4_tokens": sum(x in ("int4", "llama-server") for x in r.token_rungs),
               "tokens": len(r.token_ids), "hazards": [h.check for h in r.hazards],
               "withdrawn": any(h.check == "audit" for h in r.hazards), "submitted_s": round(sent, 4),
               "ended_s": round(time.monotonic() - t0, 4), "prompt_ids": list(ids), "token_ids": list(r.token_ids),
               "text": r.text, "prompt_text": text}
        with lock:
            rows.append(row)

    closed_loop(CLIENTS, list(range(n)), run)
    audits.drain(300)
    for row in rows:
        a = audits.get(row["request_id"])
        row["audited"], row["excess"] = a is not None, (a.excess if a else None)
        row["score"] = a.score if a else None
        at = audits.arrived(row["request_id"])
        row["audited_s"] = round(at - t0, 4) if at is not None else None
        row["alarm_s"] = round(alarms[0][0], 4) if alarms else None
        row["alarm_endpoint"] = alarms[0][1].endpoint if alarms else None
    return sorted(rows, key=lambda r: r["n"])


def judge_rows(rows: list[dict[str, Any]], fp32: Any) -> None:
    """The calibrated judge on every answer (fp32's NLL of it; the standby's engine, its pool closed)."""
    threshold = judge_calibration().threshold
    for r in rows:
        if r["error"] is not None:
            r["garbage"], r["reasons"], r["nll"] = False, [], None
            continue
        nll = mean_nll(fp32.score(r["prompt_ids"], r["token_ids"])) if r["token_ids"] else None
        v = judge(r["text"], r["token_ids"], r["prompt_text"], nll=nll, threshold=threshold)
        r["garbage"], r["reasons"], r["nll"] = v.garbage, list(v.reasons), v.nll


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure and verdict from the outcome lines alone."""
    out: dict[str, Any] = {"kinds": {}, "clean": {}}
    for (topology, kind) in sorted({(r["topology"], r["kind"]) for r in rows}):
        mine = [r for r in rows if r["topology"] == topology and r["kind"] == kind]
        bad = mine[0]["bad_endpoint"]
        alarm = mine[0]["alarm_s"]
        ejected = alarm is not None and mine[0]["alarm_endpoint"] == bad
        of_bad = [r for r in mine if bad is not None and bad in r["endpoints"] and r["int4_tokens"] > 0]
        before = [r for r in of_bad if alarm is None or r["submitted_s"] < alarm]
        after = [r for r in of_bad if alarm is not None and r["submitted_s"] >= alarm]
        fig = {"split": mine[0]["split"], "answers": len(mine), "alarm_s": alarm,
               "alarm_endpoint": mine[0]["alarm_endpoint"], "ejected": ejected,
               "broken_forwarded_before": sum(r["garbage"] for r in before),
               "broken_forwarded_after": sum(r["garbage"] for r in after),
               "int4_answers_of_bad_before": len(before), "int4_answers_of_bad_after": len(after),
               "audited": sum(r["audited"] for r in mine),
               "handed_off": sum(any(h != "audit" for h in r["hazards"]) for r in mine),
               # (outcome lines from before withdrawals have no such field, nor this figure)
               **({"withdrawn": sum(r["withdrawn"] for r in mine)} if all("withdrawn" in r for r in mine) else {}),
               "errors": sum(r["error"] is not None for r in mine),
               "garbage_all": sum(r["garbage"] for r in mine)}
        (out["clean"] if kind == "clean" else out["kinds"]).setdefault(topology, {})[kind] = fig
    verdicts: dict[str, Any] = {}
    for topology, figs in out["kinds"].items():
        held = [f["broken_forwarded_before"] for f in figs.values() if f["split"] == "test"]
        if held:
            median, worst = statistics.median(held), max(held)
            verdicts[f"{topology}_held_out_broken_before_ejection"] = {
                "median": median, "max": worst, "per_kind": held,
                "target": f"median <= {TARGET_MEDIAN}, max <= {TARGET_MAX}",
                "verdict": "PASS" if median <= TARGET_MEDIAN and worst <= TARGET_MAX else "FAIL"}
        after = sum(f["broken_forwarded_after"] for f in figs.values())
        verdicts[f"{topology}_broken_after_ejection"] = {"value": after, "target": "0",
                                                         "verdict": "PASS" if after == 0 else "FAIL"}
    for topology, figs in out["clean"].items():
        c = figs["clean"]
        alarms = int(c["alarm_s"] is not None)
        verdicts[f"{topology}_clean_false_alarms"] = {"value": alarms, "answers": c["answers"], "audited": c["audited"],
                                                     "target": "0", "verdict": "PASS" if alarms == 0 else "FAIL"}
    out["verdicts"] = verdicts
    out["verdict"] = "FAIL" if any(v["verdict"] == "FAIL" for v in verdicts.values()) else "PASS"
    return out


def engine(topology: str, info: ModelInfo, gguf: Path, s: Settings, fp32: Any,
           servers: list[LlamaServer]) -> tuple[ServingEngine, str]:
    common = {"audit_rate": AUDIT_RATE, "audit_spare_rate": AUDIT_SPARE, "detector": committed(),
              "probe_every_s": 5.0, "standby_threads": 1}
    if topology == "replicas":
        servers += [LlamaServer(path, n_parallel=4, threads=1, n_ctx_per_slot=2048).start()
                    for path in (gguf, info.path)]
        cfg = ServingConfig(remote_url=tuple(x.base_url for x in servers), **common)  # type: ignore[arg-type]
        return ServingEngine(cfg, info, s, standby_engines=[fp32]), servers[0].base_url
    cfg = ServingConfig(slots=8, int4_threads=1, **common)  # type: ignore[arg-type]
    se = ServingEngine(cfg, dataclasses.replace(info, path=Path(gguf).resolve()), s, standby_engines=[fp32])
    return se, se.int4.name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, default=64, help="answers per corrupted kind")
    ap.add_argument("--clean", type=int, default=200)
    ap.add_argument("--topologies", default="replicas,in-process")
    ap.add_argument("--kinds", default="", help="comma-separated kind names (default: every GGUF kind)")
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
    fp32 = load_engine("fp32", info, Settings(s.cache_dir, 1, 2048, s.int4_monitor))
    t0 = time.perf_counter()
    kinds = [(m, "test") for m in TEST_FAULT_MODELS if m.gguf_patch] + \
        [(m, "train") for m in FAULT_MODELS if m.gguf_patch]
    if a.kinds:
        kinds = [(m, sp) for m, sp in kinds if m.name in a.kinds.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        jobs: list[tuple[str, str, Path, list[Any], int]] = []
        for m, split in kinds:
            gguf = Path(d) / f"{m.name}.gguf"
            GGUF_PATCHES[m.patch](info.path, gguf, **dict(m.gguf_patch or ()))
            prompts = [p for p in abnormal if split_of(p.id) == "test" and p.cls in m.classes] \
                if m.classes else test_normal
            jobs.append((m.name, split, gguf, prompts or test_normal, a.n))
        jobs.append(("clean", "test", info.path, test_normal, a.clean))
        for topology in a.topologies.split(","):
            for kind, split, gguf, prompts, n in jobs:
                servers: list[LlamaServer] = []
                se, bad = engine(topology, info, gguf, s, fp32, servers)
                try:
                    mine = serve(se, prompts, n, topology, kind, split, None if kind == "clean" else bad)
                finally:
                    se.close()
                    for x in servers:
                        x.stop()
                judge_rows(mine, fp32)
                rows += mine
                f = figures(mine)["kinds" if kind != "clean" else "clean"][topology][kind]
                print(f"{topology} {kind}: {json.dumps(f)} {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    fp32.close()
    (a.out / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"benchmark": "detection_c8", "command": " ".join(["python bench/detection_c8.py", *sys.argv[1:]]),
              "thresholds": committed().to_dict(), "judge_threshold": judge_calibration().threshold,
              "clients": CLIENTS, "audit": {"rate": AUDIT_RATE, "spare_rate": AUDIT_SPARE},
              "llama_server": {"n_parallel": 4, "threads": 1, "n_ctx_per_slot": 2048, "replicas": 2},
              "environment": snapshot(s.n_threads, 2048), "wall_s": round(time.perf_counter() - t0, 1),
              "figures": figures(rows)}
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"]["verdicts"], indent=1))
    return 0 if result["figures"]["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
