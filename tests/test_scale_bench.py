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


def test_the_bench_writes_the_page_docs_bench_scale_md_is(tmp_path):
    """docs/bench_scale.md is written by the bench (``--out`` JSON, ``--page`` its page): a
    fresh run at the smallest size writes the page `routepack.results` renders from its JSON,
    with the committed page's header, title and table columns (test_docs checks the committed
    page is its JSON's rendering)."""
    from routepack import results

    out, page = tmp_path / "scale.json", tmp_path / "scale.md"
    subprocess.run(
        [sys.executable, str(BENCH), "--sizes", "tiny", "--no-baseline", "--out", str(out), "--page", str(page)]
        + ["--note", "a note"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = page.read_text(encoding="utf-8")
    assert text == results.render("scale", [str(out)], page, notes=["a note"])
    committed = (BENCH.parents[1] / "docs" / "bench_scale.md").read_text(encoding="utf-8").splitlines()
    fresh = text.splitlines()
    assert fresh[0] == committed[0] == "<!-- generated: do not edit by hand; this command writes it again:"
    assert committed[1].startswith("python -m routepack.results scale docs/bench_scale.json ")
    assert committed[1].endswith(" --out docs/bench_scale.md")
    assert fresh[3] == committed[3]  # the title
    header = next(line for line in fresh if line.startswith("| size |"))
    assert header in committed
    command = next(line for line in committed if line.startswith("- Command: "))
    assert command.startswith("- Command: `python benches/scale.py ") and "--page docs/bench_scale.md" in command
    assert "| `tiny` | 1,024 |" in text and "- a note" in text
