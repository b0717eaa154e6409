"""`simulate(..., validate=True)`: `Plan.validate` and the simulator in one core call (what
`plan_window` runs on the plan it assembles). For random plans and caps on both sides of each
plan's largest row it raises exactly when `plan.validate(window, topo, cap)` raises, with the
same error, and otherwise returns what `simulate` returns, field for field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from random_plans import random_case


def _largest_row(plan: rp.Plan, window: rp.Window, dp: int) -> int:
    cells = np.zeros(dp * plan.num_micro, dtype=np.int64)
    np.add.at(cells, plan.sample_rank.astype(np.int64) * plan.num_micro + plan.sample_micro, window.seq_lens)
    return int(cells.max())


def _same(a: rp.SimResult, b: rp.SimResult) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif x != y and not (x != x and y != y):
            return False
    return True


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shift=st.integers(-3, 3))
def test_validate_true_is_validate_then_simulate(seed: int, shift: int) -> None:
    case = random_case(seed)
    w, topo, cost, plan = case.window, case.topo, case.cost, case.plan
    cap = max(1, _largest_row(plan, w, topo.dp) + shift)
    try:
        plan.validate(w, topo, cap)
        expected = None
    except rp.InvalidPlanError as e:
        expected = str(e)
    if expected is not None:
        with pytest.raises(rp.InvalidPlanError) as got:
            rp.simulate(plan, w, topo, cost, cap, validate=True)
        assert str(got.value) == expected
        return
    assert _same(rp.simulate(plan, w, topo, cost, cap, validate=True), rp.simulate(plan, w, topo, cost, cap))


def test_validate_needs_a_cap_and_a_bool() -> None:
    case = random_case(3)
    with pytest.raises(rp.RoutepackError, match="token_cap"):
        rp.simulate(case.plan, case.window, case.topo, case.cost, validate=True)
    with pytest.raises(rp.RoutepackError, match="validate"):
        rp.simulate(case.plan, case.window, case.topo, case.cost, 100, validate=1)
