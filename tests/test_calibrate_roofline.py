"""The roofline expert fit (`routepack.calibrate.fit.fit_expert_gemm`): on timings made from
``3·active·(c_exp + max(c_tok·t, c_weights))`` it recovers the knee and the coefficients; the
fitted ``c_weights`` prices in `simulate` what the fit predicts; `refit` reproduces a report
from its own measurements; and ``tools/gpu_check.py --cost-only --device cpu`` (its dry form)
runs calibrate and writes a loadable cost model. No assertion is on a measured time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate import refit
from routepack.calibrate.fit import COMPUTE_PASSES, _knees, fit_expert_gemm
from routepack.calibrate.sweeps import Sweeps

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)
MODEL = rp.traces.profile("tiny").model()
SWEEPS = Sweeps.default("cpu")


def roofline_measurement(c_tok: float, c_exp: float, knee: float) -> dict:
    sweep = [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in SWEEPS.expert_grid()]
    true = [COMPUTE_PASSES * p["active_experts"] * (c_exp + c_tok * max(p["tokens_per_expert"], knee)) for p in sweep]
    return {"sweep": sweep, "measured_s": true, "forward_s": [m / 3 for m in true]}


@settings(max_examples=40, deadline=None)
@given(c_tok=st.floats(1e-9, 1e-3), c_exp=st.one_of(st.just(0.0), st.floats(1e-8, 1e-2)),
       i=st.integers(8, 80))
def test_the_fit_recovers_a_knee_on_its_grid(c_tok, c_exp, i):
    knee = float(_knees(np.array([4096.0]))[i])
    # the floor must show in the timings: below the knee it is c_tok·knee of c_exp + c_tok·knee
    assume(c_tok * knee >= 0.05 * c_exp)
    fit = fit_expert_gemm(roofline_measurement(c_tok, c_exp, knee), 3, MODEL)
    assert fit.coefficients["knee_tokens_per_expert"] == pytest.approx(knee, rel=1e-9)
    assert fit.coefficients["c_tok"] == pytest.approx(c_tok, rel=1e-6)
    assert fit.coefficients["c_exp"] == pytest.approx(c_exp, rel=1e-6, abs=1e-9 * c_tok)
    assert fit.cost_fields["c_weights"] == pytest.approx(c_tok * knee, rel=1e-6)
    assert fit.max_rel_error < 1e-6


def test_the_fitted_floor_is_what_simulate_charges():
    """One rank, one expert with t tokens: simulate's expert part is the fit's prediction."""
    fit = fit_expert_gemm(roofline_measurement(2e-6, 1e-4, 64.0), 3, MODEL)
    topo = rp.Topology(1, 1, 1, 1)
    cost = rp.CostModel(a_lin=0.0, a_quad=[0.0], c_tok=fit.coefficients["c_tok"], c_exp=fit.coefficients["c_exp"],
                        token_bytes=0.0, bw_intra=1.0, bw_inter=1.0, expert_weight_bytes=0.0, expert_grad_bytes=0.0,
                        expert_state_bytes=0.0, c_weights=fit.cost_fields["c_weights"])
    for t in (1, 10, 64, 100, 1000):
        w = rp.Window(np.array([t]), np.array([[[t]]], dtype=np.int32))
        plan = rp.plan_window(w, topo, cost, token_cap=t, policy="static")
        plan.validate(w, topo, t)
        want = COMPUTE_PASSES * (cost.c_exp + max(cost.c_tok * t, cost.c_weights))
        assert rp.simulate(plan, w, topo, cost).expert == pytest.approx(want, rel=1e-12)


def test_refit_reproduces_the_committed_report():
    report = json.loads((ROOT / "docs" / "calibrate_tiny_cpu.json").read_text())
    cal = refit(report)
    for kind, k in report["kernels"].items():
        assert cal.report["kernels"][kind]["predicted_s"] == pytest.approx(k["predicted_s"], rel=1e-9)
        assert cal.report["kernels"][kind]["max_rel_error"] == pytest.approx(k["max_rel_error"], rel=1e-9)
    assert rp.CostModel.from_json(cal.cost.to_json()) == cal.cost
    with pytest.raises(rp.RoutepackError, match="report"):
        refit({"kernels": []})


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cost-only", "--device", "cpu",
                        "--quick", "--profile", "tiny", "--hidden", "32", "--expert-ffn", "16", "--no-measure",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "expert_gemm: held-out max_rel_error" in r.stdout and "PASS" in r.stdout
    cost = rp.CostModel.load(tmp_path / "cost.json")
    assert cost.c_tok > 0 and json.loads((tmp_path / "calibration.json").read_text())["kernels"]
