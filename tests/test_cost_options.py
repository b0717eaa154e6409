"""The cost model's options (``c_weights``, ``c_gemm``, ``c_call``, ``overlap``, ``passes``) on the Python side: defaults
from the core, exact JSON round trip, old files loading with the defaults and pricing as before,
errors naming the field, and each option's effect on `simulate` (the Rust property tests in
crates/routepack-core/tests/cost_props.rs and bound_props.rs check the formulas and the bound)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import routepack as rp
from routepack import _core
from random_plans import random_case

PROFILE = rp.traces.profile("tiny")


@pytest.fixture(scope="module")
def case():
    w0, w1 = list(rp.traces.synthetic(PROFILE, 2, seed=3))
    topo, cost = PROFILE.topology(), PROFILE.cost()
    plans = {
        p: rp.plan_window(w1, topo, cost, PROFILE.token_cap, policy=p, previous_window=w0)
        for p in ("static", "routepack")
    }
    for plan in plans.values():
        plan.validate(w1, topo, PROFILE.token_cap)
    return w1, topo, cost, plans


def test_defaults_are_the_cores():
    d = _core.cost_defaults()
    c = PROFILE.cost()
    assert (c.c_weights, c.c_gemm, c.c_call, c.a2a_latency, c.bw_reduce, c.overlap, list(c.passes)) == (
        d["c_weights"],
        d["c_gemm"],
        d["c_call"],
        d["a2a_latency"],
        d["bw_reduce"],
        d["overlap"],
        list(d["passes"]),
    )
    assert c.passes == ("forward", "backward") and c.overlap == "none"
    assert c.c_weights == c.c_gemm == c.c_call == c.a2a_latency == c.bw_reduce == 0.0


def test_old_json_loads_with_the_defaults_and_prices_the_same(case):
    w, topo, cost, plans = case
    old = json.loads(cost.to_json())
    for k in ("c_weights", "c_gemm", "c_call", "a2a_latency", "bw_reduce", "overlap", "passes"):
        old.pop(k)
    loaded = rp.CostModel.from_json(json.dumps(old))
    assert loaded == cost
    for plan in plans.values():
        a, b = rp.simulate(plan, w, topo, cost), rp.simulate(plan, w, topo, loaded)
        assert a.step_time == b.step_time and a.hidden == 0.0


@settings(max_examples=60, deadline=None)
@given(
    c_weights=st.floats(0, 1e-3, allow_nan=False),
    overlap=st.sampled_from(rp.model.OVERLAPS),
    passes=st.lists(st.sampled_from(rp.model.PASS_KINDS), min_size=1, max_size=4),
    c_gemm=st.floats(0, 1e-2, allow_nan=False),
    c_call=st.floats(0, 1e-2, allow_nan=False),
    a2a_latency=st.floats(0, 1e-2, allow_nan=False),
    # 0: priced at bw_intra; a denormal bandwidth (5e-324 B/s) makes one byte cost inf s, refused
    # since issue 40 (a step time that could not be finite: test_bad_options_name_the_field)
    bw_reduce=st.one_of(st.just(0.0), st.floats(1e-6, 1e12, allow_nan=False)),
)
def test_json_round_trip_is_exact(c_weights, overlap, passes, c_gemm, c_call, a2a_latency, bw_reduce):
    c = replace(
        PROFILE.cost(),
        c_weights=c_weights,
        overlap=overlap,
        passes=passes,
        c_gemm=c_gemm,
        c_call=c_call,
        a2a_latency=a2a_latency,
        bw_reduce=bw_reduce,
    )
    again = rp.CostModel.from_json(c.to_json())
    assert again == c and again.to_json() == c.to_json()
    assert asdict(again)["passes"] == tuple(passes)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("overlap", "always", "cost.overlap"),
        ("overlap", 1, "cost.overlap"),
        ("passes", [], "cost.passes"),
        ("passes", ["forward", "recompute"], "cost.passes[1]"),
        ("c_weights", -1.0, "cost.c_weights"),
        ("c_weights", float("nan"), "cost.c_weights"),
        ("c_gemm", -1e-9, "cost.c_gemm"),
        ("c_gemm", float("inf"), "cost.c_gemm"),
        ("c_gemm", "1e-3", "cost.c_gemm"),
        ("c_call", -1e-9, "cost.c_call"),
        ("c_call", float("nan"), "cost.c_call"),
        ("c_call", None, "cost.c_call"),
        ("a2a_latency", -1e-9, "cost.a2a_latency"),
        ("a2a_latency", float("inf"), "cost.a2a_latency"),
        ("bw_reduce", -1.0, "cost.bw_reduce"),
        ("bw_reduce", float("nan"), "cost.bw_reduce"),
        ("bw_reduce", 5e-324, "cost.bw_reduce"),
    ],
)
def test_bad_options_name_the_field(field, value, needle):
    with pytest.raises(rp.RoutepackError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        replace(PROFILE.cost(), **{field: value})


def test_each_option_moves_the_step_as_documented(case):
    w, topo, cost, plans = case
    for plan in plans.values():
        base = rp.simulate(plan, w, topo, cost)
        over = rp.simulate(plan, w, topo, replace(cost, overlap="dispatch_combine"))
        assert 0 < over.hidden <= over.all_to_all and over.step_time < base.step_time
        parts = (
            over.attention
            + over.expert
            + over.all_to_all
            + over.replication
            + over.migration
            + over.redundant_grads
            - over.hidden
        )
        assert parts == pytest.approx(over.step_time, rel=1e-9)
        assert over.lower_bound_time <= over.step_time
        rl = rp.simulate(plan, w, topo, replace(cost, passes=("forward", "forward", "backward")))
        assert rl.step_time > base.step_time and rl.lower_bound_time <= rl.step_time
        roof = rp.simulate(plan, w, topo, replace(cost, c_weights=cost.c_tok * 1e6))  # above every load
        assert roof.expert > base.expert and roof.lower_bound_time <= roof.step_time
        tiny = rp.simulate(plan, w, topo, replace(cost, c_weights=cost.c_tok * 0.5))
        assert tiny.step_time == base.step_time  # a floor below one token's work binds nowhere
        step = rp.simulate(plan, w, topo, replace(cost, c_gemm=cost.c_exp))  # every expert here has >= 2 tokens
        assert step.expert > base.expert and step.lower_bound_time <= step.step_time
        # one call per rank and exchange: the slowest rank of every exchange computes tokens,
        # so the expert part rises by 3 · c_call per exchange of the critical group
        call = rp.simulate(plan, w, topo, replace(cost, c_call=cost.c_exp))
        exchanges = plan.num_micro * w.num_layers
        assert call.expert == pytest.approx(base.expert + 3 * cost.c_exp * exchanges, rel=1e-9)
        assert call.lower_bound_time <= call.step_time
        # every exchange's all-to-alls pay the latency: 2 (dispatch, combine) × 2 passes each
        lat = rp.simulate(plan, w, topo, replace(cost, a2a_latency=1e-4))
        assert lat.all_to_all == pytest.approx(base.all_to_all + 4 * 1e-4 * exchanges, rel=1e-9)
        assert lat.lower_bound_time <= lat.step_time


def test_planning_under_the_options_gives_valid_plans(case):
    w, topo, cost, _ = case
    for opt in (
        {"overlap": "dispatch_combine"},
        {"c_weights": cost.c_tok * 32},
        {"passes": ("forward",)},
        {"c_gemm": cost.c_tok * 64},
        {"c_call": cost.c_exp * 50},
        {"a2a_latency": cost.c_exp * 20},
    ):
        c = replace(cost, **opt)
        plan = rp.plan_window(w, topo, c, PROFILE.token_cap, policy="routepack", anneal_moves=20000)
        plan.validate(w, topo, PROFILE.token_cap)
        r = rp.simulate(plan, w, topo, c)
        assert np.isfinite(r.step_time) and r.lower_bound_time <= r.step_time


def test_an_old_file_without_c_gemm_loads_with_no_step(tmp_path):
    """A cost file written before ``c_gemm`` existed (its other options present) loads with
    ``c_gemm = 0`` and prices every plan bit for bit as the model without the step."""
    c = replace(PROFILE.cost(), c_weights=PROFILE.cost().c_tok * 4)
    old = json.loads(c.to_json())
    old.pop("c_gemm")
    path = tmp_path / "old_cost.json"
    path.write_text(json.dumps(old), encoding="utf-8")
    loaded = rp.CostModel.load(path)
    assert loaded.c_gemm == 0.0 and loaded == c


def test_an_old_file_without_c_call_loads_with_no_call_cost(tmp_path):
    """A cost file written before ``c_call`` and ``a2a_latency`` existed (``c_gemm`` present)
    loads with both 0 and prices every plan as the model without them."""
    c = replace(PROFILE.cost(), c_gemm=PROFILE.cost().c_tok * 4)
    old = json.loads(c.to_json())
    old.pop("c_call")
    old.pop("a2a_latency")
    path = tmp_path / "old_cost.json"
    path.write_text(json.dumps(old), encoding="utf-8")
    loaded = rp.CostModel.load(path)
    assert loaded.c_call == 0.0 and loaded == c


def test_simulate_prices_the_copies_staging():
    for seed in range(40):
        case = random_case(seed)
        if len(case.plan.replicas):
            break
    else:
        pytest.skip("no case with replicas")
    case.plan.validate(case.window, case.topo, 10**9)
    exposed = replace(case.cost, replica_prefetch=False)
    a = rp.simulate(case.plan, case.window, case.topo, exposed, case.token_cap)
    b = rp.simulate(case.plan, case.window, case.topo, replace(exposed, c_replica=1e-9), case.token_cap)
    assert b.replication > a.replication and b.step_time > a.step_time
    # default 0: the same figures as before the term existed
    c = rp.simulate(case.plan, case.window, case.topo, replace(exposed, c_replica=0.0), case.token_cap)
    assert c.step_time == a.step_time
