"""Valid inputs the targets start from (and tamper with): windows and plans that pass
`Plan.validate`, with what made them."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import routepack as rp

from random_plans import TOPOLOGIES, random_case, random_window


def consistent_window(rng: np.random.Generator) -> rp.Window:
    S, L, E = int(rng.integers(1, 24)), int(rng.integers(1, 5)), int(rng.integers(1, 17))
    return random_window(rng, S, L, E, max_len=int(rng.choice([5, 40, 300])))


@dataclass
class PlanCase:
    plan: rp.Plan
    window: rp.Window
    topo: rp.Topology
    cost: rp.CostModel
    cap: int


def max_cell(plan: rp.Plan, window: rp.Window) -> int:
    cell = plan.sample_rank.astype(np.int64) * plan.num_micro + plan.sample_micro
    return int(np.bincount(cell, weights=window.seq_lens.astype(np.float64)).max())


def valid_plan(rng: np.random.Generator, ep2: bool = False) -> PlanCase:
    seed = int(rng.integers(2**31))
    c = random_case(seed, TOPOLOGIES[seed % 4] if ep2 else None)
    cap = max_cell(c.plan, c.window) + int(rng.choice([0, 0, 1, 50, 10**6]))
    return PlanCase(c.plan, c.window, c.topo, c.cost, cap)


def fresh(plan: rp.Plan) -> rp.Plan:
    """A deep copy (a case tampers with its own plan only)."""
    return copy.deepcopy(plan)
