"""`SimResult.lower_bound_time` is a lower bound: no plan of any preset, nor a random valid plan,
on small random windows, topologies and cost models, is simulated below it; and
`fraction_of_bound` / `summary()` report it (docs/design.md, "Lower bound")."""

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


@FUZZ
@given(seed=st.integers(0, 10**6), topo_index=st.integers(0, len(TOPOLOGIES) - 1), cap_extra=st.integers(0, 400))
def test_no_preset_plan_beats_the_bound(seed, topo_index, cap_extra):
    rng = np.random.default_rng(seed)
    topo = rp.Topology(*TOPOLOGIES[topo_index])
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
@given(seed=st.integers(0, 10**6))
def test_no_random_plan_beats_the_bound(seed):
    case = random_case(seed)
    res = rp.simulate(case.plan, case.window, case.topo, case.cost, case.token_cap)
    check(res)
    # without a cap the bound is the weakest one
    loose = rp.simulate(case.plan, case.window, case.topo, case.cost)
    assert loose.lower_bound_time <= res.lower_bound_time * (1 + 1e-12)
