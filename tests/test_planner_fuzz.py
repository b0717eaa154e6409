"""Property tests of `routepack.planner`: `plan_window` on random windows, topologies,
caps, seeds, policies and previous placements (the method: see `fuzzing.py`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routepack as rp
from fuzzing import assert_wrong_type_is_clean, FUZZ, outcome, is_int
from random_plans import TOPOLOGIES, assert_plan_invariants, random_phy2log
from routepack.simulate import lower_bound_micro


# ---------------------------------------------------------------- plan_window


@st.composite
def small_windows(draw):
    S, L, E = draw(st.integers(1, 14)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    lens = draw(hnp.arrays(np.int64, S, elements=st.integers(1, 80)))
    tokens = draw(hnp.arrays(np.int32, (S, L, E), elements=st.integers(0, 80)))
    return rp.Window(lens, np.minimum(tokens, lens[:, None, None]))  # a token picks an expert once


@st.composite
def topologies(draw):
    if draw(st.booleans()):
        return rp.Topology(*draw(st.sampled_from(TOPOLOGIES)))
    ep = draw(st.sampled_from([1, 2, 4, 8]))
    dp = ep * draw(st.integers(1, 3))
    gpn = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if g % ep == 0 or ep % g == 0]))
    return rp.Topology(dp, ep, gpn, draw(st.integers(1, 4)))


@FUZZ
@given(
    window=small_windows(),
    topo=topologies(),
    cap=st.one_of(
        st.integers(1, 300),
        st.integers(-2, 0),
        st.sampled_from([2**62, 2**63 - 1, 2**63, 2**70]),
        st.floats(1, 100),
        st.none(),
        st.booleans(),
    ),
    seed=st.one_of(st.integers(0, 2**64 - 1), st.integers(-3, -1), st.floats(0, 5), st.text(max_size=2)),
    policy=st.sampled_from(["static", "P()", "P(previous)", "nope", 3, "P(bad)"]),
    previous=st.sampled_from([None, "static", "random", "wrong_shape", "junk"]),
    previous_window=st.sampled_from([None, "same", "other_shape", "junk"]),
    cost_layers=st.sampled_from(["match", "mismatch"]),
    data=st.data(),
)
def test_plan_window(window, topo, cap, seed, policy, previous, previous_window, cost_layers, data):
    S, L, E = window.expert_tokens.shape
    cost = rp.CostModel(
        1e-6, [1e-9] * (L if cost_layers == "match" else L + 1), 1e-6, 1e-5, 1e3, 1e10, 1e9, 1e6, 2e6, 5e6
    )
    pol = {"P()": rp.Policy(), "P(previous)": rp.Policy(loads="previous"), "P(bad)": rp.Policy(packing="nope")}.get(
        policy, policy
    )
    prev = None
    if previous == "static" and E <= topo.num_slots:
        prev = rp.Placement.static(L, E, topo)
    elif previous == "random" and E <= topo.num_slots:
        rng = np.random.default_rng(data.draw(st.integers(0, 99)))
        prev = rp.Placement(random_phy2log(rng, L, E, topo), E, topo.slots_per_rank)
    elif previous == "wrong_shape":
        prev = rp.Placement(np.arange(E, dtype=np.int32)[None, :].repeat(L + 1, axis=0), E, 1)
    elif previous == "junk":
        prev = "junk"
    prev_w = {
        None: None,
        "same": window,
        "junk": "junk",
        "other_shape": rp.Window(window.seq_lens, np.zeros((S, L, E + 1), np.int32)),
    }[previous_window]

    plan, err = outcome(
        rp.plan_window, window, topo, cost, token_cap=cap, policy=pol, previous=prev, previous_window=prev_w, seed=seed
    )
    should_plan = (
        is_int(cap)
        and int(window.seq_lens.max()) <= cap < 2**63
        and is_int(seed)
        and 0 <= seed
        and policy in ("static", "P()", "P(previous)")
        and E <= topo.num_slots
        and cost_layers == "match"
        and previous in (None, "static", "random")
        and previous_window in (None, "same")
        # every cell runs a sample: dp ranks times the steps the cap needs at least
        and S >= topo.dp * lower_bound_micro(window, topo, cap)
    )
    if should_plan and plan is None:
        # the one refusal left for valid inputs: too few samples for the cells the cap needs (proven;
        # baselines fall back to the certified rows instead of refusing a window that fits)
        assert isinstance(err, rp.InfeasibleError) and "cannot fill" in str(err), err
    if plan is None:
        if isinstance(err, rp.InfeasibleError) and is_int(cap) and cap >= 1:
            too_long = np.flatnonzero(window.seq_lens > cap)
            if too_long.size:
                assert f"sample {too_long[0]} has {window.seq_lens[too_long[0]]} tokens" in str(err)
            elif S < topo.dp * lower_bound_micro(window, topo, cap):
                assert str(err).startswith(f"window: its {S} samples cannot fill") and f"topo.dp = {topo.dp}" in str(
                    err
                ), err
            else:
                # the core's stronger row bounds (or its certified rows) prove more rows than samples
                assert "cannot fill" in str(err), err
        return
    assert is_int(cap) and cap >= max(1, int(window.seq_lens.max()))
    assert E <= topo.num_slots and cost_layers == "match"
    plan.validate(window, topo, cap)
    assert_plan_invariants(plan, window, topo, cap)
    np.testing.assert_array_equal(plan.placement.phy2log, rp.Placement.static(L, E, topo).phy2log)
    if prev is not None:
        for row in plan.migration:
            assert plan.placement.phy2log[row["layer"], row["dst_slot"]] == row["expert"]
            assert prev.phy2log[row["layer"], row["src_slot"]] == row["expert"]
    res = rp.simulate(plan, window, topo, cost)
    assert math.isfinite(res.step_time) and res.step_time > 0 and res.throughput > 0
    assert plan.report["token_cap"] == cap


# ------------------------------------------------- wrong argument types, by hand

WRONG_TYPES = {
    "plan_window(topo=str)": lambda t, w, c, p: rp.plan_window(w, "topo", c, 10, policy="static"),
    "plan_window(cost=str)": lambda t, w, c, p: rp.plan_window(w, t, "cost", 10, policy="static"),
    "plan_window(token_cap=2**70)": lambda t, w, c, p: rp.plan_window(w, t, c, 2**70, policy="static"),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_argument_types_are_clean_errors(name):
    assert_wrong_type_is_clean(WRONG_TYPES[name])
