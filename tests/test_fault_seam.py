"""Test machinery stays out of the request path: a request without faults imports no fault module
and calls no fault hook, on the server `qladder serve` builds (int4 batched + the fp32 standby)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# In a fresh interpreter, so that sys.modules says what this server's requests imported.
SCRIPT = r"""
import dataclasses, json, sys

from fastapi.testclient import TestClient

from qladder.engines.llamacpp_batch import BatchedLlamaCpp
from qladder.server.serve import build_server
from qladder.server.topology import Topology
from qladder.serving.scheduler import Int4Scheduler

calls = []


def spy(cls, name):
    inner = getattr(cls, name)

    def wrapped(self, *a, **kw):
        calls.append(name)
        return inner(self, *a, **kw)

    setattr(cls, name, wrapped)


for name in ("set_gain", "clear_gain", "arm_stall"):
    spy(BatchedLlamaCpp, name)
spy(Int4Scheduler, "_python_stall")

t = Topology()
t = dataclasses.replace(t, server=dataclasses.replace(t.server, allow_faults=True, incidents=sys.argv[1]))
server = build_server(t)
seen = {}
try:
    client = TestClient(server.app)

    def ask(path, extra):
        body = {"model": t.server.model_name, "max_tokens": 8, "temperature": 0, **extra}
        if path == "chat":
            body["messages"] = [{"role": "user", "content": "Name three colors."}]
        else:
            body["prompt"] = "The three primary colors are"
        r = client.post(f"/v1/{'chat/' if path == 'chat' else ''}completions", json=body)
        return {"status": r.status_code, "hazards": [h["check"] for h in r.json()["qladder"]["hazards"]],
                "fault_modules": sorted(m for m in sys.modules if m == "qladder.testing.faults" or ".gguf_patch" in m),
                "hooks": sorted(set(calls))}

    seen["chat"] = ask("chat", {})
    seen["completion"] = ask("completion", {})
    seen["faulted"] = ask("chat", {"qladder": {"faults": ["gain@layer=11,channel=507,x=3"]}})
finally:
    server.close()
print("RESULT " + json.dumps(seen))
"""


def test_a_request_without_faults_runs_no_fault_code(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "incidents.sqlite3")],
                       capture_output=True, text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line is not None, p.stderr[-3000:]
    seen = json.loads(line[len("RESULT "):])
    for clean in (seen["chat"], seen["completion"]):
        assert clean == {"status": 200, "hazards": [], "fault_modules": [], "hooks": []}
    # The same spies see a faulted request's machinery: the check above can fail.
    faulted = seen["faulted"]
    assert faulted["status"] == 200 and faulted["fault_modules"] == ["qladder.testing.faults"]
    assert {"set_gain", "clear_gain"} <= set(faulted["hooks"]) and faulted["hazards"]


# Where fault code may be reached at run time: its own module, the seam, and the tools that are
# test machinery themselves (validation, benchmarks); the package's lazy public names.
FAULT_REACH = {"__init__.py"}  # (its lazy names: PEP 562, loaded on first use)
FAULT_TOOLS = ("testing/", "validate/", "benchmarks/")  # the testing wing, and the tools that use it


def _runtime_fault_imports(path):
    """Lines of `path` that import qladder.testing.faults outside an `if TYPE_CHECKING:` block."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typing_only |= {id(n) for b in node.body for n in ast.walk(b)}
    return [n.lineno for n in ast.walk(tree) if id(n) not in typing_only and (
        (isinstance(n, ast.ImportFrom) and n.module == "qladder.testing.faults")
        or (isinstance(n, ast.ImportFrom) and n.module == "qladder.testing"
            and any(a.name == "faults" for a in n.names))
        or (isinstance(n, ast.Import) and any(a.name == "qladder.testing.faults" for a in n.names)))]


def test_fault_code_is_reached_only_through_the_seam():
    """`grep faults`, as a test: no production module imports qladder.testing.faults at run time but the
    seam (type-only imports are allowed; validation and benchmarks are test machinery)."""
    from pathlib import Path

    import qladder

    src = Path(qladder.__file__).parent
    reach = {str(p.relative_to(src)): lines for p in sorted(src.rglob("*.py"))
             if (lines := _runtime_fault_imports(p))}
    assert reach, "the checker found no import at all: it is not looking"
    outside = {f: ls for f, ls in reach.items() if f not in FAULT_REACH and not f.startswith(FAULT_TOOLS)}
    assert outside == {}, f"fault code reached outside the seam: {outside}"
    assert "testing/seam.py" in reach
