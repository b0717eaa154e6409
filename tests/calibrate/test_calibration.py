"""`routepack.calibrate.calibration`: `calibrate`'s arguments, its CLI (``routepack calibrate``),
a real ``--quick`` run on CPU that writes a cost model `CostModel.load` reads, one kernel
measured alone, and `refit` of the committed report. No assertion is on a measured time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

import routepack as rp
from routepack.calibrate import ALL_KERNELS, KERNELS, refit
from routepack.calibrate.sweeps import Sweeps
from routepack.errors import RoutepackError
from synthetic import PYTHON_DIR, ROOT, HAS_TORCH, HAS_MPL, MODEL, check_report, run_cli


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(device="tpu"), "device: expected 'cpu' or 'cuda', got 'tpu'"),
        (dict(kernels=["softmax"]), "kernels: 'softmax' is not one of"),
        (dict(kernels=[]), "kernels: needs at least one"),
        (dict(hidden=0), "hidden: must be >= 1"),
        (dict(ranks=1), "ranks: must be >= 2"),
        (dict(bw_inter=-1.0), "bw_inter"),
        (dict(dtype="int8"), "dtype: expected one of"),
        (dict(links_clock="tsc"), "links_clock: expected 'wall'"),
        (dict(links_clock="cpu", device="cuda"), "links_clock: .* got 'cpu' on cuda"),
    ],
)
def test_bad_arguments_are_routepack_errors(kwargs, match):
    if kwargs.get("dtype") and not HAS_TORCH:
        pytest.skip("dtype is checked once torch is imported")
    with pytest.raises(rp.RoutepackError, match=match):
        rp.calibrate("tiny", quick=True, **kwargs)
    with pytest.raises(rp.RoutepackError, match="profile: unknown profile 'huge'"):
        rp.calibrate("huge")


def test_exported_and_torch_free_until_called():
    assert "calibrate" in rp.__all__ and "Calibration" in rp.__all__
    code = (
        "import sys; sys.modules['torch'] = None; import routepack as rp\n"
        "try:\n rp.calibrate('tiny', quick=True)\nexcept ImportError as e:\n print(e)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=PYTHON_DIR),
    )
    assert "routepack.calibrate needs PyTorch >= 2.1: pip install 'routepack[torch]'" in r.stdout, r.stderr


def test_cli_without_torch_is_one_line(tmp_path):
    proc = run_cli(["calibrate", "--quick"], tmp_path, hide_torch=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "routepack calibrate: error: routepack.calibrate needs PyTorch >= 2.1: pip install 'routepack[torch]'"
    ]


def test_cli_refuses_an_unwritable_out_before_measuring(tmp_path):
    proc = run_cli(["calibrate", "--quick", "--out", "no/such/dir/c.json"], tmp_path)
    assert proc.returncode == 2 and "--out no/such/dir/c.json: directory" in proc.stderr, proc.stderr


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_quick_cpu_run_writes_a_loadable_cost_model(tmp_path):
    """``routepack calibrate --quick`` with tiny shapes, as a user runs it (about 15 s here)."""
    proc = run_cli(
        [
            "calibrate",
            "--profile",
            "tiny",
            "--quick",
            "--hidden",
            "128",
            "--expert-ffn",
            "64",
            "--threads",
            "1",
            "--out",
            "cost.json",
            "--report",
            "report.json",
            "--plot",
            "fit.png",
            "--quiet",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for text in ("expert_gemm", "attention", "links", "max rel. error (held out)", "bw_inter: preset h200"):
        assert text in proc.stdout, text
    cost = rp.CostModel.load(tmp_path / "cost.json")
    rep = json.loads((tmp_path / "report.json").read_text())
    check_report(rep)
    assert rep["model"]["hidden"] == 128 and rep["device"]["threads"] == 1 and rep["device"]["torch"]
    assert rp.CostModel.from_json(json.dumps(rep["cost_model"])) == cost
    assert cost.c_tok == rep["kernels"]["expert_gemm"]["coefficients"]["c_tok"]
    assert cost.bw_intra == rep["kernels"]["links"]["coefficients"]["bw_all_to_all"]
    assert cost.bw_reduce == rep["kernels"]["links"]["coefficients"]["bw_all_reduce"]  # two ranks: the whole buffer
    assert cost.num_layers == MODEL.num_layers
    if HAS_MPL:
        assert (tmp_path / "fit.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_api_run_of_one_kernel_keeps_the_rest_from_the_preset():
    sweeps = Sweeps(
        tokens_per_expert=(1, 4, 16, 64),
        active_experts=(1, 2),
        max_tokens=128,
        lengths=(8, 16),
        message_bytes=(4096,),
        warmup=0,
        repeats=1,
    )
    cal = rp.calibrate("tiny", hidden=64, expert_ffn=32, sweeps=sweeps, kernels=["expert_gemm"], progress=False)
    preset = rp.CostModel.from_model(replace(MODEL, hidden=64, expert_ffn=32), rp.Hardware.h200())
    assert set(cal.report["kernels"]) == {"expert_gemm"}
    assert cal.cost.a_lin == preset.a_lin and cal.cost.bw_intra == preset.bw_intra
    assert cal.report["skipped"]["links"] == "not requested"
    assert cal.report["sources"]["c_tok"] == "measured: expert_gemm"


def test_the_exchange_is_measured_on_request_only():
    assert "exchange" not in KERNELS and ALL_KERNELS == KERNELS + ("exchange", "migration", "replication")
    with pytest.raises(RoutepackError, match=r"sweeps\.exchange_tokens"):
        Sweeps(
            tokens_per_expert=(1,),
            active_experts=(1,),
            max_tokens=4,
            lengths=(8,),
            message_bytes=(64,),
            exchange_tokens=(16, 4),
        )
    assert Sweeps.default("cpu", quick=True).exchange_tokens == (4, 16, 64, 256)
    with pytest.raises(RoutepackError, match="kernels: 'exchanges'"):
        rp.calibrate("tiny", kernels=["exchanges"], progress=False)


def test_refit_reproduces_the_committed_report():
    report = json.loads((ROOT / "docs" / "calibrate_tiny_cpu.json").read_text())
    cal = refit(report)
    for kind, k in report["kernels"].items():
        assert cal.report["kernels"][kind]["predicted_s"] == pytest.approx(k["predicted_s"], rel=1e-9)
        assert cal.report["kernels"][kind]["max_rel_error"] == pytest.approx(k["max_rel_error"], rel=1e-9)
    assert rp.CostModel.from_json(cal.cost.to_json()) == cal.cost
    with pytest.raises(rp.RoutepackError, match="report"):
        refit({"kernels": []})


def test_the_committed_calibration_loads_with_the_documented_loader(tmp_path):
    """`CostModel.load` reads a ``--report`` file as the cost model it holds (the committed
    docs/calibrate_tiny_cpu.json is one), as well as the ``--out`` file; anything else that is
    JSON is still refused naming the path."""
    path = ROOT / "docs" / "calibrate_tiny_cpu.json"
    report = json.loads(path.read_text())
    cost = rp.CostModel.load(path)
    assert cost == rp.CostModel.from_json(json.dumps(report["cost_model"]))
    assert cost.expert_table and cost.c_call > 0  # the calibrated fields, not a preset's
    out = tmp_path / "cost.json"
    cost.save(out)
    assert rp.CostModel.load(out) == cost
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cost_model": {"a_lin": 1.0}, "kernels": {}}))
    with pytest.raises(rp.RoutepackError, match=r"cost file '.*bad.json': cost JSON: unknown keys \[\], missing"):
        rp.CostModel.load(bad)
    bad.write_text(json.dumps({"cost_model": report["cost_model"]}))  # not a report: no kernels
    with pytest.raises(rp.RoutepackError, match="unknown keys \\['cost_model'\\]"):
        rp.CostModel.load(bad)
