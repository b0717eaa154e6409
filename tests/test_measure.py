"""`routepack measure` (`routepack.measure`): a plan cut into its microbatches prices to the
plan's step; workload errors name the field; a small end-to-end run (2 gloo processes, a given
cost model, so nothing is calibrated) reports every figure for static and routepack, with the
predicted speed-up the simulator's. No assertion is on a measured time (the machine is shared)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

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
        assert (whole.redundant_grads > 0) == (name == "routepack"), name
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
    from routepack.measure import measure

    res = measure(SMALL, cost=cost_for(SMALL), warmup=0, repeats=1, progress=False, join_timeout_s=300)
    assert list(res.policies) == ["static", "routepack"]
    window, _, _ = SMALL.window()
    for name, rec in res.policies.items():
        m = rec["num_micro"]
        for key in ("micro_s", "predicted_micro_s", "wall_micro_s", "micro_rel_error"):
            assert len(rec[key]) == m and all(math.isfinite(v) for v in rec[key]), key
        assert all(v > 0 for v in rec["micro_s"]) and len(rec["per_rank_micro_s"]) == SMALL.ranks
        assert rec["step_s"] == pytest.approx(sum(rec["micro_s"]) + rec["finish_s"])
        assert rec["predicted_step_s"] == pytest.approx(sum(rec["predicted_micro_s"]), rel=1e-9)
    r = res.policies["routepack"]
    assert r["predicted_speedup"] == pytest.approx(res.policies["static"]["predicted_step_s"] / r["predicted_step_s"])
    assert res.cost.a_lin == 0.0 and res.cost.token_bytes == 4.0 * SMALL.hidden
    lines = format_table(res)
    assert any(line.startswith("speed-up routepack over static") for line in lines)


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
