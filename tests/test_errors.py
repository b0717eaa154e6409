"""One error hierarchy: every input error across the public API is a `RoutepackError`
(a ValueError) or a `RoutepackTypeError` (a RoutepackError that is also a TypeError), so
``except routepack.RoutepackError`` catches all of them and ``except ValueError/TypeError``
keeps working; and no module of the package raises a bare ValueError or TypeError."""

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import FUZZ
from routepack import compare, placement, replay, stages

PACKAGE = Path(rp.__file__).parent

W = rp.Window(np.array([3, 4, 5, 6]), np.ones((4, 2, 4), np.int32))
TOPO = rp.Topology(2, 2, 2, 2)
COST = rp.CostModel.from_model(rp.ModelShape(2, 4, 2, 16, 8, attention=["linear", "full"]), rp.Hardware.h200())


def a_plan() -> rp.Plan:
    return rp.plan_window(W, TOPO, COST, 8, policy="static")


CASES = {
    # windows and routing replay
    "negative length": (lambda: rp.Window(np.array([3, -1]), np.ones((2, 1, 2), np.int32)), rp.RoutepackError),
    "float lengths": (lambda: rp.Window(np.array([3.0]), np.ones((1, 1, 2), np.int32)), rp.RoutepackTypeError),
    "negative demand": (lambda: rp.Window(np.array([3]), -np.ones((1, 1, 2), np.int32)), rp.RoutepackError),
    "no samples": (lambda: rp.Window(np.zeros(0, np.int64), np.zeros((0, 1, 2), np.int32)), rp.RoutepackError),
    "routed dtype": (
        lambda: rp.Window.from_routed_experts(np.zeros((2, 1, 1), np.float32), [0, 2], 4),
        rp.RoutepackTypeError,
    ),
    "routed shape": (lambda: rp.Window.from_routed_experts(np.zeros((2, 1), np.int32), [0, 2], 4), rp.RoutepackError),
    "expert id out of range": (
        lambda: rp.Window.from_routed_experts(np.full((2, 1, 1), 9, np.int32), [0, 2], 4),
        rp.RoutepackError,
    ),
    "verl mask shape": (
        lambda: replay.from_verl(np.zeros((2, 3, 1, 1), np.int32), np.ones((2, 2)), 4),
        rp.RoutepackError,
    ),
    "verl mask values": (
        lambda: rp.Window.from_verl(np.zeros((1, 2, 1, 1), np.int32), np.array([[1, 2]]), 4),
        rp.RoutepackError,
    ),
    "slime empty": (lambda: replay.from_slime([], 4), rp.RoutepackError),
    "slime num_experts": (lambda: rp.Window.from_slime([np.zeros((2, 1, 1), np.int32)], 0), rp.RoutepackError),
    # the cluster, the model, the cost
    "bad topology": (lambda: rp.Topology(6, 4, 2, 2), rp.RoutepackError),
    "topology type": (lambda: rp.Topology(2.0, 2, 2, 2), rp.RoutepackTypeError),
    "top_k > experts": (lambda: rp.ModelShape(2, 4, 8, 16, 8), rp.RoutepackError),
    "attention kind": (lambda: rp.ModelShape(1, 4, 2, 16, 8, attention=["sparse"]), rp.RoutepackError),
    "efficiency": (lambda: rp.Hardware(**{**rp.Hardware.h200().__dict__, "flops_efficiency": 2.0}), rp.RoutepackError),
    "cost JSON": (lambda: rp.CostModel.from_json('{"x": 1}'), rp.RoutepackError),
    "too few slots": (
        lambda: rp.plan_window(rp.Window(np.array([3]), np.ones((1, 2, 9), np.int32)), TOPO, COST, 8),
        rp.RoutepackError,
    ),
    # plans and placements
    "placement dtype": (lambda: rp.Placement(np.zeros((1, 4)), 4, 2), rp.RoutepackTypeError),
    "placement expert": (lambda: rp.Placement(np.full((1, 4), 7, np.int32), 4, 2), rp.RoutepackError),
    "replicas dtype": (
        lambda: rp.Plan(rp.Placement.static(2, 4, TOPO), [0, 0, 1, 1], [0, 0, 0, 0], 1, replicas=np.zeros(1)),
        rp.RoutepackTypeError,
    ),
    "invalid plan": (
        lambda: rp.Plan(rp.Placement.static(2, 4, TOPO), [0, 0, 0, 0], [0, 0, 0, 0], 1).validate(W, TOPO, 100),
        rp.InvalidPlanError,
    ),
    "simulate type": (lambda: rp.simulate("plan", W, TOPO, COST), rp.RoutepackTypeError),
    # plan_window
    "window type": (lambda: rp.plan_window("w", TOPO, COST), rp.RoutepackTypeError),
    "token_cap": (lambda: rp.plan_window(W, TOPO, COST, 0), rp.RoutepackError),
    "seed type": (lambda: rp.plan_window(W, TOPO, COST, 8, seed=1.5), rp.RoutepackTypeError),
    "sample over the cap": (lambda: rp.plan_window(W, TOPO, COST, 5), rp.InfeasibleError),
    "unknown preset": (lambda: rp.plan_window(W, TOPO, COST, 8, policy="nope"), rp.RoutepackError),
    "policy type": (lambda: rp.plan_window(W, TOPO, COST, 8, policy=3), rp.RoutepackTypeError),
    "unknown stage": (lambda: rp.plan_window(W, TOPO, COST, 8, policy=rp.Policy(packing="nope")), rp.RoutepackError),
    "unknown option": (lambda: rp.plan_window(W, TOPO, COST, 8, nope=1), rp.RoutepackError),
    "option value": (lambda: rp.plan_window(W, TOPO, COST, 8, placement_chunks=-1), rp.RoutepackError),
    "option type": (lambda: rp.plan_window(W, TOPO, COST, 8, placement_migration_aware="yes"), rp.RoutepackTypeError),
    "previous_window missing": (lambda: rp.plan_window(W, TOPO, COST, 8, policy="eplb"), rp.RoutepackError),
    "cost layers": (
        lambda: rp.plan_window(rp.Window(np.array([3]), np.ones((1, 3, 4), np.int32)), TOPO, COST, 8),
        rp.RoutepackError,
    ),
    "time budget": (lambda: rp.plan_window(W, TOPO, COST, 8, time_budget_s=-1.0), rp.RoutepackError),
    # placement analysis, presets, stages, traces, comparison
    "eplb weight": (lambda: placement.rebalance_experts(np.ones((2, 4), bool), 4, 1, 1, 2), rp.RoutepackTypeError),
    "imbalance loads": (lambda: placement.imbalance_lower_bound(np.ones(4), TOPO), rp.RoutepackError),
    "preset type": (lambda: rp.policies.register_preset("x", "static"), rp.RoutepackTypeError),
    "duplicate stage": (lambda: stages.register_packing("kk", lambda *a: None), rp.RoutepackError),
    "unknown profile": (lambda: rp.traces.profile("huge"), rp.RoutepackError),
    "synthetic seed": (lambda: list(rp.traces.synthetic("tiny", 1, -1)), rp.RoutepackError),
    "compare windows": (lambda: compare.compare([W], TOPO, COST, 8), rp.RoutepackError),
}


