"""The shape of the source tree (issue 11's house rules), checked rather than hoped:

* no import circle between the Rust modules of either crate (a module "uses" another when a
  ``use`` or a ``crate::``/``super::``/``self::`` path in it names an item of that module; a
  parent declaring ``mod child;`` does not use the child), and
* no non-test source file over ``MAX_LINES`` lines, Rust or Python.

The Python import graph has its own test (``test_import_graph.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

from test_import_graph import cycles

ROOT = Path(__file__).resolve().parents[1]
CRATES = {"routepack-core": ROOT / "crates" / "routepack-core" / "src", "routepack": ROOT / "src"}
MAX_LINES = 600

Module = Tuple[str, ...]


def module_of(path: Path, src: Path) -> Module:
    parts = path.relative_to(src).with_suffix("").parts
    if parts[-1] in ("lib", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])")


def strip_test_modules(code: str) -> Tuple[str, Set[str]]:
    """``code`` without its inline ``#[cfg(test)] mod x { … }`` blocks, and the names of the
    test modules it declares in files of their own (``#[cfg(test)] mod x;``). Tests depend on
    what they test and its neighbours; the rule is about the product code."""
    files: Set[str] = set()
    while True:
        m = TEST_MOD.search(code)
        if not m:
            return code, files
        if m.group(2) == ";":
            files.add(m.group(1))
            code = code[: m.start()] + code[m.end() :]
            continue
        depth, i = 1, m.end()
        while depth and i < len(code):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        code = code[: m.start()] + code[i:]


def expand_use_tree(tree: str) -> List[str]:
    """``a::{b, c::{d, e as f}}`` → ``["a::b", "a::c::d", "a::c::e as f"]``."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree.strip())
    tree = re.sub(r"\s+", " ", tree)
    if "{" not in tree:
        return [tree]
    head, body = tree.split("{", 1)
    body = body[: body.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    return [p for item in items if item for p in expand_use_tree(head + item)]


def uses_in(text: str) -> Tuple[List[str], Dict[str, str]]:
    """The paths a file uses, and its re-exports (``pub use``: exported name → path). A
    re-export only names an item for others, so it is not a use of its own; a path through
    it is followed to where the item lives."""
    code, _ = strip_test_modules(strip_comments(text))
    used: List[str] = []
    exports: Dict[str, str] = {}
    for m in re.finditer(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", code):
        for leaf in expand_use_tree(m.group(2)):
            alias = re.search(r" as (\w+)$", leaf)
            path = re.sub(r" as \w+$", "", leaf)
            if m.group(1):
                exports[alias.group(1) if alias else path.split("::")[-1]] = path
            else:
                used.append(path)
    rest = re.sub(r"\buse\s+[^;]+;", "", code)
    used += re.findall(r"\b(?:crate|super|self)(?:::\w+)+", rest)
    return used, exports


def resolve(
    path: str, here: Module, modules: Set[Module], exports: Dict[Module, Dict[str, str]] | None = None, depth: int = 0
) -> Module | None:
    """The module whose item ``path`` (used in module ``here``) names, following re-exports."""
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        cur: Module = ()
        segs = segs[1:]
    elif segs[0] in ("super", "self"):
        cur = here
    elif here + (segs[0],) in modules:
        cur = here
    else:
        return None  # another crate, std, or a local item
    while segs and segs[0] in ("super", "self"):
        if segs.pop(0) == "super":
            cur = cur[:-1]
    for i, s in enumerate(segs):
        if cur + (s,) in modules:
            cur = cur + (s,)
        elif exports and s in exports.get(cur, {}) and depth < 8:
            rest = "::".join(segs[i + 1 :])
            origin = exports[cur][s] + ("::" + rest if rest else "")
            return resolve(origin, cur, modules, exports, depth + 1)
        else:
            break
    return cur


def rust_graph(src: Path) -> Dict[str, Set[str]]:
    files = {module_of(p, src): p for p in src.rglob("*.rs")}
    tests = {m + (name,) for m, p in files.items() for name in strip_test_modules(strip_comments(p.read_text()))[1]}
    files = {m: p for m, p in files.items() if not any(m[: len(t)] == t for t in tests)}
    modules = set(files)
    parsed = {m: uses_in(p.read_text()) for m, p in files.items()}
    exports = {m: e for m, (_, e) in parsed.items()}
    edges: Dict[str, Set[str]] = {"::".join(m) or "crate": set() for m in files}
    for mod, (used, _) in parsed.items():
        for p in used:
            target = resolve(p, mod, modules, exports)
            if target is not None and target != mod:
                edges["::".join(mod) or "crate"].add("::".join(target) or "crate")
    return edges


def test_the_parser_sees_uses_and_paths():
    assert expand_use_tree("crate::a::{b, c::{d, e as f}}") == ["crate::a::b", "crate::a::c::d", "crate::a::c::e as f"]
    used, exports = uses_in(
        "use crate::a::{b, c::d as e};\npub use super::x::Y as Z;\n#[cfg(test)]\nmod tests { use crate::q; }"
    )
    assert used == ["crate::a::b", "crate::a::c::d"] and exports == {"Z": "super::x::Y"}
    mods = {(), ("a",), ("a", "b"), ("c",)}
    assert resolve("super::b::X", ("a", "c"), mods | {("a", "c")}) == ("a", "b")
    assert resolve("crate::a::b::f", ("c",), mods) == ("a", "b")
    assert resolve("std::mem", ("c",), mods) is None
    graph = rust_graph(CRATES["routepack-core"])
    assert "cost" in graph["simulate"] and "flow" in graph["simulate"]
    assert "placement::routepack::binpack::pack" in graph["placement::routepack::fresh"]  # through a re-export


def test_the_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_no_rust_module_circle():
    for crate, src in CRATES.items():
        assert cycles(rust_graph(src)) == [], f"import circle in {crate}"


#: The core's stage folders: algorithms only. The types they build and others read (the
#: plan's data model: `Plan`, `Placement`, `Replica`, `ExpertMove`) live outside them, in `plan`.
STAGES = ("placement", "packing", "layout", "replication")
#: Arrows from one stage into another's folder that call an algorithm (not a shared type):
#: routepack's packing runs the layout search on its certified rows.
STAGE_CALLS = {("packing::routepack", "layout")}


def test_no_module_reaches_into_a_stage_folder():
    """Only a stage's own modules use what is inside its folder: nothing outside the stage
    folders uses a stage's item, and a stage uses another's only where it calls its algorithm
    (`STAGE_CALLS`), never for a type."""
    graph = rust_graph(CRATES["routepack-core"])
    reaching = {
        (mod, target)
        for mod, targets in graph.items()
        for target in targets
        if target.split("::")[0] in STAGES and mod.split("::")[0] != target.split("::")[0]
    }
    allowed = {(m, t) for m, t in reaching if any(m == a and t.split("::")[0] == b for a, b in STAGE_CALLS)}
    assert reaching - allowed == set()
    assert allowed, "STAGE_CALLS names an arrow the tree no longer has"


def is_test_file(path: Path) -> bool:
    return path.name in ("tests.rs", "test_windows.rs") or "tests" in path.parts[len(ROOT.parts) :]


def test_no_source_file_over_the_limit():
    sources = [p for src in CRATES.values() for p in src.rglob("*.rs")]
    sources += list((ROOT / "python").rglob("*.py"))
    over = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if not is_test_file(p)
        for n in [len(p.read_text().splitlines())]
        if n > MAX_LINES
    }
    assert over == {}


#: What puts a folder on the import path of a test or of the process it starts.
IMPORT_PATH = re.compile(r"PYTHONPATH|sys\.path")


def test_tests_import_the_package_under_test():
    """Tests import the routepack that is installed (``pip install .``, or python/ on
    PYTHONPATH): none puts this tree's python/ folder on an import path itself, which would
    test the sources without their built extension under a non-editable install. A process a
    test starts gets the folder the package under test came from (``Path(rp.__file__)``)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "slime_reference" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if IMPORT_PATH.search(line) and re.search(r"""["']python["']""", line):
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert found == []


def test_test_modules_have_one_name_each():
    """pytest imports test modules by their base name (its default "prepend" import mode, the
    folders of tests/ having no ``__init__.py``), so two ``test_x.py`` in different folders
    collide at collection: the second is refused as an "import file mismatch" (a new
    ``tests/calibrate/test_replication.py`` beside ``tests/test_replication.py`` did once)."""
    seen: Dict[str, List[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "slime_reference" in path.parts or path.name in ("__init__.py", "conftest.py"):
            continue
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
