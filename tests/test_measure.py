"""`routepack measure` (`routepack.measure`): a plan cut into its microbatches prices to the
plan's step; workload errors name the field; a small end-to-end run (2 gloo processes, a given
cost model, so nothing is calibrated) reports every figure for static and routepack, with the
predicted speed-up the simulator's. No assertion is on a measured time (the machine is shared)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import routepack as rp
from routepack.measure import Workload, format_table, micro_plan
from routepack.measure.workload import make_plans

HAS_TORCH = importlib.util.find_spec("torch") is not None
SMALL = Workload(layers=1, experts=8, top_k=2, hidden=32, ffn=32, slots_per_rank=5, samples=12, max_len=40, micro=2)


def cost_for(work: Workload) -> rp.CostModel:
    p = 3.0 * work.hidden * work.ffn
    return rp.CostModel(
        a_lin=0.0,
        a_quad=[0.0] * work.layers,
        c_tok=1e-6,
        c_exp=1e-4,
        token_bytes=4.0 * work.hidden,
        bw_intra=5e8,
        bw_inter=5e8,
        expert_weight_bytes=4 * p,
        expert_grad_bytes=4 * p,
        expert_state_bytes=16 * p,
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overlap", ["none", "dispatch_combine"])
def test_micro_plans_add_up_to_the_plan(seed, overlap):
    work = Workload(seed=seed, samples=30, micro=3)
    window, routed, cu = work.window()
    assert routed.shape == (window.total_tokens, work.layers, work.top_k) and cu[-1] == window.total_tokens
    cost = rp.CostModel(**{**cost_for(work).__dict__, "overlap": overlap})
    for name, plan in make_plans(work, window, cost, ("static", "routepack")).items():
        whole = rp.simulate(plan, window, work.topology(), cost)
        total = 0.0
        for m in range(plan.num_micro):
            sub, w = micro_plan(plan, window, m)
            sub.validate(w, work.topology(), work.token_cap(window))
            r = rp.simulate(sub, w, work.topology(), cost)
            # the once-per-step sum of redundant experts' gradients is the placement's: every
            # one-step sub-plan prices it, the whole plan once
            assert r.redundant_grads == whole.redundant_grads
            total += r.step_time - r.redundant_grads
        held = any(np.unique(row[row >= 0]).size < (row >= 0).sum() for row in plan.placement.phy2log)
        assert (whole.redundant_grads > 0) == held, name
        assert name == "routepack" or not held
        assert total + whole.redundant_grads == pytest.approx(whole.step_time, rel=1e-9), name


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"ranks": 0}, "workload.ranks"),
        ({"popularity": -1.0}, "workload.popularity"),
        ({"min_len": 50, "max_len": 10}, "workload.min_len"),
        ({"experts": 40}, "topo"),
    ],
)
def test_bad_workloads_name_the_field(kwargs, needle):
    with pytest.raises(rp.RoutepackError, match=needle):
        Workload(**kwargs)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_small_measured_run_reports_every_figure():
    from routepack.measure import measure, parts_table
    from routepack.measure.report import rank_mean_parts, rank_mean_table
    from routepack.parts import PARTS

    work = replace(SMALL, windows=2)
    res = measure(
        work,
        cost=cost_for(work),
        policies=["routepack", "eplb_oracle"],
        warmup=0,
        repeats=1,
        progress=False,
        join_timeout_s=300,
    )
    assert list(res.policies) == ["static", "routepack", "eplb_oracle"]
    for name, rec in res.policies.items():
        assert len(rec["windows"]) == 2
        for w in rec["windows"]:
            m = w["num_micro"]
            for key in ("micro_s", "predicted_micro_s", "wall_micro_s", "micro_rel_error", "parts", "predicted_terms"):
                assert len(w[key]) == m, key
            assert all(math.isfinite(v) and v > 0 for v in w["micro_s"]) and len(w["per_rank_micro_s"]) == work.ranks
            assert w["step_s"] == pytest.approx(w["migration_s"] + sum(w["micro_s"]) + w["finish_s"])
            # the predicted step is the microbatches' terms plus the window's migration
            terms = sum(sum(t.values()) for t in w["predicted_terms"])
            assert w["predicted_step_s"] == pytest.approx(terms + w["predicted_migration_s"], rel=1e-9)
            assert w["predicted_step_s"] == pytest.approx(sum(w["predicted_micro_s"]) + w["predicted_migration_s"])
            for parts in w["parts"]:
                assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
            # the parts are the microbatch cut up: their sum is its time (each the slowest rank's: >=)
            assert sum(w["parts"][0].values()) >= 0.5 * w["micro_s"][0]
        assert rec["step_s"] == pytest.approx(sum(w["step_s"] for w in rec["windows"]))
        assert set(rec["speedups"]) == set(res.policies) - {name}
    r = res.policies["routepack"]
    assert r["predicted_speedup"] == pytest.approx(res.policies["static"]["predicted_step_s"] / r["predicted_step_s"])
    assert r["speedups"]["eplb_oracle"]["measured"] == pytest.approx(
        res.policies["eplb_oracle"]["step_s"] / r["step_s"]
    )
    # the plans of the second window move what the first left where it is not wanted
    assert res.policies["static"]["windows"][1]["migration_rows"] == 0
    assert res.policies["eplb_oracle"]["windows"][0]["migration_rows"] > 0
    assert res.cost.a_lin == 0.0 and res.cost.token_bytes == 4.0 * work.hidden
    assert res.cost.bw_inter == res.cost.bw_intra
    # the microbatches' times line the ranks up at every collective (each its slowest rank's
    # segment), never less than the busiest rank's own total
    for rec in res.policies.values():
        for w in rec["windows"]:
            assert w["micro_clock"] == "lockstep"
            assert all(a >= b * (1 - 1e-9) for a, b in zip(w["micro_s"], w["busiest_rank_micro_s"]))
    lines = format_table(res)
    assert any(line.startswith("speed-up routepack over static") for line in lines)
    assert any(line.startswith("speed-up routepack over eplb_oracle") for line in lines)
    table = parts_table(res)
    assert table and any(line.startswith("  expert ") for line in table)
    assert any(line.startswith("redundant_grads") for line in table)
    # the parts averaged over the ranks: each rank's own medians, every part listed
    means = rank_mean_table(res)
    assert means[0].startswith("per-part work") and len(means) == 2 + len(PARTS) + 1
    rec = res.policies["routepack"]
    got = rank_mean_parts(rec)["expert"]
    want = sum(
        sum(m["expert"] for m in parts) / len(w["per_rank_parts"])
        for w in rec["windows"]
        for parts in w["per_rank_parts"]
    )
    assert got == pytest.approx(want) and got > 0
    # tokens per compute unit of every rank's cells: the plan's routed tokens, all of them
    for w in rec["windows"]:
        cells = w["per_rank_unit_tokens"]
        assert len(cells) == res.workload.ranks and all(len(c) == w["num_micro"] for c in cells)


def test_the_cli_lists_measure():
    r = subprocess.run(
        [sys.executable, "-m", "routepack", "measure", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **__import__("os").environ,
            "PYTHONPATH": str(__import__("pathlib").Path(rp.__file__).resolve().parent.parent),
        },
    )
    assert r.returncode == 0 and "--overlap" in r.stdout and "--cost" in r.stdout


# ------------------------------------------------------------------ the command line, every mode
SMALL_ARGS = [
    "--layers",
    "1",
    "--experts",
    "8",
    "--hidden",
    "32",
    "--ffn",
    "32",
    "--slots-per-rank",
    "5",
    "--samples",
    "12",
    "--micro",
    "2",
    "--warmup",
    "0",
    "--repeats",
    "1",
    "--quiet",
]


def cli(*args, cwd=None, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(Path(rp.__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "routepack", "measure", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def test_policies_are_repeated_or_comma_separated_and_checked():
    from routepack.measure.cli import policies

    assert policies(None) == ["static", "routepack"]
    assert policies(["routepack,eplb_oracle", "eplb"]) == ["routepack", "eplb_oracle", "eplb"]
    with pytest.raises(rp.RoutepackError, match="--policy: invalid choice 'eplb_orcale'"):
        policies(["routepack,eplb_orcale"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policy", "nope"], "--policy: invalid choice 'nope'"),
        (["--policy", "routepack,nope"], "--policy: invalid choice 'nope'"),
        (["--quick", "--cost", "c.json"], "--quick does not apply with --cost"),
        (["--cost", "c.json", "--calibration", "k.json"], "--cost and --calibration: give one"),
        (["--nodes", "3"], "workload.nodes: 3 does not divide ranks 2"),
        (["--cost", "missing.json"], "missing.json"),
        (["--calibration", "no/such/dir/k.json"], "calibration: directory no/such/dir does not exist"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, needle):
    r = cli(*SMALL_ARGS, *args, cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_calibration_of_other_shapes_is_refused(tmp_path):
    from routepack.measure.calibration import load_or_calibrate

    path = tmp_path / "k.json"
    doc = {
        "shapes": {"ranks": 2, "layers": 1, "experts": 8, "top_k": 2, "hidden": 64, "ffn": 32, "slots_per_rank": 5},
        "device": "cpu",
        "cost_model": cost_for(SMALL).__dict__,
        "calibration": {},
    }
    path.write_text(json.dumps(doc))
    with pytest.raises(rp.RoutepackError, match="measured with hidden=64, this run has hidden=32"):
        load_or_calibrate(path, SMALL, quick=True, progress=False)
    doc["shapes"]["hidden"] = 32
    path.write_text(json.dumps(doc))
    cost, summary, read = load_or_calibrate(path, SMALL, quick=True, progress=False)
    assert read and cost == cost_for(SMALL) and summary == {}
    with pytest.raises(rp.RoutepackError, match="measured on cpu, this run is on cuda"):
        load_or_calibrate(path, SMALL, quick=True, progress=False, device="cuda")
    path.write_text("{}")
    with pytest.raises(rp.RoutepackError, match="not a measured run's calibration"):
        load_or_calibrate(path, SMALL, quick=True, progress=False)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_every_mode_of_the_command_runs(tmp_path):
    """--quick calibrating into --calibration FILE, the same FILE read back by a run of two
    windows on four presets without the profile, a given --cost with --json: each exits 0 and
    prints what it promises."""
    cal = tmp_path / "cal.json"
    r = cli(*SMALL_ARGS, "--quick", "--calibration", str(cal), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "calibrated expert_gemm" in r.stdout and "per-part profile" in r.stdout
    assert "speed-up routepack over static" in r.stdout and cal.exists()
    first = json.loads(cal.read_text())
    r = cli(
        *SMALL_ARGS,
        "--calibration",
        str(cal),
        "--windows",
        "2",
        "--policy",
        "routepack,eplb_oracle",
        "--policy",
        "eplb",
        "--no-profile",
        "--json",
        "out.json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(cal.read_text()) == first  # read, not measured again
    assert "window 1:" in r.stdout and "speed-up routepack over eplb_oracle" in r.stdout
    assert "per-part profile" not in r.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    assert list(out["policies"]) == ["static", "routepack", "eplb_oracle", "eplb"]
    assert out["calibration"] == first["calibration"] and out["workload"]["windows"] == 2
    (tmp_path / "cost.json").write_text(json.dumps(cost_for(SMALL).__dict__))
    r = cli(*SMALL_ARGS, "--cost", "cost.json", "--nodes", "2", "--json", "given.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "given cost model" in r.stdout and "in 2 nodes" in r.stdout
    assert json.loads((tmp_path / "given.json").read_text())["calibration"] is None


def test_the_run_is_priced_as_it_runs():
    """float32 bytes, Adam's state with the weights (12 bytes a parameter), no attention, the
    "nodes" one machine's links, replication exposed in full on CPU (its CPU time counts the
    transfers) and hidden behind attention on CUDA (prefetched on its own stream)."""
    from routepack.measure.run import run_cost

    work = replace(SMALL, ranks=4, nodes=2)
    base = replace(cost_for(work), bw_inter=4e10, a_quad=[1e-9] * work.layers)
    got = run_cost(work, base, "none")
    params = 3 * work.hidden * work.ffn
    assert got.expert_state_bytes == 12 * params and got.expert_weight_bytes == 4 * params
    assert got.token_bytes == 4 * work.hidden and got.a_quad == [0.0] * work.layers
    assert got.bw_inter == got.bw_intra == base.bw_intra and got.num_experts == work.experts
    assert got.replica_prefetch is False and run_cost(work, base, "none", "cuda").replica_prefetch is True
    assert work.topology().gpus_per_node == 2
