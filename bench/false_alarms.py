"""False alarms of the audit's test on clean traffic, through `qladder serve`: no ejection and no
prompt class sent to verified over >= 1,000 clean requests.

One `qladder serve` (the default topology: the embedded INT4 pool, 8 slots, the in-process fp32
standby, the audit and its test on, the committed thresholds and drift bound) on the clean GGUF.
The held-out (test) half of the validation corpora, normal and abnormal-but-valid prompts (as a
client's JSON carries them: lone surrogates replaced), each asked greedy once and sampled at
temperature 0.8 with SEEDS seeds, ANSWER tokens, by CLIENTS clients through the openai client (a
closed loop, in an order shuffled by a fixed seed). `--audit-rate` (default 0.2, four times the
defaults' floor: more of the answers are evidence) and `--audit-spare` (0.5, the default, within
the default budget) are the INT4 pool's audit_rate and audit_spare_rate (auditing every answer
holds the box's cores on fp32 prefills of the long abnormal prompts: 0.5 answers/s).

Every request is one line of DIR/outcomes.jsonl (prompt id, class, mode, seed, the answer's ids and
rungs, hazards, finish reason, the HTTP status or error). After the run, from the server: its
/metrics (the audit's records, the endpoint alarms) and its incident store's `audit` rows. A class
sent to verified shows in the outcomes as an answer of the INT4 pool written by fp32 alone with no
hazard (the route is INT4's, the tokens are the standby's). DIR/results.json holds the figures,
computed from the outcome lines and the server's counts by `figures` (`--recompute DIR`: again,
exit 1 if they differ or a verdict fails). Verdicts, fixed before the run (the issue's): ejections
== 0 and class escalations == 0, with >= 1,000 answered requests; beside them the false-alarm rate
the thresholds were set for (health/detector_calibration.json). Usage:
    python bench/false_alarms.py --out DIR [--seeds 5] [--clients 8] [--audit-rate 0.2] [--audit-spare 0.5]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

from qladder.benchmarks.common import recompute_figures
from qladder.config import Settings
from qladder.environment import snapshot
from qladder.health.detector import committed, committed_drift_bound
from qladder.peers.process import start_qladder_serve, stop
from qladder.validate.corpora import load_corpora, split_of
from qladder.validate.replay import as_sent

CLIENTS, SEEDS, ANSWER, TEMPERATURE = 8, 5, 32, 0.8
TARGET_REQUESTS = 1000

CONFIG = """
[server]
incidents = "{db}"

[[pools]]
name = "int4"
rungs = ["int4"]
slots = 8
weight = 1.0
handoff_to = "standby"
audit_rate = {rate}
audit_spare_rate = {spare}
detect = true

[[pools]]
name = "standby"
rungs = ["fp32"]
weight = 0.0
"""



def jobs(seeds: int) -> list[dict[str, Any]]:
    normal, abnormal = load_corpora()
    prompts = [p for p in [*normal, *abnormal] if split_of(p.id) == "test"]
    out = [{"prompt_id": p.id, "class": p.cls, "abnormal": p in abnormal, "mode": "greedy", "seed": None,
            "text": as_sent(p.prompt)} for p in prompts]
    out += [{"prompt_id": p.id, "class": p.cls, "abnormal": p in abnormal, "mode": "sampled", "seed": s,
             "text": as_sent(p.prompt)} for p in prompts for s in range(seeds)]
    random.Random(20261207).shuffle(out)
    return out


def ask(client: openai.OpenAI, model: str, job: dict[str, Any]) -> dict[str, Any]:
    row = dict(job)
    params: dict[str, Any] = {"temperature": 0.0} if job["mode"] == "greedy" else \
        {"temperature": TEMPERATURE, "seed": job["seed"]}
    t0 = time.monotonic()
    try:
        r = client.chat.completions.create(model=model, max_tokens=ANSWER, messages=[
            {"role": "user", "content": job["text"]}], extra_body={"qladder": {"return_token_ids": True}}, **params)
        ext = (r.model_extra or {})["qladder"]
        row.update(status=200, error=None, pool=ext["pool"], route=ext["route"], token_ids=ext["token_ids"],
                   token_rungs=ext["token_rungs"], hazards=[h["check"] for h in ext["hazards"]],
                   finish_reason=ext["finish_reason"], answer=r.choices[0].message.content)
    except openai.APIStatusError as exc:  # a well-formed refusal: a row, never dropped
        row.update(status=exc.status_code, error=str(exc)[:300], pool=None, route=None, token_ids=[],
                   token_rungs=[], hazards=[], finish_reason=None, answer=None)
    except openai.APIError as exc:
        row.update(status=None, error=f"{type(exc).__name__}: {exc}"[:300], pool=None, route=None, token_ids=[],
                   token_rungs=[], hazards=[], finish_reason=None, answer=None)
    row["latency_s"] = round(time.monotonic() - t0, 4)
    return row


def scrape(base: str) -> dict[str, float]:
    """The server's audit and alarm counts from /metrics (summed over labels)."""
    want = {"qladder_audit_answers_total": "audits", "qladder_endpoint_alarms_total": "alarms"}
    out = dict.fromkeys(want.values(), 0.0)
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want and not line.startswith("#"):
            if name == "qladder_endpoint_alarms_total" and 'what="ejected"' not in line:
                continue
            out[want[name]] += float(line.split()[-1])
    return out


