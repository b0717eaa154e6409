"""Property tests of `routepack.simulate` on random plans, caps and topologies (the method:
see `fuzzing.py`)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import assert_absurd_size_fails_cleanly, assert_wrong_type_is_clean, FUZZ, outcome
from random_plans import TOPOLOGIES, random_case


# -------------------------------------------------------------------- simulate


@FUZZ
@given(
    seed=st.integers(0, 10**6),
    cap=st.one_of(
        st.none(),
        st.integers(-5, 10**4),
        st.sampled_from([2**62, 10**30]),
        st.text(max_size=2),
        st.floats(allow_nan=False),
    ),
    other_topo=st.booleans(),
)
def test_simulate(seed, cap, other_topo):
    case = random_case(seed)
    topo = (
        rp.Topology(
            *TOPOLOGIES[
                (TOPOLOGIES.index((case.topo.dp, case.topo.ep, case.topo.gpus_per_node, case.topo.slots_per_rank)) + 1)
                % len(TOPOLOGIES)
            ]
        )
        if other_topo
        else case.topo
    )
    res, err = outcome(rp.simulate, case.plan, case.window, topo, case.cost, cap)
    if res is None:
        return
    assert topo == case.topo or (
        topo.num_slots == case.topo.num_slots
        and topo.dp == case.topo.dp
        and topo.slots_per_rank == case.topo.slots_per_rank
    )
    assert math.isfinite(res.step_time) and res.step_time > 0 and math.isfinite(res.ideal_time)
    assert res.imbalance.shape == (topo.num_groups, case.plan.num_micro, case.window.num_layers)
    assert (res.imbalance >= 1 - 1e-12).all() and (res.imbalance <= topo.ep + 1e-12).all()


# ------------------------------------------------- wrong argument types, by hand

WRONG_TYPES = {
    "simulate(plan=str)": lambda t, w, c, p: rp.simulate("plan", w, t, c),
    "simulate(window=str)": lambda t, w, c, p: rp.simulate(p, "window", t, c),
    "simulate(topo=dict)": lambda t, w, c, p: rp.simulate(p, w, {"dp": 2}, c),
    "simulate(cost=str)": lambda t, w, c, p: rp.simulate(p, w, t, "cost"),
    "simulate(token_cap=0.5)": lambda t, w, c, p: rp.simulate(p, w, t, c, token_cap=0.5),
    "simulate(token_cap=inf)": lambda t, w, c, p: rp.simulate(p, w, t, c, token_cap=float("inf")),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_argument_types_are_clean_errors(name):
    assert_wrong_type_is_clean(WRONG_TYPES[name])


# ---------------------------------- absurd sizes, each in its own interpreter

ABSURD = {
    "simulate(dp=2**40)": "rp.simulate(plan, window, rp.Topology(2**40, 1, 1, 1), cost)",
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_fail_cleanly(name):
    assert_absurd_size_fails_cleanly(ABSURD[name])


# ------------------------------------------- a step of 0 s, and a bound of 0 below a plan


@FUZZ
@given(
    seed=st.integers(0, 10**6),
    priced=st.sampled_from(["c_exp", "c_tok", "expert_state_bytes"]),
    with_previous=st.booleans(),
)
def test_windows_holding_none_of_the_priced_work(seed, priced, with_previous):
    """A cost model pricing only expert work (or only migration) on a window that routes no
    token: the step takes 0 s (or only migration), and every figure keeps its contract."""
    case = random_case(seed)
    w = rp.Window(case.window.seq_lens, 0 * case.window.expert_tokens)
    kw = {
        k: 0.0
        for k in (
            "a_lin",
            "c_tok",
            "c_exp",
            "token_bytes",
            "expert_weight_bytes",
            "expert_grad_bytes",
            "expert_state_bytes",
        )
    }
    kw[priced] = 1e-3 if priced != "expert_state_bytes" else 1e6
    cost = rp.CostModel(a_quad=[0.0] * w.num_layers, bw_intra=1e9, bw_inter=1e8, **kw)
    plan = (
        case.plan
        if with_previous
        else rp.Plan(case.plan.placement, case.plan.sample_rank, case.plan.sample_micro, case.plan.num_micro)
    )
    res = rp.simulate(plan, w, case.topo, cost)
    assert 0 <= res.fraction_of_bound <= 1 and res.fraction_of_balanced >= 0
    assert res.step_time == res.migration and res.throughput > 0 and not math.isnan(res.throughput)
    if res.step_time == 0:
        assert res.throughput == math.inf and res.fraction_of_bound == 1 and res.fraction_of_balanced == 1
    else:  # migration alone: a plan keeping the placement would cost nothing
        assert len(plan.migration) and res.lower_bound_time == 0 and res.fraction_of_bound == 0
        assert math.isclose(res.throughput, w.total_tokens / res.step_time)
    summary = res.summary()  # JSON-able, as plan reports hold it
    assert summary["throughput"] == res.throughput
