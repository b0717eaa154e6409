"""Targets of `routepack.plan_window`: one per preset (valid and odd-but-valid inputs, whose
plans must validate), custom `Policy` combinations, malformed arguments, and options
(malformed, and absurd sizes that must be refused before they are allocated)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import routepack as rp
from routepack.stages import PACKINGS, PLACEMENTS, REPLICATIONS, known_options

from random_plans import random_cost, random_layout, random_phy2log, random_window
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import BAD_FLOATS, BAD_INTS, BAD_OBJECTS, bad_for, is_huge, pick
from fuzzlib.checks import check_plan, check_sim

OPTION_NAMES = tuple(sorted(known_options()))
MAX = 2**63 - 1
#: each option's documented domain: (kind, low, high) — independent of the dataclasses' checks
DOMAIN: Dict[str, Tuple[str, float, float]] = {
    "placement_chunks": ("int", 0, MAX),
    "placement_cells": ("int?", 1, MAX),
    "placement_slack": ("float", 0, 1),
    "placement_explore": ("float?", 0, 1),
    "placement_fluct_evals": ("int", 0, MAX),
    "placement_migration_aware": ("bool", 0, 1),
    "eplb_num_groups": ("int?", 1, MAX),
    "anneal_chains": ("int", 1, MAX),
    "anneal_steps": ("int", 1, MAX),
    "anneal_lambda": ("float", 0, math.inf),
    "anneal_start_accept": ("open", 0, 1),
    "anneal_cooling": ("lopen", 0, 1),
    "anneal_mix": ("mix", 0, 0),
    "packing_exact_nodes": ("int", 0, 2**64 - 1),
    "replication_hot_experts": ("int", 1, MAX),
    "replication_slots": ("int", 0, MAX),
    "replication_candidates": ("int", 1, MAX),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def in_domain(name: str, v: Any) -> bool:
    kind, lo, hi = DOMAIN[name]
    if kind.endswith("?") and v is None:
        return True
    kind = kind.rstrip("?")
    if kind == "int":
        return _is_int(v) and lo <= v <= hi
    if kind == "bool":
        return isinstance(v, (bool, np.bool_))
    if kind == "mix":
        try:
            items = list(v) if isinstance(v, (list, tuple, np.ndarray)) else None
        except TypeError:
            return False
        return (
            items is not None
            and len(items) == 4
            and all(_is_num(x) and math.isfinite(float(x)) and x >= 0 for x in items)
            and any(float(x) for x in items)
        )
    if not _is_num(v):
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    if not math.isfinite(f):
        return False
    if kind == "open":
        return lo < f < hi
    if kind == "lopen":
        return lo < f <= hi
    return lo <= f <= hi


PLANNER_NAMES = (
    "window",
    "topo",
    "cost",
    "token_cap",
    "policy",
    "previous",
    "previous_window",
    "seed",
    "anneal_moves",
    "time_budget_s",
    "options",
    "cost.a_quad",
    "seq_lens",
    "expert_tokens",
    "num_experts",
    "topo.ep",
    "topo.dp",
    "sample",
    "exact_nodes",
    "replica_slots",
    "hot_experts",
) + OPTION_NAMES

#: small topologies (dp, ep, gpus_per_node, slots_per_rank): one rank, one group, several
#: groups, groups over nodes, several groups a node
TOPOS = [
    (1, 1, 1, 1),
    (1, 1, 1, 3),
    (2, 1, 1, 2),
    (2, 2, 1, 2),
    (2, 2, 2, 3),
    (4, 2, 2, 2),
    (4, 4, 2, 2),
    (4, 2, 1, 3),
    (6, 3, 3, 2),
    (8, 4, 2, 2),
    (8, 8, 4, 1),
    (6, 6, 3, 1),
]


@dataclass
class Inputs:
    window: rp.Window
    topo: rp.Topology
    cost: rp.CostModel
    cap: int
    kwargs: Dict[str, Any]


def random_options(rng: np.random.Generator, E: int) -> Dict[str, Any]:
    """A few options with valid random values."""
    slack = float(rng.uniform(0, 0.2))
    pool: Dict[str, Any] = {
        "placement_chunks": int(rng.integers(0, 40)),
        "placement_cells": int(rng.integers(1, 20)),
        "placement_slack": slack,
        "placement_explore": float(rng.uniform(slack, 1.0)),
        "placement_fluct_evals": int(rng.integers(0, 2000)),
        "placement_migration_aware": bool(rng.random() < 0.5),
        "eplb_num_groups": int(rng.choice([g for g in range(1, E + 1) if E % g == 0])),
        "anneal_chains": int(rng.integers(1, 4)),
        "anneal_steps": int(rng.integers(1, 40)),
        "anneal_lambda": float(rng.uniform(0, 2)),
        "anneal_start_accept": float(rng.uniform(0.01, 0.99)),
        "anneal_cooling": float(rng.uniform(1e-4, 1.0)),
        "anneal_mix": tuple(float(x) for x in rng.random(4) * (rng.random(4) < 0.7)) or (1.0, 0, 0, 0),
        "packing_exact_nodes": int(rng.choice([0, 10, 1000, 200000])),
        "replication_hot_experts": int(rng.integers(1, 5)),
        "replication_slots": int(rng.integers(0, 4)),
        "replication_candidates": int(rng.integers(1, 3)),
    }
    if not any(pool["anneal_mix"]):
        pool["anneal_mix"] = (0.0, 1.0, 0.0, 0.0)
    names = rng.choice(sorted(pool), size=int(rng.integers(0, 5)), replace=False)
    return {str(n): pool[str(n)] for n in names}


def random_inputs(rng: np.random.Generator, policy: Any, edge: Optional[str] = None) -> Inputs:
    """Feasible inputs by construction: the cap is at least the largest cell of a random
    layout of the window (so a plan exists); ``previous_window`` for policies that need it."""
    # spare buffers a rank (Topology.replica_slots): the default, none, a few, the most
    spare = {} if rng.random() < 0.6 else {"replica_slots": int(rng.choice([0, 1, 2, 8, 2**31 - 1]))}
    topo = rp.Topology(*TOPOS[int(rng.integers(len(TOPOS)))], **spare)
    L = int(rng.integers(1, 4))
    E = int(rng.integers(1, topo.num_slots + 1))
    M = int(rng.integers(1, 4))
    S = topo.dp * M + int(rng.integers(0, 2 * topo.dp + 2))
    window = random_window(rng, S, L, E, max_len=int(rng.choice([8, 40, 300])))
    rank, micro = random_layout(rng, S, topo.dp, M)
    cells = np.bincount(rank.astype(np.int64) * M + micro, weights=window.seq_lens.astype(np.float64))
    cap = int(cells.max()) + int(rng.choice([0, 0, 3, 100, 10**6]))
    cost = random_cost(rng, L)
    kw: Dict[str, Any] = {
        "policy": policy,
        "seed": pick(rng, [0, 1, 12345, 2**64 - 1]),
        "anneal_moves": int(rng.choice([0, 200, 2000, 20000])) if rng.random() > 0.04 else None,
    }
    if rng.random() < 0.4:
        kw["previous"] = (
            rp.Placement.static(L, E, topo)
            if rng.random() < 0.5
            else rp.Placement(random_phy2log(rng, L, E, topo), E, topo.slots_per_rank)
        )
    if rng.random() < 0.6 or _needs_previous_window(policy):
        kw["previous_window"] = random_window(rng, int(rng.integers(1, S + 3)), L, E)
    if rng.random() < 0.15:
        kw["time_budget_s"] = float(rng.choice([1e-6, 0.01, 0.3, 1e10]))
    kw.update(random_options(rng, E))
    inp = Inputs(window, topo, cost, cap, kw)
    if edge:
        apply_edge(rng, inp, edge)
    return inp


def _needs_previous_window(policy: Any) -> bool:
    pol = rp.PRESETS.get(policy) if isinstance(policy, str) else policy
    return isinstance(pol, rp.Policy) and pol.loads == "previous"


EDGES = (
    "zero_weight",
    "zero_cost",
    "one_sample",
    "dp1_many",
    "huge_cap",
    "near_2_61",
    "tight_cap",
    "no_spare_slots",
    "one_expert",
    "tiny_budget",
    "huge_budget",
    "max_seed",
    "zero_tokens_some",
)


def apply_edge(rng: np.random.Generator, inp: Inputs, edge: str) -> None:
    w, L, E = inp.window, inp.window.num_layers, inp.window.num_experts
    if edge in ("zero_weight", "zero_tokens_some"):
        tokens = w.expert_tokens.copy()
        tokens[rng.random(w.num_samples) < (0.5 if edge == "zero_tokens_some" else 1.0)] = 0
        inp.window = rp.Window(w.seq_lens, tokens)
        if edge == "zero_weight":
            inp.cost = dataclasses.replace(inp.cost, a_lin=0.0, a_quad=[0.0] * L)
    elif edge == "zero_cost":
        # a cost model pricing migration alone (one pricing nothing is refused): a step of 0 s
        # without ``previous``, migration only with it
        inp.cost = rp.CostModel(0.0, [0.0] * L, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1e6)
    elif edge == "one_sample":
        inp.topo = rp.Topology(1, 1, 1, max(E, int(rng.integers(1, 4))))
        inp.window = rp.Window(w.seq_lens[:1], w.expert_tokens[:1])
        inp.cap = int(w.seq_lens[0]) + int(rng.choice([0, 5]))
        _fit_previous(inp)
    elif edge == "dp1_many":
        inp.topo = rp.Topology(1, 1, 1, max(E, 1))
        inp.cap = max(inp.cap, int(w.seq_lens.max()))
        _fit_previous(inp)
    elif edge == "huge_cap":
        inp.cap = pick(rng, [2**40, 2**62, 2**63 - 1])
    elif edge == "near_2_61":
        # up to three samples near 2**61 (the rest as they were): sums of rows pass 2**62 while
        # the window's total still fits int64, which `Window` requires
        lens = w.seq_lens.copy()
        big = min(3, w.num_samples)
        lens[:big] = 2**61 - rng.integers(0, 1000, big)
        inp.window = rp.Window(lens, w.expert_tokens)
        inp.cap = 2**63 - 1
        inp.kwargs.pop("previous_window", None)
        if _needs_previous_window(inp.kwargs["policy"]):
            inp.kwargs["previous_window"] = inp.window
    elif edge == "tight_cap":
        pass  # random_inputs' cap with zero slack is already tight in half the cases
    elif edge == "no_spare_slots":
        inp.window = retoken(rng, w, inp.topo.num_slots)
        inp.kwargs.pop("previous", None)
        inp.kwargs.pop("eplb_num_groups", None)
        if "previous_window" in inp.kwargs:
            inp.kwargs["previous_window"] = random_window(rng, 3, L, inp.topo.num_slots)
    elif edge == "one_expert":
        inp.window = rp.Window(w.seq_lens, w.expert_tokens[:, :, :1].copy())
        inp.kwargs.pop("previous", None)
        inp.kwargs.pop("eplb_num_groups", None)
        if "previous_window" in inp.kwargs:
            inp.kwargs["previous_window"] = rp.Window(
                inp.kwargs["previous_window"].seq_lens, inp.kwargs["previous_window"].expert_tokens[:, :, :1].copy()
            )
    elif edge == "tiny_budget":
        inp.kwargs["time_budget_s"] = float(rng.choice([1e-9, 1e-4]))
    elif edge == "huge_budget":
        inp.kwargs["time_budget_s"] = float(rng.choice([1e9 + 1, 3e19, 1e20, 1e300]))
    elif edge == "max_seed":
        inp.kwargs["seed"] = 2**64 - 1


def retoken(rng: np.random.Generator, w: rp.Window, num_experts: int) -> rp.Window:
    """``w``'s lengths with new expert counts over ``num_experts`` experts (each <= its length)."""
    fresh = random_window(rng, w.num_samples, w.num_layers, num_experts)
    return rp.Window(w.seq_lens, np.minimum(fresh.expert_tokens, w.seq_lens[:, None, None]).astype(np.int32))


