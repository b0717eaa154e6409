"""A cost model whose step time cannot be finite is refused, naming the coefficient (issue 40,
finding 6): a finite but huge ``c_migrate`` or ``c_replica`` (1.7e308, accepted before) made
every step with a migration or a replica cost ``inf``. The rule is the core's
(`cost/finite.rs`: no unit of a step's work may cost more than ``f64::MAX / 2^164`` seconds,
so 2^160 units of each of 16 terms stay finite), applied at `CostModel` construction, by
``from_json`` / ``load`` and at every core entry point. Under it, every step `simulate`
prices is finite."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import routepack as rp
from random_plans import random_case

#: the core's ceiling on one unit's price (cost/finite.rs: MAX_UNIT_SECONDS)
CEILING = np.finfo(np.float64).max / 2.0**164


@pytest.mark.parametrize("field", ["c_migrate", "c_replica"])
def test_the_measured_finding_is_refused_naming_the_coefficient(field):
    case = random_case(0)
    assert case.plan.replicas.size  # the plan whose step was inf with c_replica = 1.7e308
    with pytest.raises(rp.RoutepackError, match=rf"^cost\.{field}: .* could not be finite"):
        dataclasses.replace(case.cost, **{field: 1.7e308})
    text = case.cost.to_json().replace(f'"{field}": {getattr(case.cost, field)!r}', f'"{field}": 1.7e308')
    assert "1.7e308" in text
    with pytest.raises(rp.RoutepackError, match=rf"^cost\.{field}: "):
        rp.CostModel.from_json(text)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("c_tok", 1e300, "cost.c_tok"),
        ("a_lin", 1e270, "cost.a_lin"),
        ("token_bytes", 1e300, "cost.token_bytes"),
        ("bw_inter", 1e-300, "cost.bw_inter"),
        ("expert_state_bytes", 1e290, "cost.expert_state_bytes"),
        ("a_quad", [0.0, 1e300], "cost.a_quad[1]"),
        ("expert_table", ((1.0, 0.0), (4.0, 1e300)), "cost.expert_table[1]"),
    ],
)
def test_every_coefficient_that_prices_a_unit_is_bounded(field, value, named):
    base = rp.CostModel(1e-9, [0.0, 1e-13], 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)
    with pytest.raises(rp.RoutepackError, match="^" + re.escape(named) + ": "):
        dataclasses.replace(base, **{field: value})


def test_a_huge_but_bounded_coefficient_is_accepted_and_prices_finite_steps():
    case = random_case(0)
    # a replica hop at the ceiling itself: at the rule's edge, the step is still finite
    c_replica = CEILING / max(case.cost.expert_weight_bytes, case.cost.expert_grad_bytes) * 0.999
    cost = dataclasses.replace(case.cost, c_replica=c_replica)
    res = rp.simulate(case.plan, case.window, case.topo, cost)
    assert math.isfinite(res.step_time) and res.step_time > 1e250


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), field=st.sampled_from(["c_migrate", "c_replica", "c_tok", "a_lin", "c_call"]))
def test_every_accepted_cost_model_prices_a_finite_step(seed, field):
    case = random_case(seed)
    rng = np.random.default_rng(seed)
    value = float(10.0 ** rng.uniform(200, 308))
    try:
        cost = dataclasses.replace(case.cost, **{field: value})
    except rp.RoutepackError as e:
        assert str(e).startswith(f"cost.{field}: ") and "could not be finite" in str(e)
        return
    res = rp.simulate(case.plan, case.window, case.topo, cost)
    assert math.isfinite(res.step_time), (field, value, res.step_time)
