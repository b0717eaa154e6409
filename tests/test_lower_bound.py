"""`SimResult.lower_bound_time` is a lower bound: no plan of any preset, nor a random valid plan,
on small random windows, topologies (replica buffers from none to plenty) and cost models, is
simulated below it; it charges the tokens no slot or replica buffer can hold (a case worked by
hand, where a plan meets it); and `fraction_of_bound` / `summary()` report it (docs/design.md,
"Lower bound")."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import FUZZ
from random_plans import TOPOLOGIES, random_case, random_cost, random_window

RTOL = 1e-9


def check(res: rp.SimResult) -> None:
    assert math.isfinite(res.lower_bound_time) and res.lower_bound_time >= 0
    assert res.step_time >= res.lower_bound_time * (1 - RTOL), (res.step_time, res.lower_bound_time)
    assert 0 < res.fraction_of_bound <= 1
    summary = res.summary()
    assert summary["lower_bound_time"] == res.lower_bound_time
    assert summary["fraction_of_bound"] == res.fraction_of_bound


#: Replica buffers a rank: none, a few, the default, more than an exchange can use.
BUFFERS = (0, 1, 3, 64)


@FUZZ
@given(
    seed=st.integers(0, 10**6),
    topo_index=st.integers(0, len(TOPOLOGIES) - 1),
    cap_extra=st.integers(0, 400),
    buffers=st.sampled_from(BUFFERS),
)
def test_no_preset_plan_beats_the_bound(seed, topo_index, cap_extra, buffers):
    rng = np.random.default_rng(seed)
    topo = rp.Topology(*TOPOLOGIES[topo_index], replica_slots=buffers)
    layers = int(rng.integers(1, 3))
    experts = int(rng.integers(max(1, topo.num_slots // 2), topo.num_slots + 1))
    window = random_window(rng, topo.dp * int(rng.integers(1, 4)) + int(rng.integers(0, topo.dp + 1)), layers, experts)
    before = random_window(rng, window.num_samples, layers, experts)  # for the history-based presets
    cost = random_cost(rng, layers)
    cap = int(window.seq_lens.max()) + cap_extra
    bound = None
    for name in sorted(rp.PRESETS):
        try:
            plan = rp.plan_window(
                window, topo, cost, token_cap=cap, policy=name, seed=seed, anneal_moves=300, previous_window=before
            )
        except rp.InfeasibleError:  # a packing that cannot keep every rank busy under this cap
            continue
        res = rp.simulate(plan, window, topo, cost, token_cap=cap)
        check(res)
        # the bound depends on the window, topology, cost and cap only, not on the plan
        bound = res.lower_bound_time if bound is None else bound
        assert math.isclose(res.lower_bound_time, bound, rel_tol=1e-12)


@FUZZ
@given(seed=st.integers(0, 10**6), buffers=st.sampled_from(BUFFERS))
def test_no_random_plan_beats_the_bound(seed, buffers):
    case = random_case(seed, replica_slots=buffers)
    res = rp.simulate(case.plan, case.window, case.topo, case.cost, case.token_cap)
    check(res)
    # without a cap the bound is the weakest one
    loose = rp.simulate(case.plan, case.window, case.topo, case.cost)
    assert loose.lower_bound_time <= res.lower_bound_time * (1 + 1e-12)


def test_tokens_no_buffer_can_hold_are_charged():
    """Two ranks in one node, one slot each, two experts; each sample sends t tokens to each
    expert, and only the all-to-all is priced (copies cost nothing). Without replica buffers a
    sample's tokens for the expert its rank does not host must leave it: the bound is the
    all-to-all of the plan that puts one sample on each rank, 2·2·t/bw, and that plan meets it.
    With one buffer a free copy can serve them: the bound charges nothing."""
    t = 50
    window = rp.Window(np.array([t, t]), np.full((2, 1, 2), t, dtype=np.int32))
    cost = rp.CostModel(
        a_lin=0.0,
        a_quad=[0.0],
        c_tok=0.0,
        c_exp=0.0,
        token_bytes=1.0,
        bw_intra=1.0,
        bw_inter=1.0,
        expert_weight_bytes=0.0,
        expert_grad_bytes=0.0,
        expert_state_bytes=0.0,
    )
    plan = rp.Plan(rp.Placement.static(1, 2, rp.Topology(2, 2, 2, 1)), np.array([0, 1]), np.array([0, 0]), 1)
    none = rp.simulate(plan, window, rp.Topology(2, 2, 2, 1, replica_slots=0), cost, token_cap=t)
    assert none.lower_bound_time == none.step_time == 2 * 2 * t
    assert none.fraction_of_bound == 1.0
    one = rp.simulate(plan, window, rp.Topology(2, 2, 2, 1, replica_slots=1), cost, token_cap=t)
    assert one.lower_bound_time == 0.0 and one.step_time == 2 * 2 * t