def _fit_previous(inp: Inputs) -> None:
    prev = inp.kwargs.get("previous")
    if prev is not None and (prev.num_slots != inp.topo.num_slots or prev.slots_per_rank != inp.topo.slots_per_rank):
        del inp.kwargs["previous"]


def plan_check(args: Any, kwargs: Dict[str, Any]):
    """The plan of ``plan_window(*args, **kwargs)``: `check_plan`, the report's cap, migration
    from ``previous``, and `simulate` agreeing with the report's prediction."""
    window, topo, cost, cap = args

    def check(plan: Any) -> None:
        assert isinstance(window, rp.Window) and isinstance(topo, rp.Topology) and isinstance(cost, rp.CostModel)
        check_plan(plan, window, topo, cap)
        assert plan.report["token_cap"] == cap
        prev = kwargs.get("previous")
        if prev is None:
            assert len(plan.migration) == 0, "migration rows without a previous placement"
        else:
            for row in plan.migration:
                assert prev.phy2log[row["layer"], row["src_slot"]] == row["expert"], "a move from a slot not holding it"
        res = rp.simulate(plan, window, topo, cost)
        check_sim(res, plan, window, topo)
        pred = plan.report["predicted"]["step_time"]
        assert math.isclose(pred, res.step_time, rel_tol=1e-9), "report's predicted step time != simulate"

    return check


