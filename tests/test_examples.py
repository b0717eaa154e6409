"""Every script in examples/ runs as a user runs it (``python examples/x.py``, a fresh
process, from a folder outside the tree, this checkout's package first on the path) and
prints what it promises; every one answers ``--help`` without starting its work; none imports
anything of the tree but the package (a user has the example, not the tests). A script
needing a framework that is not installed is skipped, naming it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import routepack as rp

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: What each example must print (its last check passed), and the modules it needs.
EXPECT = {
    "verl_balance.py": ("microbatches per DP rank", ()),
    "slime_schedule.py": ("microbatches per rank per step", ()),
    "megatron_router.py": ("physical layout computes the logical MoE: ok", ("torch",)),
    "verl_ppo.py": ("  schedule: ran in 8 of 8 mini-batch passes", ("verl.trainer.ppo.ray_trainer", "torchdata")),
    "slime_train.py": ("  schedule: ran (every rank's microbatches are the plans' cells", ()),
    "megatron_train.py": ("the plan's model trains like the stock one: ok", ("torch", "megatron.core")),
}
#: Examples with a test of their own (they spawn processes; run there at smaller sizes).
OWN_TEST = {"hf_train.py": "tests/test_example_hf_train.py"}
#: Examples that need CUDA GPUs: on a machine without one, their test runs them with Megatron's
#: CUDA-only calls stood in (tests/megatron_cpu.py, installed in every process by a
#: sitecustomize the test writes), as every Megatron test of this tree runs.
CUDA_STANDINS = {"megatron_train.py"}


def _env(extra_path: str = "") -> dict:
    path = [p for p in (extra_path, PYTHON_DIR, os.environ.get("PYTHONPATH", "")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _standins(tmp_path: Path) -> str:
    """A folder whose sitecustomize applies tests/megatron_cpu.py's stand-ins in every Python
    process started with it on the path (the example's ranks are spawned processes)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport megatron_cpu\nmegatron_cpu.install(optimizers=True)\n"
    )
    return str(site)


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES) == sorted([*EXPECT, *OWN_TEST])
    for test in OWN_TEST.values():
        assert (ROOT / test).is_file(), test


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_imports_only_the_package(path: Path):
    """No sys.path edits and no imports of the tree's other folders (tests/, tools/, benches/)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = {p.stem for folder in ("tests", "tools", "benches") for p in (ROOT / folder).glob("*.py")}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        assert not set(names) & local, f"{path.name}:{node.lineno} imports {names} from the tree"
    assert "sys.path" not in path.read_text(encoding="utf-8"), f"{path.name} edits sys.path"


def _top_level_imports(path: Path) -> set:
    """The root packages the script imports before ``main`` runs (its module body)."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_answers_help(path: Path, tmp_path: Path):
    for module in sorted(_top_level_imports(path) & {"torch", "transformers"}):  # the optional ones
        pytest.importorskip(module, reason=f"{path.name} imports {module} to start")
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:500]
    first = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))).splitlines()[0]
    assert " ".join(first.split()[:4]) in " ".join(proc.stdout.split()), proc.stdout[:500]
    assert list(tmp_path.iterdir()) == []  # it did not start its work


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if p.name not in OWN_TEST], ids=[p.name for p in EXAMPLES if p.name not in OWN_TEST]
)
def test_example_runs(path: Path, tmp_path: Path):
    expected, needs = EXPECT[path.name]
    for module in needs:
        pytest.importorskip(module, reason=f"{path.name} needs {module}")
    site = ""
    if path.name in CUDA_STANDINS:
        import torch

        site = "" if torch.cuda.is_available() else _standins(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=work, env=_env(site), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-2000:]


def test_the_megatron_example_refuses_a_machine_without_cuda(tmp_path: Path):
    """Without CUDA and without the stand-ins the example stops at once, saying why (instead of
    failing deep inside Megatron)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core", reason="megatron_train.py needs megatron.core")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "megatron_train.py")],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Megatron-Core needs a CUDA GPU a rank, and none is available" in proc.stderr, proc.stderr[-2000:]