def test_the_hierarchy():
    assert issubclass(rp.RoutepackError, ValueError)
    assert issubclass(rp.RoutepackTypeError, rp.RoutepackError) and issubclass(rp.RoutepackTypeError, TypeError)
    for cls in (rp.InvalidPlanError, rp.InfeasibleError):
        assert issubclass(cls, rp.RoutepackError)
    assert rp.errors.RoutepackTypeError is rp.RoutepackTypeError


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_inputs_raise_routepack_errors(name):
    call, expected = CASES[name]
    with pytest.raises(rp.RoutepackError) as info:
        call()
    assert isinstance(info.value, expected), repr(info.value)


def test_no_bare_value_or_type_errors_in_the_package():
    """Input errors are raised as RoutepackError/RoutepackTypeError (or a subclass)."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError"):
                    raise AssertionError(f"{path}:{node.lineno}: raise {exc.id}")


def test_a_valid_plan_still_plans():
    a_plan().validate(W, TOPO, 8)


@FUZZ
@given(junk=st.sampled_from([None, "w", 3, [], np.zeros(3)]), where=st.integers(0, 2), n=st.integers(2, 3))
def test_compare_names_the_window_entry_that_is_no_window(junk, where, n):
    windows = [W] * n
    windows[min(where, n - 1)] = junk
    with pytest.raises(rp.RoutepackTypeError, match=rf"^windows\[{min(where, n - 1)}\]: expected a routepack.Window"):
        compare.compare(windows, TOPO, COST, 8, ["static"])
