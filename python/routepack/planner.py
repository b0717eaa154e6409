"""`plan_window`: runs the stages of a policy and assembles a validated `Plan`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from routepack._checks import WINDOW_WORDS, callers_words, finite_float
from routepack.choice import choose_stages, migration_rows
from routepack.plan import Placement, Plan
from routepack.oversize import oversize_mode
from routepack.oversize import report as oversize_report
from routepack.oversize import split_view
from routepack.policies import resolve
from routepack.simulate import score
from routepack.stages.context import DEFAULT_POLICY, DEFAULT_SEED, DEFAULT_TOKEN_CAP, PlanContext, check_fills_cells
from routepack.stages.options import StageOptions
from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS, Stage, canonical_options, stage_options
from routepack.stages.replication_live import REPLICA_TIMINGS
from routepack.window import Window

#: How ``time_budget_s`` is spent: the one table of shares (docs/design.md points here).
#: At entry the planner fixes the deadline ``start + time_budget_s`` and sets aside
#: `reserve_seconds` before it for the mandatory end (migration diff, validation, the final
#: simulate). Each stage whose choice searches (a key here) gets, when it starts, its weight's
#: part of the time then left before the reserve, shared with the searching stages still to
#: come; what a stage leaves unused passes on to the next. With the ``routepack`` policy on a
#: fresh start: placement 1/5, packing half of what is then left, replication the rest.
#: Other choices (the baselines, which do not search) run in full and are told all the time
#: left before the reserve (``ctx.time_budget_s``).
BUDGET_WEIGHTS: Dict[Tuple[str, str], float] = {
    ("placement", "routepack"): 1.0,
    ("packing", "routepack"): 2.0,
    ("replication", "routepack"): 2.0,
}

#: The reserve for validation and the final simulate, per entry of ``expert_tokens [S, L, E]``
#: and fixed: both pass over the routing once. Measured on the 2-core reference machine:
#: `flash` (67M entries) validates in 0.03 s and simulates in 0.19 s unloaded, 0.24-0.38 s
#: beside other jobs; `tiny` (2.6M) in 2 + 15 ms. Should the estimate fall short, the call
#: overruns by the shortfall only.
RESERVE_S_PER_ENTRY = 5e-9
RESERVE_S_FIXED = 0.005


def reserve_seconds(window: Window) -> float:
    """Seconds a budgeted plan keeps for validation and the final simulate of `window`."""
    return RESERVE_S_FIXED + RESERVE_S_PER_ENTRY * window.counts.size


def _stage_share(deadline: float, reserve: float, stage: str, pol: Any) -> float:
    """Seconds `stage` of policy `pol` may take from now (see `BUDGET_WEIGHTS`), >= 0."""
    left = max(0.0, deadline - reserve - time.perf_counter())
    order = ("placement", "packing", "replication")
    weight = BUDGET_WEIGHTS.get((stage, getattr(pol, stage)))
    if weight is None:
        return left
    rest = sum(BUDGET_WEIGHTS.get((s, getattr(pol, s)), 0.0) for s in order[order.index(stage) :])
    return left * weight / rest


def plan_window(
    window: Any,
    topo: Any,
    cost: Any,
    token_cap: int = DEFAULT_TOKEN_CAP,
    policy: Any = DEFAULT_POLICY,
    previous: Optional[Placement] = None,
    previous_window: Any = None,
    seed: int = DEFAULT_SEED,
    anneal_moves: Optional[int] = None,
    time_budget_s: Optional[float] = None,
    oversize: Optional[str] = None,
    **options: Any,
) -> Plan:
    """Plans one window.

    Args:
        window: `Window` (seq_lens [S], expert_tokens [S, L, E]).
        topo: `Topology`; cost: `CostModel` with one ``a_quad`` per layer (and, where it
            knows ``num_experts``, the window's expert count).
        token_cap: hard cap on tokens per microbatch; a longer sample raises `InfeasibleError`
            unless ``oversize`` says otherwise.
        policy: a preset name (``routepack.PRESETS``) or a `Policy`.
        previous: the `Placement` in force now; migration is planned from it.
        previous_window: plan placement from these loads (history-based balancers, e.g. EPLB).
        seed: seeds every randomised stage; the plan is a pure function of inputs and seed.
        anneal_moves: the layout search budget in proposed moves (deterministic). Default, the
            core's by topology: `routepack.packing.DEFAULT_ANNEAL_MOVES` (300 000) where an EP
            group fits in one node, `DEFAULT_ANNEAL_MOVES_ACROSS_NODES` (0: the starting layout)
            where it spans nodes (see docs/design.md, "Layout search").
        time_budget_s: optional wall-clock cap, in seconds, on the whole call (then plans may
            differ between runs and machines; compute on one rank and
            `routepack.torch.broadcast_plan`). Each searching stage gets a share of the time
            left (`BUDGET_WEIGHTS`), after a reserve for validation and the final simulate
            (`reserve_seconds`), and stops improving when its share is spent: placement keeps
            its greedy packings, the layout search stops, replication leaves the exchanges
            not yet planned without replicas (never slower than no replication). Guaranteed:
            the plan passes `Plan.validate`, and the call returns by the deadline plus what
            its mandatory work overruns: reading the arrays (placement's chunk demand,
            packing's rows and proxy, replication's routing check: ~0.3 s on `flash` on the
            2-core reference machine) and validation and the final simulate beyond their
            reserve (~0.25 s there). Budgets above that mandatory work return within about
            1.1x of the budget + 20 ms; smaller ones as fast as the mandatory work allows
            (~0.6 s for `flash`, ~40 ms for `tiny`). On a loaded machine the mandatory work
            itself takes longer. None (the default): no clock is read, and the plan is
            deterministic. Values above 1e9 s mean no deadline (byte-identical to None);
            negative or non-finite ones raise `RoutepackError`.
        oversize: a sample longer than ``token_cap``: None / "refuse" raises `InfeasibleError`
            naming it; "alone" runs it in a microbatch of its own, priced at its length; "split"
            splits it over a context-parallel group of ``topo.cp`` ranks, priced as ring
            attention (`routepack.oversize`; docs/design.md, "Samples over the cap").
        options: stage options by name, filling the options dataclass of each stage choice
            (`routepack.stages`: e.g. ``placement_chunks``, ``anneal_chains``,
            ``packing_exact_nodes``, ``replication_slots``; ``routepack.stages.known_options()``
            lists them). Every value is checked by its dataclass, whichever stages the policy
            runs. The old names ``exact_nodes``, ``replica_slots`` and ``hot_experts`` still
            work, with a DeprecationWarning; unknown names raise `RoutepackError` listing the
            valid ones.

    Returns:
        A `Plan` that passed `Plan.validate`, with ``report`` holding the predicted step time
        and its parts (`simulate`), bounds, certificates and each stage's wall time (and
        with a budget, ``budget``: the reserve and each stage's share, in seconds).
    """
    request = plan_request(
        window,
        topo,
        cost,
        token_cap,
        policy,
        previous,
        previous_window,
        seed,
        anneal_moves,
        time_budget_s,
        oversize,
        options,
        stacklevel=3,
    )
    return plan_stages(request, run_replication)


@dataclass(frozen=True)
class PlanRequest:
    """One `plan_window` call's arguments, checked once (`plan_request`): what crosses into the
    stages as one object. ``ctx`` is the checked `PlanContext` every stage reads (window,
    topology, cost model, cap, seed, budgets, canonical options, resolved policy; no stage
    checks it again), ``name`` the policy's name (a preset, or ``placement+packing+replication``)
    and ``stage_options`` the typed options of its (placement, packing, replication)."""

    ctx: PlanContext
    name: str
    stage_options: Tuple[StageOptions, StageOptions, StageOptions]


def plan_request(
    window: Any,
    topo: Any,
    cost: Any,
    token_cap: Any,
    policy: Any,
    previous: Optional[Placement],
    previous_window: Any,
    seed: Any,
    anneal_moves: Any,
    time_budget_s: Any,
    oversize: Optional[str],
    options: Dict[str, Any],
    stacklevel: int,
) -> PlanRequest:
    """`plan_window`'s arguments (``options`` as a dict) checked once, in the order its errors
    name them: the context's fields (`PlanContext.check`: window, topology, cost, cap, seed,
    budgets, ``oversize``, ``previous``), the options' names, the policy, the options' values,
    then whether the window can fill the cells (`check_fills_cells`). ``stacklevel`` counts the
    deprecation warnings' frames from this function (`plan_window` passes 3: its caller)."""
    if time_budget_s is not None:
        time_budget_s = finite_float(time_budget_s, "time_budget_s", strict=True)
    ctx = PlanContext(
        window, topo, cost, token_cap, previous, previous_window, seed, anneal_moves, time_budget_s, oversize=oversize
    ).check()
    options = canonical_options(options, stacklevel=stacklevel)
    name, pol = resolve(policy)
    opts = stage_options(pol, options)
    ctx.choose(options, pol)
    check_fills_cells(ctx)
    return PlanRequest(ctx, name, opts)


