"""`routepack.calibrate.report`: the report's structure, its JSON and its figure."""

from __future__ import annotations

import json

import pytest

from routepack.calibrate.report import write_json
from synthetic import HAS_MPL, synthetic_fits, synthetic_report, check_report


def test_report_structure_and_json(tmp_path):
    rep = synthetic_report(synthetic_fits())
    check_report(rep)
    assert rep["preset"]["ratio"]["token_bytes"] == 1.0
    path = write_json(rep, tmp_path / "r.json")
    assert json.loads(path.read_text())["kernels"].keys() == rep["kernels"].keys()


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_the_figure_is_a_png(tmp_path):
    from routepack.calibrate.report import plot

    path = plot(synthetic_report(synthetic_fits()), tmp_path / "f.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
