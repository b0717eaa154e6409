"""`routepack calibrate` and `routepack measure` end with one verdict
(`routepack.verdict`, wrapped at 100 columns as the rest of their output): the fit against `FIT_THRESHOLD`, the plan's measured speed-up and how
well it was predicted against `PREDICTION_THRESHOLD`; either verdict exits 0. The commands run
with their work function replaced by the committed reports (tests/test_cli_options.py's fakes)."""

from __future__ import annotations

import pytest

from routepack.verdict import FIT_THRESHOLD, PREDICTION_THRESHOLD, fit_verdict, measure_verdict
from test_cli_options import fake_calibrate, fake_measure, run  # noqa: F401 (fixtures)


def test_fit_verdict():
    assert "good enough to plan with" in fit_verdict({"a": 0.1, "b": None, "c": 0.2})
    assert "worst c 20.0%" in fit_verdict({"a": 0.1, "c": 0.2})
    bad = fit_verdict({"a": 0.1, "links": 1.48, "x": FIT_THRESHOLD + 0.01})
    assert "NOT good enough" in bad and "links 148.0%, x 26.0%" in bad and "a 10" not in bad
    assert "nothing tells" in fit_verdict({"a": None})


def test_measure_verdict():
    pol = {"static": {"speedups": {}}, "routepack": {"speedups": {"static": {"measured": 1.047, "predicted": 1.123}}}}
    line = measure_verdict(pol)
    assert line.startswith("verdict: routepack paid off here: 1.047x static measured, 1.123x predicted (+7.3%: within")
    pol["routepack"]["speedups"]["static"] = {"measured": 0.99, "predicted": 1.08}
    line = measure_verdict(pol, {"links": {"max_rel_error": 1.48}})
    assert "did NOT pay off" in line and f"outside {PREDICTION_THRESHOLD:.0%}" not in line  # +9.1%: within
    assert "links 148.0%" in line
    assert "only static ran" in measure_verdict({"static": {"speedups": {}}})


@pytest.mark.usefixtures("fake_calibrate")
def test_calibrate_ends_with_its_verdict(capsys, tmp_path):
    got = run(capsys, ["calibrate", "--out", str(tmp_path / "c.json"), "--report", "", "--plot", ""])
    assert got["rc"] == 0, got["err"]
    # the last paragraph (wrapped at 100 columns as every line of the command's)
    text = " ".join(line.strip() for line in got["out"].strip().splitlines())
    last = text[text.rindex("verdict: ") :]
    # the committed tiny CPU calibration: links held out at 71.6%
    assert last.startswith("verdict: the fit is NOT good enough to plan with: links 71.6%"), last
    assert got["err"] == ""


@pytest.mark.usefixtures("fake_measure")
def test_measure_ends_with_its_verdict(capsys):
    got = run(capsys, ["measure", "--quiet"])
    assert got["rc"] == 0, got["err"]
    text = " ".join(line.strip() for line in got["out"].strip().splitlines())
    verdict = text[text.rindex("verdict: ") :]
    # the committed CPU measurement: 0.908x measured against 1.044x predicted
    assert verdict.startswith("verdict: routepack did NOT pay off here: 0.908x static measured, 1.044x predicted")
    assert "(+15.0%: outside 10%)" in verdict and "links 89.2%" in verdict