def preset_case(policy: Any):
    def make(rng: np.random.Generator) -> Case:
        r = rng.random()
        edge = None
        if r < 0.35:
            edge = EDGES[int(rng.integers(len(EDGES)))]
        inp = random_inputs(rng, policy, edge)
        expect = None if edge == "near_2_61" else "ok"
        return Case(
            "edge" if edge else "valid",
            rp.plan_window,
            (inp.window, inp.topo, inp.cost, inp.cap),
            dict(inp.kwargs),
            check=plan_check((inp.window, inp.topo, inp.cost, inp.cap), inp.kwargs),
            expect=expect,
            note=edge or "",
            names=PLANNER_NAMES,
        )

    return make


def first_fit_case(rng: np.random.Generator) -> Case:
    """Issue 13 class 4: a feasible window with a cap tight enough that first fit alone
    leaves a count of rows no multiple of dp (the issue's own example half of the time)."""
    if rng.random() < 0.5:
        lens = np.array([1209, 1867, 306, 668, 1833, 959, 1189, 1682, 781, 277])
        topo, cap = rp.Topology(6, 6, 3, 1), 1867
    else:
        dp = int(rng.choice([2, 3, 4, 6]))
        topo = rp.Topology(dp, dp, 1, 1)
        S = dp + int(rng.integers(0, 3 * dp))
        lens = rng.integers(100, 2000, size=S)
        rank, micro = random_layout(rng, S, dp, 1)
        cap = int(np.bincount(rank, weights=lens.astype(float)).max())
    E = topo.num_slots
    window = random_window(rng, len(lens), 1, E, max_len=5)
    window = rp.Window(lens, np.minimum(window.expert_tokens, lens[:, None, None]).astype(np.int32))
    cost = random_cost(rng, 1)
    policy = str(rng.choice(["static", "hot_n", "relibra", "routepack_placement", "eplb_oracle"]))
    inp = Inputs(window, topo, cost, cap, {"policy": policy, "anneal_moves": 500})
    return Case(
        "edge",
        rp.plan_window,
        (window, topo, cost, cap),
        dict(inp.kwargs),
        check=plan_check((inp.window, inp.topo, inp.cost, inp.cap), inp.kwargs),
        expect="ok",
        note="a feasible window first fit cannot split over dp",
        names=PLANNER_NAMES,
    )


