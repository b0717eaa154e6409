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


def check(res: rp.SimResult) -> None:
    assert math.isfinite(res.lower_bound_time) and res.lower_bound_time >= 0
    # a bound as computed: no tolerance (routepack-core's bound, "In floating point")
    assert res.step_time >= res.lower_bound_time, (res.step_time, res.lower_bound_time)
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


def test_the_smallest_case_of_issue_33():
    """14 samples of 1,438 tokens, 3 layers, 1 expert, dp = ep = 1, only ``a_lin`` and
    ``c_exp`` priced, in one microbatch: the plan sits at the bound, and the bound (before its
    rounding margin, 1-20 ulps above the step time in 0.3% of plans) is not above it."""
    window = rp.Window(np.full(14, 1438), np.full((14, 3, 1), 1438, dtype=np.int32))
    topo = rp.Topology(1, 1, 1, 1)
    cost = rp.CostModel(1e-9, [0.0] * 3, 0.0, 1e-6, 0.0, 1e9, 1e9, 0.0, 0.0, 0.0)
    cap = 14 * 1438
    plan = rp.plan_window(window, topo, cost, token_cap=cap, policy="static").validate(window, topo, cap)
    res = rp.simulate(plan, window, topo, cost, token_cap=cap)
    check(res)
    assert res.fraction_of_bound <= 1.0 and res.fraction_of_bound > 1 - 1e-9


@FUZZ
@given(
    samples=st.integers(1, 40),
    length=st.integers(1, 5000),
    layers=st.integers(1, 4),
    a_lin=st.floats(1e-10, 1e-6),
    c_exp=st.floats(1e-7, 1e-3),
    one_micro=st.booleans(),
)
def test_a_plan_at_the_bound_is_not_below_it(samples, length, layers, a_lin, c_exp, one_micro):
    """Equal samples on one rank priced by ``a_lin`` and ``c_exp`` alone, in one microbatch or
    one per sample: step time and bound are one sum added in two orders, and the bound is
    never above the step time, with no tolerance (what would have caught the clamp's fault)."""
    window = rp.Window(np.full(samples, length), np.full((samples, layers, 1), length, dtype=np.int32))
    topo = rp.Topology(1, 1, 1, 1)
    cost = rp.CostModel(a_lin, [0.0] * layers, 0.0, c_exp, 0.0, 1e9, 1e9, 0.0, 0.0, 0.0)
    cap = samples * length if one_micro else length
    plan = rp.plan_window(window, topo, cost, token_cap=cap, policy="static").validate(window, topo, cap)
    check(rp.simulate(plan, window, topo, cost, token_cap=cap))


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
    # at the bound, less its rounding margin (a relative 2^-40 on a window this small)
    assert none.step_time == 2 * 2 * t and none.step_time * (1 - 1e-11) <= none.lower_bound_time <= none.step_time
    assert none.fraction_of_bound > 1 - 1e-11
    one = rp.simulate(plan, window, rp.Topology(2, 2, 2, 1, replica_slots=1), cost, token_cap=t)
    assert one.lower_bound_time == 0.0 and one.step_time == 2 * 2 * t
