"""The configuration reference, generated from the config classes' own field docs (`knob`): the
topology file's sections and keys, the environment, and a file of every default. `qladder config
reference` prints it; docs/CONFIG.md is its output, and tests/test_config_reference.py fails when the
two drift. `render_toml` also writes any topology back as a file (`qladder config show`), which
parses to the same topology."""

from __future__ import annotations

import inspect
import json
import math
import textwrap
from dataclasses import MISSING, fields
from typing import Any

from qladder.config import Settings, default_of
from qladder.server.breaker import BreakerConfig
from qladder.server.quarantine import QuarantineConfig
from qladder.server.shared_state import StateSettings
from qladder.server.topology import (
    INT4_RUNGS,
    REMOTE_RUNGS,
    CoresSettings,
    ModelSettings,
    PoolConfig,
    ServerSettings,
    Topology,
)

# (TOML section, its class, the Topology field holding it), in the file's order
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("server", ServerSettings, "server"), ("model", ModelSettings, "model"), ("pools", PoolConfig, "pools"),
    ("cores", CoresSettings, "cores"), ("breaker", BreakerConfig, "breaker"),
    ("quarantine", QuarantineConfig, "quarantine"), ("state", StateSettings, "state"))


def toml_value(value: Any) -> str:
    """One TOML value (None has no TOML form: callers leave such a key out)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")


def _default_cell(value: Any) -> str:
    return "unset" if value is None or value is MISSING else f"`{toml_value(value)}`"


def _comment(text: str, indent: str = "") -> list[str]:
    return [indent + "# " + line for line in textwrap.wrap(text, 96, break_on_hyphens=False)]


def _pool_keys(p: PoolConfig) -> list[tuple[str, Any]]:
    """The keys a pool's table writes: name and rungs, then those off their defaults (an in-process
    INT4 pool's threads are [cores] int4's, so never written there)."""
    out: list[tuple[str, Any]] = [("name", p.name), ("rungs", p.rungs)]
    for f in fields(PoolConfig):
        value = getattr(p, f.name)
        if f.name in ("name", "rungs") or value is None or value == default_of(f):
            continue
        if f.name == "threads" and p.rungs and p.rungs[0] in INT4_RUNGS and p.rungs[0] not in REMOTE_RUNGS:
            continue
        out.append((f.name, value))
    return out


def render_toml(t: Topology, comments: bool = True) -> str:
    """The topology as a file: every section's every key (None ones as comments), each under its doc."""
    lines: list[str] = []
    for section, cls, attr in SECTIONS:
        if section == "pools":
            for p in t.pools:
                lines.append("[[pools]]")
                docs = {f.name: str(f.metadata["doc"]) for f in fields(PoolConfig)}
                for key, value in _pool_keys(p):
                    lines += _comment(docs[key]) if comments else []
                    lines.append(f"{key} = {toml_value(value)}")
                lines.append("")
            continue
        lines.append(f"[{section}]")
        obj = getattr(t, attr)
        for f in fields(cls):
            value = getattr(obj, f.name)
            lines += _comment(str(f.metadata["doc"])) if comments else []
            lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe splits a Markdown table's cell, even in code


def _table(cls: type) -> list[str]:
    rows = ["| key | type | default | what it is, what it trades |", "|---|---|---|---|"]
    for f in fields(cls):
        default = "required" if f.metadata.get("required") else _default_cell(default_of(f))
        rows.append(f"| `{f.name}` | `{_cell(str(f.type))}` | {_cell(default)} | {_cell(str(f.metadata['doc']))} |")
    return rows


def _about(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def render_markdown() -> str:
    out = ["# Configuration reference", "",
           "Generated from the code by `qladder config reference` (the fields' own docs in",
           "`src/qladder/server/topology.py`, `breaker.py`, `quarantine.py`, `shared_state.py` and",
           "`src/qladder/config.py`); do not edit by hand: `tests/test_config_reference.py` fails when this",
           "file and the code differ. `qladder config show [FILE]` prints a file's effective configuration.",
           "",
           "`qladder serve --config FILE` reads one TOML file. Every key is optional; with no file the",
           "defaults serve the embedded model on this machine's cores (two pools: `int4` and `standby`).",
           "Every mistake in a file is reported at start-up, one line each; a retired key says what took",
           "its place.", ""]
    for section, cls, _ in SECTIONS:
        head = "[[pools]]" if section == "pools" else f"[{section}]"
        out += [f"## `{head}`", "", _about(cls), "", *_table(cls), ""]
        if section == "pools":
            out += ["With no `[[pools]]`, the two default pools are:", "", "```toml",
                    *[line for p in Topology().pools for line in
                      ["[[pools]]", *(f"{k} = {toml_value(v)}" for k, v in _pool_keys(p)), ""]][:-1],
                    "```", ""]
    out += ["## The environment", "", _about(Settings) + " Read once per process by",
            "`Settings.from_env`; an empty variable is the default.", "",
            "| variable | default | what it is |", "|---|---|---|"]
    for f in fields(Settings):
        default = "" if f.name == "cache_dir" else default_of(f)
        shown = str(int(default)) if isinstance(default, bool) else str(default)  # as the variable is written
        cell = "unset" if shown in ("", "None") else f"`{shown}`"
        out.append(f"| `{f.metadata['env']}` | {cell} | {_cell(str(f.metadata['doc']))} |")
    out += ["", "## A file of every default", "",
            "`qladder config show` with no file prints this; it parses to the defaults.", "",
            "```toml", render_toml(Topology()).rstrip(), "```", ""]
    return "\n".join(out)
