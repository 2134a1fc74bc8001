"""Offline replay of stored incidents: does the hazard come back on this rung?

    out = replay_incidents(store.rows(...), ["int4", "fp32"], limit=20, with_faults=False)

Each distinct stored prompt (by fingerprint, newest first) is decoded greedily on each chosen rung
alone, guarded, for a few tokens past the step where its hazard happened. The verdict per rung:
`reproduced` (a hazard of the same check), `other:<check>` (a different hazard), or `clean`.
An incident caused by an injected fault reproduces only `--with-faults`; a redacted row (its
prompt was not kept) cannot be replayed and says so. Sampling settings are not stored: the
replay is greedy, so a hazard that depended on a sampled path may not come back.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Sequence
from typing import Any

from qladder.errors import ConfigError

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(since: str | None, now: float | None = None) -> float | None:
    """A Unix time from an ISO time ("2026-12-01T10:00") or an age ("30m", "2h", "1d")."""
    if since is None:
        return None
    m = _AGE.match(since.strip())
    if m:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return (now if now is not None else time.time()) - float(m.group(1)) * scale
    try:
        t = dt.datetime.fromisoformat(since.strip())
    except ValueError:
        raise ConfigError(f"--since {since!r}: give an ISO time (2026-12-01T10:00) or an age (30m, 2h, 1d)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def group_prompts(rows: Sequence[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Incidents grouped by prompt fingerprint, newest prompt first, at most `limit` prompts."""
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:  # newest first
        g = groups.get(r["prompt_hash"])
        if g is None:
            if len(groups) >= limit:
                continue
            ids = json.loads(r["prompt_ids"]) if r["prompt_ids"] else None
            g = groups[r["prompt_hash"]] = {"prompt_hash": r["prompt_hash"], "prompt_ids": ids,
                                            "incident_ids": [], "check": r["check_name"], "rung": r["rung"],
                                            "step": int(r["step"]), "faults": json.loads(r["faults"] or "[]")}
        g["incident_ids"].append(int(r["id"]))
        g["step"] = max(g["step"], int(r["step"]))
    return list(groups.values())


def replay_incidents(rows: Sequence[dict[str, Any]], rungs: Sequence[str], limit: int = 20,
                     with_faults: bool = False) -> dict[str, Any]:
    from qladder.config import Settings
    from qladder.engines import check_rungs, load_engine
    from qladder.ladder import Ladder
    from qladder.model import inspect_model
    from qladder.policy import LadderConfig
    from qladder.sampling import SamplingParams
    from qladder.testing import seam as fault_seam

    check_rungs(rungs)
    groups = group_prompts(rows, limit)
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    replays = [{**{k: g[k] for k in ("prompt_hash", "incident_ids", "check", "rung", "step", "faults")},
                "rungs": {}} for g in groups]
    for rung in rungs:
        engine = load_engine(rung, info, settings)
        try:
            ladder = Ladder([engine], LadderConfig(record_incidents=False))
            for g, out in zip(groups, replays, strict=True):
                if g["prompt_ids"] is None:
                    out["rungs"][rung] = {"verdict": "redacted", "hazards": []}
                    continue
                faults = list(fault_seam.parse(g["faults"])) if with_faults else []
                params = SamplingParams(max_tokens=max(16, g["step"] + 8))
                res = ladder.generate(g["prompt_ids"], params, faults)
                checks = [h.check for h in res.hazards]
                verdict = ("reproduced" if g["check"] in checks else f"other:{checks[0]}" if checks else "clean")
                out["rungs"][rung] = {"verdict": verdict, "hazards": [h.to_dict() for h in res.hazards],
                                      "tokens": len(res.token_ids)}
        finally:
            engine.close()
    return {"rungs": list(rungs), "with_faults": with_faults, "replays": replays}
