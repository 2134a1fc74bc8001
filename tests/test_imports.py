"""qladder's import graph has no cycles: every import counts (top-level, inside functions, under
TYPE_CHECKING), read by grimp from the source. A cycle is a pair of modules that each need the
other; the report names every strongly connected group and one import of each."""

from __future__ import annotations

import grimp


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    group.append(x)
                    if x == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_the_cycle_finder_finds_a_cycle_and_only_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_qladder_has_no_import_cycles():
    graph = grimp.build_graph("qladder", exclude_type_checking_imports=False)
    edges = {m: {x for x in graph.find_modules_directly_imported_by(m) if x in graph.modules}
             for m in graph.modules}
    found = _cycles(edges)
    detail = [(group, [(a, b) for a in group for b in sorted(edges[a]) if b in group]) for group in found]
    assert not found, f"import cycles: {detail}"
