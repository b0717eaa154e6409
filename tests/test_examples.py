"""Every script in examples/ runs as a user runs it (``python examples/x.py``, a fresh
process, this checkout's package first on the path) and prints what it promises. A script
needing a framework that is not installed is skipped, naming it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import routepack as rp

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: What each example must print (its last check passed), and the modules it needs.
EXPECT = {
    "verl_balance.py": ("microbatches per DP rank", ()),
    "slime_schedule.py": ("microbatches per rank per step", ()),
    "megatron_router.py": ("physical layout computes the logical MoE: ok", ("torch",)),
    "verl_ppo.py": ("  schedule: ran in 8 of 8 mini-batch passes", ("verl", "torchdata")),
    "slime_train.py": ("  schedule: ran (every rank's microbatches are the plans' cells", ()),
    "megatron_train.py": ("the plan's model trains like the stock one: ok", ("torch", "megatron.core")),
}
#: Examples with a test of their own (they spawn processes; run there at smaller sizes).
OWN_TEST = {"hf_train.py": "tests/test_example_hf_train.py"}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES) == sorted([*EXPECT, *OWN_TEST])
    for test in OWN_TEST.values():
        assert (ROOT / test).is_file(), test


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if p.name not in OWN_TEST], ids=[p.name for p in EXAMPLES if p.name not in OWN_TEST]
)
def test_example_runs(path: Path, tmp_path: Path):
    expected, needs = EXPECT[path.name]
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.name} needs {module}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PYTHON_DIR, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-2000:]
