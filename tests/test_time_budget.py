"""`time_budget_s`: budgeted plans are valid, a budget too short for any search still returns
a plan, budgets too long to end (1e20, 3e19 s) are no budget at all (the same plan bytes), and
bad values are named. No wall-clock assertion: benches/time_budget.py measures the timing."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import routepack as rp
from routepack import _core

TINY = rp.traces.profile("tiny")
SMALL = replace(TINY, name="tiny_small", num_layers=4, attention=("linear",) * 3 + ("full",), samples=256)


@pytest.fixture(scope="module")
def setup():
    window = next(rp.traces.synthetic(SMALL, 1, seed=3))
    return window, SMALL.topology(), SMALL.cost(), SMALL.token_cap


def plan_bytes(p: rp.Plan) -> list:
    return [
        a.tobytes()
        for a in (
            p.sample_rank,
            p.sample_micro,
            np.asarray([p.num_micro]),
            p.placement.phy2log,
            p.replicas,
            p.migration,
        )
    ]


@pytest.mark.parametrize("budget", [1e-9, 0.01, 0.5])
def test_a_budgeted_plan_is_valid(setup, budget):
    window, topo, cost, cap = setup
    first = rp.plan_window(window, topo, cost, cap, "routepack")
    for previous in (None, first.placement):
        p = rp.plan_window(window, topo, cost, cap, "routepack", previous=previous, time_budget_s=budget)
        p.validate(window, topo, cap)
        shares = p.report["budget"]
        assert set(shares) == {"reserve", "placement", "packing", "replication"}
        assert all(v >= 0 for v in shares.values())
        assert p.report["time_budget_s"] == budget


def test_a_spent_budget_replicates_nothing(setup):
    window, topo, cost, cap = setup
    p = rp.plan_window(window, topo, cost, cap, "routepack", time_budget_s=1e-9)
    assert p.report["budget"]["replication"] == 0.0
    assert len(p.replicas) == 0


@pytest.mark.parametrize("budget", [1e20, 3e19, 2e9])
def test_budgets_too_long_to_end_change_nothing(setup, budget):
    window, topo, cost, cap = setup
    for policy in ("routepack", "eplb_oracle"):
        plain = rp.plan_window(window, topo, cost, cap, policy)
        long = rp.plan_window(window, topo, cost, cap, policy, time_budget_s=budget)
        assert plan_bytes(long) == plan_bytes(plain)


def core_calls(window, topo, cost, cap):
    place = rp.Placement.static(window.num_layers, window.num_experts, topo)
    packed = rp.plan_window(window, topo, cost, cap, "static")
    loads = window.layer_expert_load()
    chunks = _core.chunk_demand(window.seq_lens, window.expert_tokens, 2)
    return {
        "pack_routepack": lambda b: _core.pack_routepack(
            window.seq_lens, window.expert_tokens, topo, cost, place.phy2log, cap, time_budget_s=b
        ),
        "routepack_placement": lambda b: _core.routepack_placement(loads, chunks, topo, cost, time_budget_s=b),
        "replicate_routepack": lambda b: _core.replicate_routepack(
            rp.Plan(place, packed.sample_rank, packed.sample_micro, packed.num_micro),
            window.seq_lens,
            window.expert_tokens,
            topo,
            cost,
            time_budget_s=b,
        ),
    }


def test_core_budgets_never_panic(setup):
    for name, call in core_calls(*setup).items():
        for b in (1e20, 3e19, 1.8446744073709552e19, 1e10, 0.0, 1e-300):
            call(b)  # no "cannot convert float seconds to Duration", no Instant overflow
        assert len(core_calls(*setup)["replicate_routepack"](0.0)[0]) == 0


@pytest.mark.parametrize("bad", [-1.0, -1e-300, math.nan, math.inf, -math.inf])
def test_bad_budgets_are_named(setup, bad):
    for name, call in core_calls(*setup).items():
        with pytest.raises(rp.RoutepackError, match="time_budget_s"):
            call(bad)
    window, topo, cost, cap = setup
    with pytest.raises(rp.RoutepackError, match="time_budget_s"):
        rp.plan_window(window, topo, cost, cap, time_budget_s=bad)