def figures(rows: list[dict[str, Any]], server: dict[str, Any]) -> dict[str, Any]:
    """Every figure and verdict from the outcome lines and the server's counts."""
    answered = [r for r in rows if r["status"] == 200]
    escalated = [r for r in answered if r["pool"] == "int4" and r["token_rungs"] and not r["hazards"]
                 and set(r["token_rungs"]) == {"fp32"}]
    by_mode = {m: sum(r["mode"] == m for r in answered) for m in ("greedy", "sampled")}
    ejections = int(server["alarms"]) + int(server["audit_incidents"])
    verdicts = {
        "requests": {"value": len(answered), "target": f">= {TARGET_REQUESTS}",
                     "verdict": "PASS" if len(answered) >= TARGET_REQUESTS else "FAIL"},
        "ejections": {"value": ejections, "target": "0", "verdict": "PASS" if ejections == 0 else "FAIL"},
        "class_escalations": {"value": len(escalated), "target": "0",
                              "verdict": "PASS" if not escalated else "FAIL"},
    }
    return {"requests": len(rows), "answered": len(answered), "errors": len(rows) - len(answered),
            "by_mode": by_mode, "abnormal": sum(r["abnormal"] for r in answered),
            "handed_off": sum(bool(r["hazards"]) for r in answered),
            "escalated_request_ids": [r["prompt_id"] for r in escalated],
            "audited": server["audits"], "audit_rows": server["audit_rows"], "alarms_metric": server["alarms"],
            "audit_incidents": server["audit_incidents"], "verdicts": verdicts,
            "verdict": "FAIL" if any(v["verdict"] == "FAIL" for v in verdicts.values()) else "PASS"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--audit-rate", type=float, default=0.2)
    ap.add_argument("--audit-spare", type=float, default=0.5)
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests (a smoke run)")
    ap.add_argument("--recompute", type=Path)
    a = ap.parse_args()
    if a.recompute:
        server = json.loads((a.recompute / "results.json").read_text())["server"]
        return recompute_figures(a.recompute, lambda rows: figures(rows, server))
    assert a.out is not None, "--out DIR"
    a.out.mkdir(parents=True, exist_ok=True)
    todo = jobs(a.seeds)[: a.limit or None]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "incidents.sqlite3"
        cfg = Path(d) / "serve.toml"
        cfg.write_text(CONFIG.format(db=db, rate=a.audit_rate, spare=max(a.audit_rate, a.audit_spare)))
        proc, base = start_qladder_serve(cfg, a.out / "serve.log", ["--log-level", "warning"])
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        try:
            model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300) as client:
                done = [0]

                def run(job: dict[str, Any]) -> None:
                    row = ask(client, model, job)
                    with lock:
                        rows.append(row)
                        done[0] += 1
                        if done[0] % 100 == 0:
                            print(f"{done[0]}/{len(todo)} {time.perf_counter() - t0:.0f} s", file=sys.stderr)

                with ThreadPoolExecutor(a.clients) as pool:
                    list(pool.map(run, todo))
            deadline = time.monotonic() + 600  # the audit runs behind the answers: let it finish
            last, still = -1.0, 0
            while time.monotonic() < deadline and still < 10:
                now = scrape(base)["audits"]
                still = still + 1 if now == last else 0
                last = now
                time.sleep(1.0)
            server: dict[str, Any] = scrape(base)
        finally:
            stop(proc, timeout_s=60.0)
        with sqlite3.connect(db) as c:
            server["audit_incidents"] = c.execute("select count(*) from incidents where check_name = 'audit'"
                                                  ).fetchone()[0]
            server["audit_rows"] = c.execute("select count(*) from audits").fetchone()[0]
    det = committed()
    (a.out / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"benchmark": "false_alarms", "command": " ".join(["python bench/false_alarms.py", *sys.argv[1:]]),
              "clients": a.clients, "seeds": a.seeds, "answer_tokens": ANSWER, "temperature": TEMPERATURE,
              "audit_rate": a.audit_rate, "audit_spare_rate": max(a.audit_rate, a.audit_spare),
              "thresholds": det.to_dict(),
              "false_alarm_rate_set": {"endpoint": det.false_alarm, "per_test": [det.greedy.false_alarm,
                                                                                 det.sampled.false_alarm],
                                       "within_audited_answers": det.greedy.horizon},
              "drift_bound": committed_drift_bound(), "server": server,
              "environment": snapshot(Settings.from_env().n_threads, 2048),
              "wall_s": round(time.perf_counter() - t0, 1), "figures": figures(rows, server)}
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"]["verdicts"], indent=1))
    return 0 if result["figures"]["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
