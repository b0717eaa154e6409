"""No import circle in the Python package: the graph of every module's imports of
routepack modules (top-level and inside functions alike, so a lazy import cannot hide a
circle) has no cycle. ``from routepack.a import b`` counts as importing ``routepack.a.b``
when that is a module, else ``routepack.a``; a package is not counted as importing its
submodules' parents."""

import ast
from pathlib import Path
from typing import Dict, List, Set

import routepack as rp

PACKAGE = Path(rp.__file__).parent


def module_name(path: Path) -> str:
    parts = ("routepack",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> Dict[str, Set[str]]:
    mods = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(mods) | {"routepack._core"}
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
                ]
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_the_graph_sees_the_stage_modules():
    edges = graph()
    assert "routepack.stages.placement" in edges["routepack.stages.registry"]
    assert "routepack.window" in edges["routepack.replay"]
    assert "routepack._routed" in edges["routepack.window"]


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
