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
    cap=st.one_of(st.none(), st.integers(-5, 10**4), st.sampled_from([2**62, 10**30]), st.text(max_size=2),
                  st.floats(allow_nan=False)),
    other_topo=st.booleans(),
)
def test_simulate(seed, cap, other_topo):
    case = random_case(seed)
    topo = rp.Topology(*TOPOLOGIES[(TOPOLOGIES.index((case.topo.dp, case.topo.ep, case.topo.gpus_per_node,
                                                        case.topo.slots_per_rank)) + 1) % len(TOPOLOGIES)]) \
        if other_topo else case.topo
    res, err = outcome(rp.simulate, case.plan, case.window, topo, case.cost, cap)
    if res is None:
        return
    assert topo == case.topo or (topo.num_slots == case.topo.num_slots and topo.dp == case.topo.dp
                                 and topo.slots_per_rank == case.topo.slots_per_rank)
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
