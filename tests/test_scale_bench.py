"""benches/scale.py: its rows hold every stage, and the plans it measures are the same bytes on
one and two threads (RAYON_NUM_THREADS; each size runs in its own subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benches" / "scale.py"


def rows(threads: int) -> list:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, str(BENCH), "--sizes", "tiny", "--no-baseline", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_rows_hold_every_stage_and_the_same_plan_on_one_and_two_threads():
    one, two = rows(1), rows(2)
    assert len(one) == len(two) == 1
    r = one[0]
    for key in ("wall", "cpu", "placement", "rows", "layout", "replication", "simulate", "rest", "rss_gb", "step_time"):
        assert r[key] >= 0, key
    assert set(r["cpu_stages"]) == {"placement", "packing", "replication", "simulate"}
    assert r["replicas"] > 0  # replication ran and planned copies
    assert (r["digest"], r["step_time"]) == (two[0]["digest"], two[0]["step_time"])
