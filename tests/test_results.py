"""`routepack.results`: the pages a run's JSON renders to (every committed page is checked
against its JSON by tests/test_docs.py; these cover what no committed page does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from routepack import results
from routepack.errors import RoutepackError

ROOT = Path(__file__).resolve().parent.parent


def test_scale_runs_write_json_that_renders(tmp_path):
    out = tmp_path / "scale.json"
    bench = ROOT / "benches" / "scale.py"
    args = [sys.executable, str(bench), "--sizes", "tiny", "--no-baseline", "--out", str(out)]
    subprocess.run(args, capture_output=True, text=True, check=True, cwd=tmp_path, timeout=600)
    data = json.loads(out.read_text())
    assert data["command"].startswith("python benches/scale.py --sizes tiny") and len(data["rows"]) == 1
    page = results.render("scale", [str(out)], tmp_path / "scale.md")
    assert page.splitlines()[1].startswith("python -m routepack.results scale ")
    assert "| `tiny` | " in page and "(scale.json)" in page


def test_render_refuses_what_it_cannot_render(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"profile": "tiny"}))
    with pytest.raises(RoutepackError, match="kind"):
        results.render("nope", [str(good)], tmp_path / "p.md")
    with pytest.raises(RoutepackError, match="one JSON file"):
        results.render("bench", [str(good), str(good)], tmp_path / "p.md")
    with pytest.raises(RoutepackError, match="pairs"):
        results.render("overlap", [str(good)], tmp_path / "p.md")
    with pytest.raises(RoutepackError, match="not a readable results JSON"):
        results.render("bench", [str(tmp_path / "missing.json")], tmp_path / "p.md")


def test_the_module_is_a_command(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert results.main(["bench", str(bad), "--out", str(tmp_path / "p.md")]) == 2  # no summary: one line
    assert not (tmp_path / "p.md").exists()
