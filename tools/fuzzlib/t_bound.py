"""Target of the step time's lower bound (docs/design.md, "Lower bound"): no plan beats
`SimResult.lower_bound_time`. Each case plans a random window with one preset (or builds a
random valid plan, replicas within the buffers) on a random topology, replica buffers from
none to plenty, a random cost model (every option drawn) and a cap a plan fits, and checks
that `simulate` scores it at or above the bound, that the bound depends on the inputs alone
(the lone bound agrees with the plan's) and that a looser cap gives a lower one.
``lower_bound[split]`` does the same for windows with samples over the cap planned with
``oversize="split"`` over CP groups of 2 or ep ranks (each split sample alone at a CP group's
first rank, the group's other cells at its microbatch empty).
``tools/fuzz_campaign.py --only lower_bound`` runs only these."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Tuple

import numpy as np
import routepack as rp

from random_plans import TOPOLOGIES, random_case, random_cost, random_layout, random_window
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.checks import check_plan, check_sim

#: Replica buffers a rank: none, a few, the default, more than an exchange can use.
BUFFERS = (0, 1, 2, 3, 3, 5, 64)
NAMES = ("window", "topo", "cost", "token_cap", "policy", "seed", "replica_slots")


def skewed_window(rng: np.random.Generator, samples: int, layers: int, experts: int) -> rp.Window:
    """A uniform random window, or half the time one whose samples lean on one topic expert
    each (so placement and layout have something to exploit and the bound's top-k sums bind)."""
    w = random_window(rng, samples, layers, experts, max_len=int(rng.choice([40, 300])))
    if rng.random() < 0.5:
        return w
    tokens = w.expert_tokens.copy()
    for s in range(samples):
        hot = int(rng.integers(experts))
        n = int(w.seq_lens[s])
        tokens[s, :, hot] = n
        tokens[s, :, (hot + 1) % experts] = n // 2
    return rp.Window(w.seq_lens, tokens)


def inputs(rng: np.random.Generator) -> Tuple[rp.Window, rp.Topology, rp.CostModel, int, rp.Window]:
    """A random (window, topology, cost, cap, previous window) some plan of every preset fits:
    the cap is at least the largest cell of a random layout."""
    dp, ep, gpn, spr = TOPOLOGIES[int(rng.integers(len(TOPOLOGIES)))]
    topo = rp.Topology(dp, ep, gpn, spr, replica_slots=int(rng.choice(BUFFERS)))
    layers = int(rng.integers(1, 4))
    experts = int(rng.integers(max(1, topo.num_slots // 2), topo.num_slots + 1))
    micro = int(rng.integers(1, 4))
    samples = dp * micro + int(rng.integers(0, 2 * dp + 1))
    window = skewed_window(rng, samples, layers, experts)
    rank, mb = random_layout(rng, samples, dp, micro)
    cells = np.bincount(rank.astype(np.int64) * micro + mb, weights=window.seq_lens.astype(np.float64))
    cap = int(cells.max()) + int(rng.choice([0, 0, 5, 100, 10**6]))
    previous = skewed_window(rng, samples, layers, experts)
    return window, topo, random_cost(rng, layers), cap, previous


def bound_check(window: Any, topo: Any, cost: Any, cap: int):
    """The check of a (plan, SimResult) pair: the plan is valid, the step at or above the
    bound with no tolerance (the bound is one as computed: its rounding margin, routepack-core's
    bound, "In floating point"), the bound the plan's inputs alone give, and no cap gives a
    higher bound than the plan's own."""

    def check(out: Any) -> None:
        plan, res = out
        check_plan(plan, window, topo, cap)
        check_sim(res, plan, window, topo)
        assert res.step_time >= res.lower_bound_time, f"step {res.step_time} below the bound {res.lower_bound_time}"
        # the bound depends on the window, topology, cost and cap only
        alone = rp.simulate(rp.plan_window(window, topo, cost, cap, policy="static"), window, topo, cost, cap)
        assert math.isclose(alone.lower_bound_time, res.lower_bound_time, rel_tol=1e-12), "bound depends on the plan"
        # without a cap (the report's cap left out too): the weakest bound
        loose = rp.simulate(dataclasses.replace(plan, report={}), window, topo, cost)
        assert loose.lower_bound_time <= res.lower_bound_time * (1 + 1e-12), "a looser cap raised the bound"

    return check


def preset_case(rng: np.random.Generator) -> Case:
    window, topo, cost, cap, previous = inputs(rng)
    policy = str(rng.choice(sorted(rp.PRESETS)))
    kwargs: Dict[str, Any] = {"policy": policy, "seed": int(rng.integers(0, 2**32)), "anneal_moves": 300}
    kwargs["previous_window"] = previous
    if rng.random() < 0.5:
        options = {
            "replication_hot_experts": int(rng.integers(1, 6)),
            "replication_slots": int(rng.integers(0, 6)),
        }
        kwargs.update({k: v for k, v in options.items() if rng.random() < 0.5})

    def plan_and_score(w: Any, t: Any, c: Any, cap_: int, **kw: Any) -> Any:
        plan = rp.plan_window(w, t, c, cap_, **kw)
        return plan, rp.simulate(plan, w, t, c, cap_)

    plan_and_score.__qualname__ = "plan_window + simulate"
    return Case(
        "valid",
        plan_and_score,
        (window, topo, cost, cap),
        kwargs,
        check=bound_check(window, topo, cost, cap),
        expect="ok",
        note=f"{policy}, replica_slots={topo.replica_slots}",
        names=NAMES,
    )


def random_plan_case(rng: np.random.Generator) -> Case:
    """A random valid plan (random placement with redundant copies, layout, replicas within
    the buffers, migration) under the cap its largest cell sets."""
    seed = int(rng.integers(0, 2**31))
    buffers = int(rng.choice(BUFFERS))
    case = random_case(seed, replica_slots=buffers)
    cells = np.bincount(
        case.plan.sample_rank.astype(np.int64) * case.plan.num_micro + case.plan.sample_micro,
        weights=case.window.seq_lens.astype(np.float64),
    )
    cap = int(cells.max()) + int(rng.choice([0, 7]))

    def score(plan: Any, w: Any, t: Any, c: Any, cap_: int) -> Any:
        return plan, rp.simulate(plan, w, t, c, cap_)

    score.__qualname__ = "simulate (random plan)"
    return Case(
        "valid",
        score,
        (case.plan, case.window, case.topo, case.cost, cap),
        check=bound_check(case.window, case.topo, case.cost, cap),
        expect="ok",
        note=f"random_case({seed}, replica_slots={buffers})",
        names=NAMES,
    )


def split_check(window: Any, topo: Any, cost: Any, cap: int, over: np.ndarray):
    """The check of a split plan: valid under "split" (from its report), each over-cap sample
    alone at the first rank of a CP group with the group's other cells at its microbatch empty,
    the step at or above the bound, and the bound the inputs alone give."""

    def check(out: Any) -> None:
        plan, res = out
        plan.validate(window, topo, cap)
        M, cp = plan.num_micro, topo.cp
        cell = plan.sample_rank.astype(np.int64) * M + plan.sample_micro
        size = np.bincount(cell, minlength=topo.dp * M)
        for s in over.tolist():
            assert plan.sample_rank[s] % cp == 0 and size[cell[s]] == 1, (
                f"split sample {s} not alone at a group's start"
            )
            assert all(size[cell[s] + j * M] == 0 for j in range(1, cp)), f"split sample {s} shares its group's cells"
        assert res.step_time >= res.lower_bound_time, f"step {res.step_time} below the bound {res.lower_bound_time}"
        kw = {"oversize": "split"}
        other = rp.simulate(rp.plan_window(window, topo, cost, cap, policy="static", **kw), window, topo, cost, cap)
        assert math.isclose(other.lower_bound_time, res.lower_bound_time, rel_tol=1e-12), "bound depends on the plan"

    return check


def split_case(rng: np.random.Generator) -> Case:
    """A window with 1-3 samples over the cap (at most cp x cap) and enough short ones (at most
    a quarter of the cap each) to fill the cells, planned with oversize="split"."""
    dp, ep, gpn, spr = [t for t in TOPOLOGIES if t[1] >= 2][
        int(rng.integers(len([t for t in TOPOLOGIES if t[1] >= 2])))
    ]
    cp = int(rng.choice([2, ep])) if ep % 2 == 0 else ep
    topo = rp.Topology(dp, ep, gpn, spr, cp=cp, replica_slots=int(rng.choice(BUFFERS)))
    layers = int(rng.integers(1, 4))
    experts = int(rng.integers(max(1, topo.num_slots // 2), topo.num_slots + 1))
    cap = int(rng.integers(40, 300))
    k = int(rng.integers(1, 4))
    short = 2 * dp + 3 + int(rng.integers(0, 2 * dp + 1))
    w = skewed_window(rng, short + k, layers, experts)
    lens = np.minimum(w.seq_lens, cap // 4)
    over = np.sort(rng.choice(short + k, size=k, replace=False))
    lens[over] = rng.integers(cap + 1, cp * cap + 1, size=k)
    window = rp.Window(lens, np.minimum(w.expert_tokens, lens[:, None, None]).astype(np.int32))
    policy = str(rng.choice(sorted(rp.PRESETS)))
    kwargs: Dict[str, Any] = {"policy": policy, "seed": int(rng.integers(0, 2**32)), "anneal_moves": 300}
    kwargs["previous_window"] = window
    kwargs["oversize"] = "split"

    def plan_and_score(w_: Any, t: Any, c: Any, cap_: int, **kw: Any) -> Any:
        plan = rp.plan_window(w_, t, c, cap_, **kw)
        return plan, rp.simulate(plan, w_, t, c, cap_)

    plan_and_score.__qualname__ = "plan_window + simulate (split)"
    cost = random_cost(rng, layers)
    return Case(
        "valid",
        plan_and_score,
        (window, topo, cost, cap),
        kwargs,
        check=split_check(window, topo, cost, cap, over),
        expect="ok",
        note=f"{policy}, cp={cp}, {k} split",
        names=NAMES,
    )


TARGETS = [
    Target("lower_bound[preset]", rp.simulate, mixed((1, preset_case)), weight=2, names=NAMES, batch=16),
    Target("lower_bound[random plan]", rp.simulate, mixed((1, random_plan_case)), weight=1, names=NAMES, batch=16),
    Target("lower_bound[split]", rp.simulate, mixed((1, split_case)), weight=1, names=NAMES, batch=16),
]
