"""``Topology.replica_slots``: the replica buffers a rank holds for one exchange's copies.

The replication stages plan within it (their own budgets capped by it), `Plan.validate` and
`simulate` refuse a plan over it naming the rank, group, microbatch, layer and count, and
``plan.report["memory"]`` gives each rank's expert memory (docs/design.md, "Public contract (Python)").
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.replication import DEFAULT_HOT_EXPERTS
from routepack.policies import Policy
from test_replication import REPLICATION_NAMES, SHAPES, make_case


def copies_per_rank(replicas: np.ndarray) -> int:
    """The most distinct experts one rank receives copies of in one exchange."""
    if len(replicas) == 0:
        return 0
    keys = {(int(r["group"]), int(r["micro"]), int(r["layer"]), int(r["dst_rank"]), int(r["expert"])) for r in replicas}
    per: dict = {}
    for g, m, l, d, _ in keys:
        per[(g, m, l, d)] = per.get((g, m, l, d), 0) + 1
    return max(per.values())


def test_the_default_is_the_cores_and_what_hot_n_needs():
    assert rp.Topology(4, 2, 2, 3).replica_slots == rp._core.topology_defaults()["replica_slots"] == 3
    assert rp.Topology(4, 2, 2, 3).replica_slots >= DEFAULT_HOT_EXPERTS


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True, None])
def test_bad_values_are_named(bad):
    with pytest.raises(rp.RoutepackError, match="topo.replica_slots"):
        rp.Topology(4, 2, 2, 3, replica_slots=bad)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    shape=st.integers(0, len(SHAPES) - 1),
    replication=st.sampled_from(REPLICATION_NAMES),
    buffers=st.integers(0, 4),
    asked=st.integers(1, 6),
)
def test_planners_stay_within_the_buffers(seed, shape, replication, buffers, asked):
    window, topo, cost, cap = make_case(seed, shape, layers=2)
    topo = dataclasses.replace(topo, replica_slots=buffers)
    option = {"hot_n": "replication_hot_experts"}.get(replication, "replication_slots")
    plan = rp.plan_window(
        window, topo, cost, cap, policy=Policy("static", "sequential", replication), **{option: asked}
    )
    plan.validate(window, topo, cap)
    assert copies_per_rank(plan.replicas) <= min(buffers, asked)
    if replication == "hot_n" and topo.ep > 1 and buffers >= asked:
        # where the buffers do not bind, MindSpeed's rule is unchanged: the same plan as with room to spare
        roomy = rp.plan_window(
            window,
            dataclasses.replace(topo, replica_slots=64),
            cost,
            cap,
            policy=Policy("static", "sequential", "hot_n"),
            replication_hot_experts=asked,
        )
        assert np.array_equal(roomy.replicas, plan.replicas)


def over_the_limit():
    """A valid plan with hot_n's 3 copies on a rank, and the same topology with 2 buffers."""
    window, topo, cost, cap = make_case(3, 0, layers=2)
    plan = rp.plan_window(window, topo, cost, cap, policy="hot_n")
    assert copies_per_rank(plan.replicas) == 3
    return window, dataclasses.replace(topo, replica_slots=2), cost, cap, plan


def test_validate_names_the_rank_microbatch_layer_and_count():
    window, small, cost, cap, plan = over_the_limit()
    r = plan.replicas
    with pytest.raises(rp.InvalidPlanError) as e:
        plan.validate(window, small, cap)
    msg = str(e.value)
    first = sorted(zip(r["group"], r["micro"], r["layer"], r["dst_rank"]))[0]
    g, m, l, d = (int(x) for x in first)
    assert f"rank {d} of EP group {g} receives copies of 3 experts in microbatch {m}, layer {l}" in msg
    assert "topo.replica_slots = 2" in msg


def test_simulate_refuses_a_plan_over_the_limit():
    window, small, cost, cap, plan = over_the_limit()
    with pytest.raises(rp.InvalidPlanError, match="topo.replica_slots = 2"):
        rp.simulate(plan, window, small, cost, cap)
    with pytest.raises(rp.InvalidPlanError, match="topo.replica_slots = 2"):
        rp.simulate(plan, window, small, cost, cap, validate=True)


def test_a_copy_of_one_expert_twice_takes_one_buffer():
    window, topo, cost, cap = make_case(5, 1, layers=1)
    plan = rp.plan_window(window, dataclasses.replace(topo, replica_slots=1), cost, cap, policy="hot_n")
    rows = plan.replicas
    assert len(rows) > 0
    doubled = np.concatenate([rows, rows])
    doubled["share"] = np.concatenate([rows["share"], rows["share"]]) / 2
    twice = rp.Plan(plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, doubled)
    twice.validate(window, dataclasses.replace(topo, replica_slots=1), cap)


def test_the_report_gives_each_ranks_memory():
    window, topo, cost, cap = make_case(3, 0, layers=2)
    for policy in ("hot_n", "static"):
        plan = rp.plan_window(window, topo, cost, cap, policy=policy)
        mem = plan.report["memory"]
        assert mem == plan.memory(topo, cost)
        L, spr = plan.placement.num_layers, topo.slots_per_rank
        assert mem["resident_bytes"] == L * spr * (cost.expert_state_bytes + cost.expert_grad_bytes)
        # by hand: per (group, layer, dst) the most distinct experts over microbatches, summed over layers
        want = np.zeros(topo.dp)
        for g in range(topo.num_groups):
            for d in range(topo.ep):
                for l in range(L):
                    most = 0
                    for m in range(plan.num_micro):
                        r = plan.replicas
                        sel = (r["group"] == g) & (r["dst_rank"] == d) & (r["layer"] == l) & (r["micro"] == m)
                        most = max(most, len(set(r["expert"][sel].tolist())))
                    want[g * topo.ep + d] += most * (cost.expert_weight_bytes + cost.expert_grad_bytes)
        assert mem["replica_bytes"] == want.tolist()
        assert mem["rank_bytes"] == (want + mem["resident_bytes"]).tolist()
        assert mem["max_rank_bytes"] == max(mem["rank_bytes"])
        assert mem["replica_buffers"] == copies_per_rank(plan.replicas) <= topo.replica_slots
        assert mem["topology_buffer_bytes"] == L * topo.replica_slots * (
            cost.expert_weight_bytes + cost.expert_grad_bytes
        )
        if policy == "static":
            assert mem["replica_bytes"] == [0.0] * topo.dp
