"""The layering of `routepack.integrations`, checked on the import graph (tests/test_import_graph.py's,
lazy imports inside functions included, plus ``importlib.import_module`` of a literal name):

* every module of ``routepack.integrations`` lives in one package per framework: the execution
  backends ``megatron`` and ``hf``, the trainers ``verl`` and ``slime``, and ``shared``, what
  they share (the one exception: ``hf_shard``, the public path kept for ``hf.sharding``);
* a trainer may import a backend and ``shared``, never another trainer;
* a backend never imports a trainer nor another backend;
* ``shared`` imports no trainer and no backend, but for `NAMED`: lookups by name that this
  test lists with their reason, so that a new one is a decision someone wrote down.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from test_import_graph import graph, tree_modules

PREFIX = "routepack.integrations."
BACKENDS = {"megatron", "hf"}
TRAINERS = {"verl", "slime"}
SHARED = "shared"
#: modules of ``routepack.integrations`` outside the folders, and the folder each serves
PUBLIC_PATHS = {"routepack.integrations.hf_shard": "hf"}
#: (module, module it names by a string) allowed across the rule, and why
NAMED = {
    ("routepack.integrations.shared.trainer", "routepack.integrations.megatron"): (
        "backend_runs reads the Megatron backend's EXECUTES declaration (what its execution carries out) "
        "when a trainer asks; the declaration is the backend's, monkeypatched there by tests"
    ),
}


def folder_of(module: str) -> Optional[str]:
    """The integration package ``module`` belongs to (None: not below routepack.integrations)."""
    if module in PUBLIC_PATHS:
        return PUBLIC_PATHS[module]
    if not module.startswith(PREFIX):
        return None
    return module[len(PREFIX) :].split(".")[0]


def named_imports(path: Path, known: Set[str]) -> Set[str]:
    """The modules of ``known`` that ``path`` imports by ``importlib.import_module("<literal>")``."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value in known
        ):
            out.add(node.args[0].value)
    return out


def violations(edges: Dict[str, Set[str]], named: Dict[str, Set[str]]) -> List[Tuple[str, str, str]]:
    """(module, imported module, rule broken) for every import across the layering."""
    found = []
    for mod in sorted(edges):
        src = folder_of(mod)
        if src is None or mod == "routepack.integrations":
            continue
        for dst_mod in sorted(edges[mod] | named.get(mod, set())):
            dst = folder_of(dst_mod)
            if dst is None or dst == src or dst_mod == "routepack.integrations":
                continue
            if (mod, dst_mod) in NAMED and dst_mod in named.get(mod, set()) and dst_mod not in edges[mod]:
                continue
            if src in TRAINERS and dst in TRAINERS:
                found.append((mod, dst_mod, "a trainer imports another trainer"))
            elif src in BACKENDS and dst in TRAINERS:
                found.append((mod, dst_mod, "a backend imports a trainer"))
            elif src in BACKENDS and dst in BACKENDS:
                found.append((mod, dst_mod, "a backend imports another backend"))
            elif src == SHARED and dst != SHARED:
                found.append((mod, dst_mod, "shared imports a trainer or backend"))
    return found


def package_graph() -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    mods = tree_modules()
    known = set(mods)
    package = {m: p for m, p in mods.items() if m.startswith(PREFIX)}
    return graph(), {m: named_imports(p, known) for m, p in package.items()}


def test_every_integration_module_is_in_its_folder():
    edges, _ = package_graph()
    folders = BACKENDS | TRAINERS | {SHARED}
    loose = [m for m in edges if m.startswith(PREFIX) and m not in PUBLIC_PATHS and folder_of(m) not in folders]
    assert loose == []
    for folder in folders:  # each folder is a package of its own, with modules in it
        assert PREFIX + folder in edges
        assert any(m.startswith(PREFIX + folder + ".") for m in edges), folder


def test_the_integrations_keep_their_layering():
    edges, named = package_graph()
    assert violations(edges, named) == []


def test_the_named_lookups_are_still_there():
    """An entry of `NAMED` whose lookup went away is removed from the list, not kept as a licence."""
    _, named = package_graph()
    assert all(dst in named.get(src, set()) for src, dst in NAMED)


def test_the_graph_sees_the_integrations():
    """The rule reads real edges: trainers reach the Megatron backend and the shared package."""
    edges, named = package_graph()
    assert "routepack.integrations.megatron.handoff" in edges["routepack.integrations.verl.plans"]
    assert "routepack.integrations.megatron.handoff" in edges["routepack.integrations.slime.actor"]
    assert "routepack.integrations.shared.trainer" in edges["routepack.integrations.slime"]
    assert "routepack.integrations.shared.arrays" in edges["routepack.integrations.megatron.slots"]
    assert "routepack.integrations.megatron" in named["routepack.integrations.shared.trainer"]


def test_the_check_finds_each_broken_rule():
    edges = {
        "routepack.integrations.verl.hooks": {"routepack.integrations.slime.actor", "routepack.integrations.megatron"},
        "routepack.integrations.megatron.runner": {"routepack.integrations.verl.plans"},
        "routepack.integrations.hf.sharding": {"routepack.integrations.megatron.layer"},
        "routepack.integrations.shared.layout": {"routepack.integrations.hf.families"},
        "routepack.integrations.shared.trainer": set(),
    }
    named = {"routepack.integrations.shared.trainer": {"routepack.integrations.verl"}}
    assert [(a, b) for a, b, _ in violations(edges, named)] == [
        ("routepack.integrations.hf.sharding", "routepack.integrations.megatron.layer"),
        ("routepack.integrations.megatron.runner", "routepack.integrations.verl.plans"),
        ("routepack.integrations.shared.layout", "routepack.integrations.hf.families"),
        ("routepack.integrations.shared.trainer", "routepack.integrations.verl"),
        ("routepack.integrations.verl.hooks", "routepack.integrations.slime.actor"),
    ]
