"""examples/hf_train.py (issue 16, item 3) runs as a newcomer runs it, a script in its own
process (small sizes): per step it prints the loss of the 4 gloo ranks training
expert-parallel next to the single-process loss, equal to 1e-5 relative, over 3 windows
whose plans moved and copied experts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import routepack as rp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: The folder the routepack under test was imported from (the installed package's, or python/
#: of this tree under PYTHONPATH): the example's process imports the same one.
PACKAGE_PARENT = str(Path(rp.__file__).resolve().parent.parent)
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$")


def test_the_example_trains_like_one_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_train.py"), "--windows", "3", "--samples", "12"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert [int(r[0]) for r in rows] == [0, 1, 2], proc.stdout
    for step, micro, moved, replicas, sharded, single in rows:
        assert int(micro) >= 1
        assert abs(float(sharded) - float(single)) <= 1e-5 * abs(float(single)), (step, sharded, single)
    assert sum(int(r[2]) for r in rows) > 0, "no plan moved an expert"
    assert sum(int(r[3]) for r in rows) > 0, "no plan copied an expert"
    assert "max relative loss difference" in proc.stdout
