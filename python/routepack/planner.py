"""`plan_window`: runs the stages of a policy and assembles a validated `Plan`."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from routepack import _core, stages  # noqa: F401  (registers the baseline stages)
from routepack import packing  # noqa: F401  (registers the kk and routepack packings)
from routepack import replication  # noqa: F401  (registers hot_n, relibra, routepack replication)
from routepack import placement as _placement  # noqa: F401  (registers eplb, routepack placement)
from routepack._checks import finite_float, positive_int
from routepack.plan import MIGRATION_DTYPE, Placement, Plan, empty_migration
from routepack.policies import KNOWN_OPTIONS, PACKINGS, PLACEMENTS, REPLICATIONS, PlanContext, resolve
from routepack.simulate import simulate


def plan_window(
    window: Any,
    topo: Any,
    cost: Any,
    token_cap: int = 65536,
    policy: Any = "routepack",
    previous: Optional[Placement] = None,
    previous_window: Any = None,
    seed: int = 0,
    anneal_moves: Optional[int] = None,
    time_budget_s: Optional[float] = None,
    **options: Any,
) -> Plan:
    """Plans one window.

    Args:
        window: `Window` (seq_lens [S], expert_tokens [S, L, E]).
        topo: `Topology`; cost: `CostModel` with one ``a_quad`` per layer.
        token_cap: hard cap on tokens per microbatch; a longer sample raises `InfeasibleError`.
        policy: a preset name (``routepack.PRESETS``) or a `Policy`.
        previous: the `Placement` in force now; migration is planned from it.
        previous_window: plan placement from these loads (history-based balancers, e.g. EPLB).
        seed: seeds every randomised stage; the plan is a pure function of inputs and seed.
        anneal_moves: search budget in moves (deterministic).
        time_budget_s: optional wall-clock cap (then plans may differ between machines;
            compute on one rank and `routepack.torch.broadcast_plan`).
        options: stage-specific options (documented by each stage).

    Returns:
        A `Plan` that passed `Plan.validate`, with ``report`` holding the predicted step time
        and its parts (`simulate`), bounds, certificates and each stage's wall time.
    """
    from routepack.window import Window

    if not isinstance(window, Window):
        raise TypeError(f"window: expected routepack.Window, got {type(window).__name__}")
    if previous_window is not None and not isinstance(previous_window, Window):
        raise TypeError(f"previous_window: expected routepack.Window, got {type(previous_window).__name__}")
    if previous is not None and not isinstance(previous, Placement):
        raise TypeError(f"previous: expected routepack.Placement, got {type(previous).__name__}")
    token_cap = positive_int(token_cap, "token_cap")
    seed = positive_int(seed, "seed", minimum=0, maximum=2**64 - 1)
    if anneal_moves is not None:
        anneal_moves = positive_int(anneal_moves, "anneal_moves", minimum=0)
    if time_budget_s is not None:
        time_budget_s = finite_float(time_budget_s, "time_budget_s", strict=True)
    from routepack._checks import instance_of
    from routepack.model import CostModel, Topology

    instance_of(topo, Topology, "topo")
    instance_of(cost, CostModel, "cost")
    topo.check_experts(window.num_experts)
    if cost.num_layers != window.num_layers:
        raise ValueError(f"cost.a_quad: has {cost.num_layers} layers but the window has {window.num_layers}")
    if previous_window is not None and (
        previous_window.num_layers != window.num_layers or previous_window.num_experts != window.num_experts
    ):
        raise ValueError(
            f"previous_window: has L={previous_window.num_layers}, E={previous_window.num_experts}; "
            f"the window has L={window.num_layers}, E={window.num_experts}"
        )
    if previous is not None and (
        previous.num_layers != window.num_layers
        or previous.num_experts != window.num_experts
        or previous.num_slots != topo.num_slots
        or previous.slots_per_rank != topo.slots_per_rank
    ):
        raise ValueError(f"previous: {previous!r} does not fit the window and topology {topo}")

    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ValueError(f"options: unknown option(s) {sorted(unknown)}; known: {sorted(KNOWN_OPTIONS)}")
    name, pol = resolve(policy)
    ctx = PlanContext(window, topo, cost, token_cap, previous, previous_window, seed,
                      anneal_moves, time_budget_s, dict(options), pol)
    seconds = {}
    start = t0 = time.perf_counter()
    placement = PLACEMENTS[pol.placement](ctx)
    seconds["placement"] = time.perf_counter() - t0

    if time_budget_s is not None:
        # the packing stage is the only one that searches by time: give it what is left after
        # placement, less a reserve for replication, migration, validation and the final
        # simulate (over half of a `flash` routepack plan when replication is routepack)
        left = time_budget_s - (time.perf_counter() - start)
        share = 0.4 if pol.replication == "routepack" else 0.7
        ctx.time_budget_s = max(0.01, left * share)
    t0 = time.perf_counter()
    sample_rank, sample_micro, num_micro, pack_report = PACKINGS[pol.packing](ctx, placement)
    seconds["packing"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    replicas = REPLICATIONS[pol.replication](ctx, placement, sample_rank, sample_micro, num_micro)
    seconds["replication"] = time.perf_counter() - t0

    migration = empty_migration()
    if previous is not None:
        cols = _core.migration_diff(previous.phy2log, placement.phy2log, placement.num_experts,
                                    placement.slots_per_rank, cost.expert_state_bytes,
                                    min(topo.gpus_per_node, topo.ep))
        migration = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
        for name_, col in zip(MIGRATION_DTYPE.names, cols):
            migration[name_] = col

    plan = Plan(placement, sample_rank, sample_micro, num_micro, replicas, migration, policy=name)
    plan.validate(window, topo, token_cap)
    sim = simulate(plan, window, topo, cost, token_cap)
    seconds["total"] = time.perf_counter() - start
    plan.report = {
        "policy": name,
        "token_cap": token_cap,
        "stages": {"placement": pol.placement, "packing": pol.packing, "replication": pol.replication,
                   "loads": pol.loads},
        "predicted": sim.summary(),
        "packing": pack_report,
        "stage_seconds": seconds,
        "stage_reports": ctx.reports,
        "seed": seed,
        "anneal_moves": anneal_moves,
        "time_budget_s": time_budget_s,
    }
    return plan
