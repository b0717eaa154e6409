"""Property tests of `routepack.model`: `Topology`, `ModelShape`, `Hardware` and `CostModel`
(with its JSON form) on random and malformed inputs (the method: see `fuzzing.py`)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import (
    assert_absurd_size_fails_cleanly,
    assert_wrong_type_is_clean,
    FUZZ,
    outcome,
    is_int,
    scalars,
    numbers,
    finite_number_ok,
)


# ---------------------------------------------------------------------- Topology


@st.composite
def topology_args(draw):
    """(dp, ep, gpus_per_node, slots_per_rank): a valid topology with 0-2 fields replaced by
    arbitrary scalars."""
    ep = draw(st.sampled_from([1, 2, 3, 4, 8]))
    args = [
        ep * draw(st.integers(1, 4)),
        ep,
        draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 3, 6) if g % ep == 0 or ep % g == 0])),
        draw(st.integers(1, 20)),
    ]
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
    attention=st.one_of(
        st.none(),
        st.just("linear"),
        st.integers(),
        st.lists(st.sampled_from(["linear", "full", "Full", "", None, 3]), max_size=6),
    ),
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
    base=st.tuples(
        st.floats(1e9, 1e16),
        st.floats(0.01, 1.0),
        st.floats(1e8, 1e12),
        st.floats(1e8, 1e12),
        st.floats(0.01, 1.0),
        st.floats(0, 1e-3),
    ),
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

COST_FIELDS = [
    "a_lin",
    "a_quad",
    "c_tok",
    "c_exp",
    "token_bytes",
    "bw_intra",
    "bw_inter",
    "expert_weight_bytes",
    "expert_grad_bytes",
    "expert_state_bytes",
]


@FUZZ
@given(
    base=st.lists(st.floats(1e-12, 1e12), min_size=9, max_size=9),
    bad=st.dictionaries(st.integers(0, 8), numbers(), max_size=2),
    a_quad=st.one_of(
        st.lists(st.floats(0, 1e-6), min_size=1, max_size=4),
        st.lists(numbers(), max_size=4),
        st.none(),
        st.text(max_size=3),
        numbers(),
    ),
)
def test_cost_model(base, bad, a_quad):
    scalars_ = [bad.get(i, v) for i, v in enumerate(base)]
    kwargs = dict(zip([f for f in COST_FIELDS if f != "a_quad"], scalars_), a_quad=a_quad)
    cost, err = outcome(rp.CostModel, **kwargs)
    valid = (
        all(finite_number_ok(kwargs[k], strict=k.startswith("bw_")) for k in kwargs if k != "a_quad")
        and isinstance(a_quad, list)
        and len(a_quad) >= 1
        and all(finite_number_ok(v) for v in a_quad)
    )
    assert (err is None) == valid, (err, kwargs)
    if cost is not None:
        assert rp.CostModel.from_json(cost.to_json()) == cost


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-10, 10),
        st.sampled_from([10**400, -(10**400)]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=4),
    ),
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
        rp.ModelShape(1, 2, 1, 10**200, 1), rp.Hardware.h200()
    ),
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


# ------------------------------------- numbers kept as Python ints and floats, whatever came in

NUMPY_INTS = st.sampled_from([int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
NUMPY_FLOATS = st.sampled_from([float, np.float32, np.float64, np.longdouble])


@FUZZ
@given(
    ep=st.sampled_from([1, 2, 4]),
    groups=st.integers(1, 3),
    gpn=st.sampled_from([1, 2, 4, 8]),
    spr=st.integers(1, 9),
    types=st.lists(NUMPY_INTS, min_size=4, max_size=4),
)
def test_topology_fields_are_python_ints(ep, groups, gpn, spr, types):
    args = [t(v) for t, v in zip(types, (ep * groups, ep, gpn, spr))]
    topo, err = outcome(rp.Topology, *args)
    assert err is None or "gpus_per_node" in str(err), err
    if topo is not None:
        for name in ("dp", "ep", "gpus_per_node", "slots_per_rank"):
            assert type(getattr(topo, name)) is int
        # arithmetic on the fields stays exact (a uint64 field made nodes_per_group overflow)
        assert topo.nodes_per_group == max(1, -(-ep // gpn)) and topo.num_slots == ep * spr
        topo.check_experts(types[0](topo.num_slots))


@FUZZ
@given(types=st.lists(NUMPY_INTS, min_size=7, max_size=7), ftypes=st.lists(NUMPY_FLOATS, min_size=17, max_size=17))
def test_model_hardware_and_cost_fields_are_python_numbers(types, ftypes):
    model = rp.ModelShape(
        *[t(v) for t, v in zip(types, (2, 8, 2, 64, 32))],
        attention=("full", "linear"),
        shared_experts=types[5](1),
        expert_groups=types[6](2),
    )
    assert all(type(getattr(model, f.name)) is int for f in dataclasses.fields(model) if f.name != "attention")
    f = iter(ftypes)
    hw = rp.Hardware("h", next(f)(1e15), next(f)(0.5), next(f)(1e11), next(f)(1e10), next(f)(0.5), next(f)(2e-6))
    assert all(type(getattr(hw, k)) is float for k in HW_FIELDS)
    cost = rp.CostModel(
        next(f)(1e-7),
        [next(f)(0.0), next(f)(1e-9)],
        next(f)(1e-7),
        next(f)(1e-6),
        next(f)(1e3),
        next(f)(1e10),
        next(f)(1e9),
        next(f)(1e6),
        next(f)(1e6),
        next(f)(1e6),
        expert_groups=types[0](2),
        num_experts=types[1](8),
    )
    assert all(type(v) is float for v in dataclasses.astuple(cost)[:10] if not isinstance(v, list))
    assert all(type(v) is float for v in cost.a_quad)
    assert type(cost.expert_groups) is int and type(cost.num_experts) is int


@FUZZ
@given(st.one_of(scalars(-3, 40), st.sampled_from([np.int64(3), np.uint8(0), 3.0, "2", [1]])))
def test_check_experts_takes_a_count(num_experts):
    topo = rp.Topology(4, 2, 2, 8)  # 16 slots
    _, err = outcome(topo.check_experts, num_experts)
    assert (err is None) == (is_int(num_experts) and 1 <= num_experts <= 16), err
    if err is not None:
        assert "num_experts" in str(err), err


# --------------------------------- a cost model must price some work; its files are UTF-8 JSON

WORK = ["a_lin", "c_tok", "c_exp", "token_bytes", "expert_weight_bytes", "expert_grad_bytes", "expert_state_bytes"]


@FUZZ
@given(priced=st.sets(st.sampled_from(WORK + ["a_quad"])), layers=st.integers(1, 4), value=st.floats(1e-12, 1e6))
def test_cost_model_pricing_nothing_is_refused(priced, layers, value):
    kw = {k: (value if k in priced else 0.0) for k in WORK}
    a_quad = [0.0] * layers
    if "a_quad" in priced:
        a_quad[-1] = value
    cost, err = outcome(rp.CostModel, a_quad=a_quad, bw_intra=1.0, bw_inter=1.0, **kw)
    assert (err is None) == bool(priced), err
    if err is not None:  # names every coefficient it looked at
        assert all(f"cost.{k}" in str(err) for k in WORK + ["a_quad"]), err


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=40),
        st.sampled_from(["utf-16", "latin-1", "utf-32"]).map(
            lambda enc: rp.traces.profile("tiny").cost().to_json().replace("a_lin", "ä_lin").encode(enc)
        ),
        st.just(rp.traces.profile("tiny").cost().to_json().encode("utf-8")),
    ),
    as_bytes=st.sampled_from([bytes, bytearray]),
)
def test_cost_json_from_bytes_and_files(raw, as_bytes, tmp_path_factory):
    cost, err = outcome(rp.CostModel.from_json, as_bytes(raw))
    assert err is None or "cost JSON" in str(err), err
    path = tmp_path_factory.mktemp("cost") / "c.json"
    path.write_bytes(raw)
    loaded, err2 = outcome(rp.CostModel.load, path)
    assert (loaded is None) == (cost is None) and (loaded is None or loaded == cost)
    if err2 is not None:
        assert isinstance(err2, rp.RoutepackFileError) and str(path) in str(err2), err2