def policy_combo_case(rng: np.random.Generator) -> Case:
    pol = rp.Policy(
        str(rng.choice(sorted(PLACEMENTS))),
        str(rng.choice(sorted(PACKINGS))),
        str(rng.choice(sorted(REPLICATIONS))),
        str(rng.choice(["window", "previous"])),
    )
    return preset_case(pol)(rng)


def args_case(rng: np.random.Generator) -> Case:
    inp = random_inputs(rng, str(rng.choice(sorted(rp.PRESETS))))
    args: List[Any] = [inp.window, inp.topo, inp.cost, inp.cap]
    kw = dict(inp.kwargs)
    which = str(
        rng.choice(
            [
                "window",
                "topo",
                "cost",
                "token_cap",
                "policy",
                "previous",
                "previous_window",
                "seed",
                "anneal_moves",
                "time_budget_s",
                "mismatch",
            ]
        )
    )
    note = which
    if which in ("window", "topo", "cost"):
        args[["window", "topo", "cost"].index(which)] = pick(rng, BAD_OBJECTS)
    elif which == "token_cap":
        args[3] = pick(rng, BAD_INTS + [int(inp.window.seq_lens.max()) - 1])
    elif which == "policy":
        kw["policy"] = pick(
            rng,
            [
                "",
                "nope",
                "Static",
                None,
                3,
                b"static",
                ["static"],
                rp.Policy("nope"),
                rp.Policy(loads="both"),
                rp.Policy(packing=None),
                rp.Policy(replication=3),
            ],
        )
    elif which in ("previous", "previous_window"):
        kw[which] = pick(rng, BAD_OBJECTS + [rp.Placement.static(1, 1, rp.Topology(1, 1, 1, 1))])
    elif which in ("seed", "anneal_moves"):
        kw[which] = pick(rng, BAD_INTS)
        if which == "anneal_moves" and is_huge(kw[which]):
            # a valid budget of billions of moves: the time budget must stop it
            kw["time_budget_s"] = 0.5
            note = "anneal_moves huge under time_budget_s=0.5"
    elif which == "time_budget_s":
        kw[which] = pick(rng, BAD_FLOATS + [0, 0.0, -1.0])
    else:
        L, E = inp.window.num_layers, inp.window.num_experts
        m = int(rng.integers(4))
        if m == 0:
            args[2] = dataclasses.replace(inp.cost, a_quad=inp.cost.a_quad + [0.0])
            note = "cost has another layer count"
        elif m == 1:
            args[1] = rp.Topology(inp.topo.dp, inp.topo.ep, inp.topo.gpus_per_node, 1)
            note = "fewer slots than experts" if E > inp.topo.ep else "one slot a rank"
        elif m == 2:
            kw["previous_window"] = rp.Window(np.array([3]), np.zeros((1, L, E + 1), np.int32))
            note = "previous_window E+1"
        else:
            args[0] = rp.Window(
                inp.window.seq_lens[: max(1, inp.topo.dp - 1)], inp.window.expert_tokens[: max(1, inp.topo.dp - 1)]
            )
            note = "fewer samples than DP ranks"
    return Case(
        "malformed", rp.plan_window, tuple(args), kw, check=plan_check(args, kw), note=note, names=PLANNER_NAMES
    )


