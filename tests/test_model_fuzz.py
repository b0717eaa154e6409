"""Property tests of `routepack.model`: `Topology`, `ModelShape`, `Hardware` and `CostModel`
(with its JSON form) on random and malformed inputs (the method: see `fuzzing.py`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import (
    assert_absurd_size_fails_cleanly, assert_wrong_type_is_clean, FUZZ, outcome, is_int, scalars, numbers, finite_number_ok,
)


# ---------------------------------------------------------------------- Topology

@st.composite
def topology_args(draw):
    """(dp, ep, gpus_per_node, slots_per_rank): a valid topology with 0-2 fields replaced by
    arbitrary scalars."""
    ep = draw(st.sampled_from([1, 2, 3, 4, 8]))
    args = [ep * draw(st.integers(1, 4)), ep, draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 3, 6)
                                                                    if g % ep == 0 or ep % g == 0])),
            draw(st.integers(1, 20))]
    for i, v in draw(st.dictionaries(st.integers(0, 3), scalars(), max_size=2)).items():
        args[i] = v
    return args


@FUZZ
@given(topology_args())
def test_topology(args):
    dp, ep, gpn, spr = args
    topo, err = outcome(rp.Topology, dp, ep, gpn, spr)
    ints = all(is_int(v) and v >= 1 for v in (dp, ep, gpn, spr))
    valid = ints and dp % ep == 0 and (ep % gpn == 0 or gpn % ep == 0)
    if valid and max(dp, ep * spr, gpn) >= 2**31:
        pass  # beyond int32 ids: refusing it (cleanly) is allowed
    else:
        assert (err is None) == valid, err
    if topo is None or topo.num_slots > 4096 or topo.dp > 4096:
        return  # absurd sizes: see test_absurd_sizes_fail_cleanly
    E = max(1, topo.num_slots // 2)
    placement, err = outcome(rp.Placement.static, 2, E, topo)
    if topo.gpus_per_node >= 2**64:  # a ValueError when Rust cannot hold the number is fine
        return
    assert err is None, err
    assert placement.phy2log.shape == (2, topo.num_slots)
    _, err = outcome(topo.check_experts, topo.num_slots + 1)
    assert err is not None and "num_experts" in str(err)


# -------------------------------------------------------------- ModelShape, Hardware

@FUZZ
@given(
    fields=st.tuples(*[scalars(-2, 40, huge=False) for _ in range(5)]),
    attention=st.one_of(st.none(), st.just("linear"), st.integers(), st.lists(
        st.sampled_from(["linear", "full", "Full", "", None, 3]), max_size=6)),
    shared=scalars(-1, 3),
)
def test_model_shape_and_cost_from_model(fields, attention, shared):
    model, err = outcome(rp.ModelShape, *fields, attention=attention, shared_experts=shared)
    if model is None:
        return
    assert all(is_int(v) and v >= 1 for v in fields) and model.top_k <= model.num_experts
    assert len(model.attention) == model.num_layers
    assert set(model.attention) <= {"linear", "full"}
    cost, err = outcome(rp.CostModel.from_model, model, rp.Hardware.h200())
    if cost is not None:
        assert cost.num_layers == model.num_layers
        assert all(math.isfinite(v) for v in dataclasses.astuple(cost)[2:])


HW_FIELDS = ["flops", "flops_efficiency", "bw_intra", "bw_inter", "comm_efficiency", "expert_overhead_s"]


@FUZZ
@given(
    base=st.tuples(st.floats(1e9, 1e16), st.floats(0.01, 1.0), st.floats(1e8, 1e12), st.floats(1e8, 1e12),
                   st.floats(0.01, 1.0), st.floats(0, 1e-3)),
    bad=st.dictionaries(st.integers(0, 5), numbers(), max_size=2),
)
def test_hardware(base, bad):
    values = [bad.get(i, v) for i, v in enumerate(base)]
    hw, err = outcome(rp.Hardware, "fuzz", *values)
    d = dict(zip(HW_FIELDS, values))
    valid = (
        all(finite_number_ok(d[k], strict=True) for k in ("flops", "bw_intra", "bw_inter"))
        and all(finite_number_ok(d[k], strict=True, upper=1.0) for k in ("flops_efficiency", "comm_efficiency"))
        and finite_number_ok(d["expert_overhead_s"])
    )
    assert (err is None) == valid, (err, values)
    if hw is not None:
        model = rp.ModelShape(2, 8, 2, 64, 32, attention=["linear", "full"])
        outcome(rp.CostModel.from_model, model, hw)  # tiny rates may overflow: a clean error then


# -------------------------------------------------------------------- CostModel

COST_FIELDS = ["a_lin", "a_quad", "c_tok", "c_exp", "token_bytes", "bw_intra", "bw_inter",
               "expert_weight_bytes", "expert_grad_bytes", "expert_state_bytes"]


@FUZZ
@given(
    base=st.lists(st.floats(1e-12, 1e12), min_size=9, max_size=9),
    bad=st.dictionaries(st.integers(0, 8), numbers(), max_size=2),
    a_quad=st.one_of(st.lists(st.floats(0, 1e-6), min_size=1, max_size=4), st.lists(numbers(), max_size=4),
                     st.none(), st.text(max_size=3), numbers()),
)
def test_cost_model(base, bad, a_quad):
    scalars_ = [bad.get(i, v) for i, v in enumerate(base)]
    kwargs = dict(zip([f for f in COST_FIELDS if f != "a_quad"], scalars_), a_quad=a_quad)
    cost, err = outcome(rp.CostModel, **kwargs)
    valid = (
        all(finite_number_ok(kwargs[k], strict=k.startswith("bw_")) for k in kwargs if k != "a_quad")
        and isinstance(a_quad, list) and len(a_quad) >= 1 and all(finite_number_ok(v) for v in a_quad)
    )
    assert (err is None) == valid, (err, kwargs)
    if cost is not None:
        assert rp.CostModel.from_json(cost.to_json()) == cost


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.sampled_from([10**400, -(10**400)]),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)


@FUZZ
@given(text=st.one_of(st.text(max_size=40), JSON_VALUES.map(json.dumps)))
def test_cost_model_from_arbitrary_json(text):
    cost, err = outcome(rp.CostModel.from_json, text)
    assert cost is None  # nothing random is a complete cost model


@FUZZ
@given(
    drop=st.sets(st.sampled_from(COST_FIELDS), max_size=2),
    extra=st.dictionaries(st.text(min_size=1, max_size=4), JSON_VALUES, max_size=2),
    replace=st.dictionaries(st.sampled_from(COST_FIELDS), JSON_VALUES, max_size=3),
)
def test_cost_model_from_corrupted_json(drop, extra, replace):
    base = json.loads(rp.traces.profile("tiny").cost().to_json())
    data = {k: v for k, v in {**base, **replace}.items() if k not in drop}
    data.update({k: v for k, v in extra.items() if k not in COST_FIELDS})
    cost, err = outcome(rp.CostModel.from_json, json.dumps(data))
    if cost is not None:
        assert not drop and not (set(extra) - set(COST_FIELDS))
        assert rp.CostModel.from_json(cost.to_json()) == cost


# ------------------------------------------------- wrong argument types, by hand

WRONG_TYPES = {
    "CostModel.from_model(model=str)": lambda t, w, c, p: rp.CostModel.from_model("model", rp.Hardware.h200()),
    "CostModel(a_lin=10**400)": lambda t, w, c, p: rp.CostModel(10**400, [0.0], 1, 1, 1, 1, 1, 1, 1, 1),
    "CostModel.from_model(hidden=10**200)": lambda t, w, c, p: rp.CostModel.from_model(
        rp.ModelShape(1, 2, 1, 10**200, 1), rp.Hardware.h200()),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_argument_types_are_clean_errors(name):
    assert_wrong_type_is_clean(WRONG_TYPES[name])


# ---------------------------------- absurd sizes, each in its own interpreter

ABSURD = {
    "Topology(ep*slots overflows)": "rp.Placement.static(1, 2, rp.Topology(2, 2, 2, 2**63 + 1))",
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_fail_cleanly(name):
    assert_absurd_size_fails_cleanly(ABSURD[name])
