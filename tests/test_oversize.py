"""Samples longer than the token cap (docs/design.md, "Samples over the cap"): refused by default
with an error that names the sample and the ways out; ``oversize="alone"`` runs each in a
microbatch of its own under every preset, with and without a pipeline; the plans validate, the
over-cap samples sit alone, and routepack's row certificate stays true."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import routepack as rp

CAP = 400


def window_with_long_samples(seed: int = 0, samples: int = 200, share: float = 0.05, layers: int = 4, experts: int = 8):
    """``samples`` samples within the cap but ``share`` of them, which are 1.2-3x the cap."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(20, CAP // 2, size=samples)
    over = rng.choice(samples, size=int(round(share * samples)), replace=False)
    lens[over] = rng.integers(int(1.2 * CAP), 3 * CAP, size=len(over))
    counts = np.zeros((samples, layers, experts), dtype=np.int64)
    for s, n in enumerate(lens):
        for l in range(layers):
            counts[s, l] = rng.multinomial(2 * n, rng.dirichlet(np.ones(experts) * 0.5))
    counts = np.minimum(counts, lens[:, None, None])
    return rp.Window(lens, counts), np.sort(over)


def cost_for(layers: int) -> rp.CostModel:
    return rp.CostModel(
        a_lin=1e-6,
        a_quad=[1e-9 if l % 2 else 0.0 for l in range(layers)],
        c_tok=2e-6,
        c_exp=1e-4,
        token_bytes=8192.0,
        bw_intra=2e11,
        bw_inter=2.5e10,
        expert_weight_bytes=3e7,
        expert_grad_bytes=6e7,
        expert_state_bytes=2e8,
    )


def test_refused_by_default_naming_the_sample_and_the_option():
    window, over = window_with_long_samples()
    with pytest.raises(rp.InfeasibleError) as e:
        rp.plan_window(window, rp.Topology(4, 2, 2, 4), cost_for(4), token_cap=CAP)
    msg = str(e.value)
    assert f"sample {over[0]} has {window.seq_lens[over[0]]} tokens" in msg
    assert 'oversize="alone"' in msg and 'oversize="split"' in msg  # both ways out
    with pytest.raises(rp.RoutepackError, match="oversize"):
        rp.plan_window(window, rp.Topology(4, 2, 2, 4), cost_for(4), token_cap=CAP, oversize="sideways")


@pytest.mark.parametrize("pipeline", [dict(), dict(pp=2), dict(pp=2, vpp=2)])
@pytest.mark.parametrize("policy", ["routepack", "static", "eplb_oracle", "hot_n", "relibra"])
def test_alone_plans_under_every_preset(policy, pipeline):
    window, over = window_with_long_samples(seed=len(policy))
    topo = rp.Topology(4, 2, 2, 4, **pipeline)
    plan = rp.plan_window(window, topo, cost_for(4), token_cap=CAP, policy=policy, oversize="alone")
    assert plan.report["oversize"] == {"mode": "alone", "samples": over.tolist(), "token_cap": CAP}
    plan.validate(window, topo, CAP)  # the mode from the report
    plan.validate(window, topo, CAP, oversize="alone")
    with pytest.raises(rp.InvalidPlanError, match="over the cap"):
        plan.validate(window, topo, CAP, oversize="refuse")
    # each over-cap sample alone in its cell; every other cell within the cap
    cell = plan.sample_rank.astype(np.int64) * plan.num_micro + plan.sample_micro
    size = np.bincount(cell, minlength=topo.dp * plan.num_micro)
    tokens = np.bincount(cell, weights=window.seq_lens, minlength=topo.dp * plan.num_micro)
    assert (size[cell[over]] == 1).all()
    rest = np.setdiff1d(np.arange(len(size)), cell[over])
    assert (tokens[rest] <= CAP).all()
    assert plan.num_micro >= topo.min_micro and plan.num_micro % topo.micro_multiple == 0
    res = rp.simulate(plan, window, topo, cost_for(4))
    assert res.lower_bound_time <= res.step_time
    assert res.step_time == plan.report["predicted"]["step_time"]
    if policy == "routepack":
        pk = plan.report["packing"]
        # an over-cap sample counts as one full row in the bound: rows >= its count + the rest's
        clamped = np.minimum(window.seq_lens, CAP)
        assert pk["rows_lower_bound"]["L1"] == -(-int(clamped.sum()) // CAP)
        assert pk["rows_lower_bound"]["rows"] >= len(over)
        assert pk["certified"] and pk["rows"] == pk["rows_lower_bound"]["rows"]


def test_alone_rows_are_certified_against_the_true_minimum():
    # 6 samples of 10 tokens under a cap of 10 plus one of 25: 7 rows at least (each alone)
    lens = np.array([10, 10, 10, 10, 10, 10, 25])
    counts = np.zeros((7, 1, 2), dtype=np.int32)
    counts[:, 0, 0] = lens
    window = rp.Window(lens, counts)
    cost = cost_for(1)
    plan = rp.plan_window(window, rp.Topology(1, 1, 1, 2), cost, token_cap=10, oversize="alone")
    assert plan.num_micro == 7 and plan.report["packing"]["certified"]
    assert plan.report["packing"]["rows_lower_bound"]["rows"] == 7


def test_pipeline_plans_meet_megatrons_rule_under_every_preset():
    window, _ = window_with_long_samples(share=0.0, samples=64)
    for pipeline in (dict(pp=4), dict(pp=2, vpp=2), dict(pp=4, layers_per_stage=(1, 1, 1, 1))):
        topo = rp.Topology(4, 2, 2, 4, **pipeline)
        for policy in rp.PRESETS:
            kw = {"previous_window": window} if "oracle" not in policy and policy.startswith("eplb") else {}
            plan = rp.plan_window(window, topo, cost_for(4), token_cap=CAP, policy=policy, **kw)
            plan.validate(window, topo, CAP)
            assert plan.num_micro >= topo.pp and plan.num_micro % topo.micro_multiple == 0, (policy, pipeline)
            res = rp.simulate(plan, window, topo, cost_for(4))
            assert res.pipeline_bubble > 0 and res.lower_bound_time <= res.step_time
            flat = rp.simulate(plan, window, replace(topo, pp=1, vpp=1, layers_per_stage=None), cost_for(4))
            assert flat.pipeline_bubble == 0
