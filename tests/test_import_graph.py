"""No import circle in the Python sources: the package, and the tools, tests, benchmarks and
examples around it. The graph has an edge for every import of a module of the tree (top-level
and inside functions alike, so a lazy import cannot hide a circle). ``from a import b`` counts
as importing ``a.b`` when that is a module, else ``a``; a package is not counted as importing
its submodules' parents.

Modules are named as they are imported: ``python/`` holds the package (``routepack.*``), and
``tools/``, ``tests/``, ``tests/torch/``, ``benches/`` and ``examples/`` are each on the path
of the scripts and tests they hold (``fuzzlib.t_plan``, ``random_plans``, ...). The vendored
slime sources (``tests/slime_reference``) are someone else's code and not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "routepack"
#: The folders whose modules are imported by their path below the folder (the deepest wins).
SEARCH_ROOTS = [ROOT / p for p in ("python", "tools", "tests", "tests/torch", "benches", "examples")]
VENDORED = [ROOT / "tests" / "slime_reference"]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tree_modules() -> Dict[str, Path]:
    """Every module of the tree by its import name; two files of one name fail the test."""
    mods: Dict[str, Path] = {}
    for root in SEARCH_ROOTS:
        for path in sorted(root.rglob("*.py")):
            if any(v in path.parents for v in VENDORED):
                continue
            if max((r for r in SEARCH_ROOTS if r in path.parents), key=lambda r: len(r.parts)) != root:
                continue  # below a deeper search root: named from there
            name = module_name(path, root)
            assert name not in mods, f"two modules named {name}: {mods[name]} and {path}"
            mods[name] = path
    return mods


def imports(path: Path, name: str, known: Set[str]) -> Set[str]:
    """The modules of ``known`` that the file ``path`` (module ``name``) imports."""
    is_package = path.name == "__init__.py"
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            # ``import a.b.c`` imports a.b.c; its parents run too, but the edge is to the leaf
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(modules: Dict[str, Path] | None = None) -> Dict[str, Set[str]]:
    mods = tree_modules() if modules is None else modules
    known = set(mods) | {"routepack._core"}
    return {name: imports(path, name, known) & set(mods) for name, path in mods.items()}


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


def test_the_graph_sees_the_modules():
    edges = graph()
    assert "routepack.stages.placement" in edges["routepack.stages.registry"]
    assert "routepack.window" in edges["routepack.replay"]
    assert "routepack.routes.ids" in edges["routepack.window"]
    # tools, tests and the package in one graph, lazy imports included
    assert "fuzzlib.engine" in edges["fuzzlib.t_plan"]
    assert "fuzzlib.t_plan" in edges["fuzz_campaign"]  # inside a function
    assert "random_plans" in edges["fuzzlib.t_plan"]
    assert "routepack.placement" in edges["fuzzlib.t_analysis"]
    assert "test_import_graph" in edges["test_source_tree"]
    assert "routepack.torch" in edges["test_torch_remap"]  # tests/torch, a search root of its own


def test_the_package_is_all_there():
    edges = graph()
    package = {m for m in edges if m == "routepack" or m.startswith("routepack.")}
    assert package == {module_name(p, ROOT / "python") for p in PACKAGE.rglob("*.py")}


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_check_finds_a_lazy_circle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import a\n")
    mods = {"pkg": tmp_path / "pkg" / "__init__.py"}
    mods.update({f"pkg.{n}": tmp_path / "pkg" / f"{n}.py" for n in "ab"})
    assert cycles(graph(mods)) == [["pkg.a", "pkg.b", "pkg.a"]]