#: How a plan's replication stage is run: ``f(stage, ctx, options, placement, sample_rank,
#: sample_micro, num_micro) -> replicas``, where ``stage`` is the policy's `Stage`. The one
#: seam between `plan_window` and `routepack.torch.plan_window_distributed` (which spreads
#: the exchanges over the ranks and gathers their replicas).
ReplicationRunner = Callable[..., np.ndarray]


def run_replication(
    stage: Stage,
    ctx: PlanContext,
    options: Any,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
) -> np.ndarray:
    """`plan_window`'s `ReplicationRunner`: the stage, whole, in this process."""
    return stage.run(ctx, options, placement, sample_rank, sample_micro, num_micro)


def plan_stages(request: PlanRequest, replicate: ReplicationRunner) -> Plan:
    """`plan_window`'s body: the stages of the checked ``request`` (`plan_request`), its
    replication stage run by ``replicate``, then migration, validation and the final simulate
    in one core call. Nothing checked at the request is checked again."""
    ctx, name = request.ctx, request.name
    window, topo, cost, pol = ctx.window, ctx.topo, ctx.cost, ctx.policy
    token_cap, seed, anneal_moves, time_budget_s = ctx.token_cap, ctx.seed, ctx.anneal_moves, ctx.time_budget_s
    place_opts, pack_opts, repl_opts = request.stage_options
    seconds = {}
    start = t0 = time.perf_counter()
    budget: Dict[str, float] = {}
    deadline = start + (time_budget_s if time_budget_s is not None else 0.0)
    if time_budget_s is not None:
        budget["reserve"] = reserve_seconds(window)

    def share(stage: str) -> Optional[float]:
        # every stage's budget, in seconds from now (None without time_budget_s)
        if time_budget_s is None:
            return None
        budget[stage] = _stage_share(deadline, budget["reserve"], stage, pol)
        return budget[stage]

    ctx.time_budget_s = share("placement")
    # the core names the window's arrays (expert_tokens); the caller passed `window`
    with callers_words(WINDOW_WORDS):
        placement = PLACEMENTS[pol.placement].run(ctx, place_opts)
    seconds["placement"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    ctx.time_budget_s = share("packing")
    with callers_words(WINDOW_WORDS):
        sample_rank, sample_micro, num_micro, pack_report = PACKINGS[pol.packing].run(ctx, pack_opts, placement)
    seconds["packing"] = time.perf_counter() - t0

    timing = REPLICA_TIMINGS.get(pol.replication, "prefetch")

    def replicate_on(place: Placement, rank: np.ndarray, micro: np.ndarray, m: int) -> np.ndarray:
        cells_ctx, cell_rank, cell_micro = ctx, rank, micro
        if ctx.oversize == "split":
            # replication reads cells: it plans on the pieces, each on its rank of its CP group
            pieces, cell_rank, cell_micro = split_view(window, token_cap, topo.cp, rank, micro)
            cells_ctx = ctx.derived(window=pieces)
        with callers_words(WINDOW_WORDS):
            return replicate(REPLICATIONS[pol.replication], cells_ctx, repl_opts, place, cell_rank, cell_micro, m)

    replicas = None
    choice_report = None
    if pol.choose and time_budget_s is None:
        t0 = time.perf_counter()
        placement, packed, replicas, choice_report = choose_stages(
            ctx, pol, placement, (sample_rank, sample_micro, num_micro, pack_report), replicate_on, timing
        )
        sample_rank, sample_micro, num_micro, pack_report = packed
        seconds["choice"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    ctx.time_budget_s = share("replication")
    if replicas is None:
        replicas = replicate_on(placement, sample_rank, sample_micro, num_micro)
    seconds["replication"] = time.perf_counter() - t0
    ctx.time_budget_s = time_budget_s

    migration = migration_rows(ctx.previous, placement, topo, cost)
    plan = Plan(
        placement, sample_rank, sample_micro, num_micro, replicas, migration, policy=name, replica_timing=timing
    )
    # `Plan.validate` and the final simulate in one core call: one view of the window for both,
    # the request's arguments as checked
    mode = oversize_mode(ctx.oversize)
    sim = score(plan, window, topo, cost, token_cap, plan_cap=token_cap, oversize=mode)
    seconds["total"] = time.perf_counter() - start
    plan.report = {
        "policy": name,
        "token_cap": token_cap,
        "stages": {
            "placement": pol.placement,
            "packing": pol.packing,
            "replication": pol.replication,
            "loads": pol.loads,
        },
        "predicted": sim.summary(),
        "memory": plan.memory(topo, cost),
        "packing": pack_report,
        "stage_seconds": seconds,
        "stage_reports": ctx.reports,
        **({"choice": choice_report} if choice_report is not None else {}),
        "seed": seed,
        "anneal_moves": anneal_moves,
        "time_budget_s": time_budget_s,
    }
    if time_budget_s is not None:
        plan.report["budget"] = budget
    if mode != "refuse":
        extra = {"cp": topo.cp} if mode == "split" else {}
        plan.report["oversize"] = oversize_report(mode, window.seq_lens, token_cap, **extra)
    return plan