#: absurd option values: each must be refused before anything is allocated, or plan quickly
ABSURD = [
    {"anneal_chains": 10**8, "anneal_moves": 10**12},
    {"anneal_steps": 10**9, "anneal_moves": 10**12},
    {"anneal_steps": 2**62, "anneal_moves": 2**63 - 1},
    {"anneal_chains": 2**62},
    {"anneal_moves": 2**63 - 1, "time_budget_s": 0.5},
    {"packing_exact_nodes": 2**64 - 1},
    {"placement_chunks": 10**12},
    {"placement_cells": 2**62},
    {"placement_fluct_evals": 2**62},
    {"replication_slots": 2**62},
    {"replication_candidates": 2**40},
    {"replication_hot_experts": 2**62},
    {"eplb_num_groups": 2**62},
    {"time_budget_s": 1e20},
    {"time_budget_s": 3e19},
    {"seed": 2**64 - 1, "anneal_chains": 64, "anneal_moves": 10**5},
]


def options_case(rng: np.random.Generator) -> Case:
    policy = str(rng.choice(sorted(rp.PRESETS)))
    inp = random_inputs(rng, policy)
    kw = {k: v for k, v in inp.kwargs.items() if k not in known_options()}
    r = rng.random()
    kind, expect = "malformed", None
    if r < 0.3:
        kind = "absurd"
        kw.update(ABSURD[int(rng.integers(len(ABSURD)))])
        note = "absurd " + ", ".join(
            f"{k}={v}" for k, v in kw.items() if k not in ("policy", "previous", "previous_window")
        )
    elif r < 0.45:
        kw[str(rng.choice(["nope", "anneal_chain", "Placement_chunks", "seed_", "exact"]))] = 1
        note, expect = "unknown option", "error"
    elif r < 0.55:
        old = str(rng.choice(["exact_nodes", "replica_slots", "hot_experts"]))
        kw[old] = 2
        note, expect = f"deprecated option {old}", "ok"
        kind = "edge"
    else:
        name = str(rng.choice(OPTION_NAMES))
        good = random_options(np.random.default_rng(int(rng.integers(2**32))), inp.window.num_experts)
        base = good.get(name, 1)
        if name == "anneal_mix":
            kw[name] = pick(
                rng,
                [
                    (1.0,),
                    (0, 0, 0, 0),
                    {0: 1.0},
                    "0.25",
                    (1, 2, 3, float("nan")),
                    None,
                    (-1, 1, 1, 1),
                    [1, 1, 1, 1, 1],
                    frozenset({1.0}),
                ],
            )
        elif name == "placement_migration_aware":
            kw[name] = pick(rng, ["yes", 1, 0, None, 2.0])
        else:
            kw[name] = bad_for(rng, base) if rng.random() < 0.8 else pick(rng, [-1, 1.5, "2", 2**64, True])
        note = f"{name}={kw[name]!r}"
        # outside the option's documented domain: refused; inside (a huge count): either
        expect = None if in_domain(name, kw[name]) else "error"
        if name == "placement_explore" and expect is None and kw[name] is not None and float(kw[name]) < 5e-5:
            expect = "error"  # below the default slack
    args = (inp.window, inp.topo, inp.cost, inp.cap)
    return Case(
        kind, rp.plan_window, args, kw, check=plan_check(args, kw), expect=expect, note=note, names=PLANNER_NAMES
    )


