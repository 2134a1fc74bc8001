"""The request machine's drivers keep to its declared view (`machine.DRIVER_VIEW`): every use of
a machine in a driver's source names an attribute on that list, and none writes through it (no
assignment or del, no setattr, no method call on one of its fields but the Recorder's four that
a driver may make, `m.rec.prefill`, `m.rec.flush`, `m.rec.verified`, `m.rec.migrated`, and the shared guard's loop
rule, `m.guard.check_repetition`, a pure function of its arguments). A machine is what the drivers name it: `m`,
or the `.m` of a slot, a task or a visit. (The type checker sees the fields; this holds the
drivers to the few a driver may touch.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import qladder
from qladder.machine import DRIVER_VIEW, RequestMachine

SRC = Path(qladder.__file__).parent
DRIVERS = ["ladder.py", "serving/scheduler.py", "serving/standby.py", "serving/remote.py",
           "serving/remote_visit.py", "serving/remote_verified.py", "serving/handoffs.py", "serving/verify.py"]


def _is_machine(node: ast.expr) -> bool:
    """`m`, or `x.m` (a slot's, a task's, a visit's machine)."""
    return (isinstance(node, ast.Name) and node.id == "m") or (isinstance(node, ast.Attribute) and node.attr == "m")


def _root_use(node: ast.expr) -> ast.Attribute | None:
    """The `m.<attr>` at the root of an attribute/subscript chain, if the chain starts at a machine."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and _is_machine(node.value):
            return node
        node = node.value
    return None


FIELD_CALLS = {("rec", "prefill"), ("rec", "flush"), ("rec", "verified"), ("rec", "migrated"),
               ("guard", "check_repetition")}


def _chain(node: ast.expr) -> list[str] | None:
    """`m.a.b` -> ["a", "b"] (a subscript on the way counts as "[]"); None when the chain does
    not start at a machine."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and _is_machine(node.value):
            return [node.attr, *reversed(attrs)]
        attrs.append(node.attr if isinstance(node, ast.Attribute) else "[]")
        node = node.value
    return None


def _uses(path: Path) -> tuple[set[str], list[str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    writes: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_machine(node.value):
            names.add(node.attr)
        if isinstance(node, ast.Call):
            chain = _chain(node.func) if isinstance(node.func, ast.Attribute) else None
            if chain is not None and len(chain) >= 2 and tuple(chain) not in FIELD_CALLS:
                writes.append(f"{path.name}:{node.lineno} calls m.{'.'.join(chain)}")
            if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args \
                    and (_is_machine(node.args[0]) or _chain(node.args[0]) is not None):
                writes.append(f"{path.name}:{node.lineno} {node.func.id} on a machine")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                root = _root_use(el) if isinstance(el, ast.Attribute | ast.Subscript) else None
                if root is not None:
                    writes.append(f"{path.name}:{el.lineno} writes m.{root.attr}")
    return names, writes


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_driver_reads_and_calls_only_the_machines_declared_view(driver):
    names, writes = _uses(SRC / driver)
    assert names, f"{driver} uses no machine: the list of drivers is stale"
    assert names <= DRIVER_VIEW, f"{driver} reaches past the view: {sorted(names - DRIVER_VIEW)}"
    assert not writes, writes


def test_the_view_names_only_what_a_machine_has():
    init = ast.parse(inspect.getsource(RequestMachine.__init__).strip())
    fields = {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for name in DRIVER_VIEW:
        assert name in fields or name in RequestMachine.__dict__, f"RequestMachine has no {name!r}"


def test_the_checker_sees_a_write_and_a_reach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(s, m):\n    s.m.rung = 2\n    s.m.rec.timings['x'] = 1\n    m.accepted.append(3)\n"
                   "    setattr(m, 'rung', 1)\n    m.rec.flush(None)\n    m.rec.timings['k'].append(1)\n"
                   "    setattr(m.rec, 'x', 1)\n    m.rec.flush.x()\n    return s.m.stream\n")
    names, writes = _uses(bad)
    assert "stream" in names - DRIVER_VIEW
    # the two assignments, the append, both setattrs, the call through a subscript and the one
    # past rec.flush (rec.flush itself is allowed)
    assert len(writes) == 7, writes
