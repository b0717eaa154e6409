"""``tools/gpu_check.py`` from a clone: its CPU dry run (``--cost-only --device cpu``) runs
calibrate and writes a loadable cost model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import routepack as rp

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_check.py"),
            "--cost-only",
            "--device",
            "cpu",
            "--quick",
            "--profile",
            "tiny",
            "--hidden",
            "32",
            "--expert-ffn",
            "16",
            "--no-measure",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "expert_gemm: held-out max_rel_error" in r.stdout and "PASS" in r.stdout
    cost = rp.CostModel.load(tmp_path / "cost.json")
    assert cost.c_tok > 0 and json.loads((tmp_path / "calibration.json").read_text())["kernels"]