def determinism_case(rng: np.random.Generator) -> Case:
    """Two plans of the same inputs (no time budget) must be the same plan."""
    policy = str(rng.choice(sorted(rp.PRESETS)))
    inp = random_inputs(rng, policy)
    inp.kwargs.pop("time_budget_s", None)
    if inp.kwargs.get("anneal_moves") is None:
        inp.kwargs["anneal_moves"] = 2000
    check = plan_check((inp.window, inp.topo, inp.cost, inp.cap), inp.kwargs)

    def twice(*a: Any, **k: Any) -> Any:
        first = rp.plan_window(*a, **k)
        second = rp.plan_window(*a, **k)
        assert first.same_as(second), "plan_window is not deterministic for fixed inputs"
        return first

    twice.__qualname__ = "plan_window (twice)"
    return Case(
        "valid",
        twice,
        (inp.window, inp.topo, inp.cost, inp.cap),
        dict(inp.kwargs),
        check=check,
        expect="ok",
        names=PLANNER_NAMES,
    )


TARGETS = [
    Target(
        f"plan_window[{name}]", rp.plan_window, mixed((1, preset_case(name))), weight=2, names=PLANNER_NAMES, batch=16
    )
    for name in sorted(rp.PRESETS)
]
TARGETS += [
    Target(
        "plan_window[Policy]", rp.plan_window, mixed((1, policy_combo_case)), weight=2, names=PLANNER_NAMES, batch=16
    ),
    Target(
        "plan_window[first fit]", rp.plan_window, mixed((1, first_fit_case)), weight=1, names=PLANNER_NAMES, batch=16
    ),
    Target("plan_window[args]", rp.plan_window, mixed((1, args_case)), weight=3, names=PLANNER_NAMES, batch=16),
    Target("plan_window[options]", rp.plan_window, mixed((1, options_case)), weight=3, names=PLANNER_NAMES, batch=16),
    Target(
        "plan_window[determinism]",
        rp.plan_window,
        mixed((1, determinism_case)),
        weight=1,
        names=PLANNER_NAMES,
        batch=16,
    ),
]
