"""Placement stage (docs/design.md stage 1): where each expert's copies live, per layer.

Every choice has the signature ``f(ctx, options) -> Placement`` and reads its loads through
``ctx.placement_loads()``: this window's (``Policy(loads="window")``, an oracle) or the
previous window's (``Policy(loads="previous")`` with ``previous_window=``, what EPLB does in
practice).

* ``static`` (`static_placement`, no options): Megatron-LM's, expert e on rank
  ``e // ceil(E / ep)``.
* ``eplb`` (`eplb_placement`, `EplbOptions`): DeepSeek's EPLB, every slot filled, with the
  model's expert groups (``cost.expert_groups``) as its ``num_groups``, as its users run it.
* ``eplb_hierarchical`` (`eplb_hierarchical_placement`, `EplbOptions`): the same with one
  expert group per node, which forces EPLB's hierarchical policy (a second, explicitly named
  configuration of the baseline, for models without groups).
* ``relibra`` (`relibra_placement`, no options): ReLibra's per-window node-level reordering.
* ``routepack`` (`routepack_placement`, `RoutepackPlacementOptions`): optimal replica counts,
  node-then-rank packing, microbatch and migration awareness.

routepack's per-layer decisions land in ``plan.report["stage_reports"]["placement"]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from routepack import _core
from routepack._checks import allocating, loads_array
from routepack.errors import RoutepackError
from routepack.plan import Placement
from routepack.simulate import lower_bound_micro
from routepack.stages.context import PlanContext, stage_context
from routepack.stages.options import NoOptions, StageOptions, computed, count, flag, number, option


@dataclass(frozen=True)
class EplbOptions(StageOptions):
    """Options of the ``eplb`` placement."""

    #: EPLB's number of expert groups (``E / num_groups`` consecutive experts each), >= 1;
    #: a count the nodes of an EP group divide selects EPLB's hierarchical policy, any other
    #: (1 among them) its global policy. None: for ``eplb``, the model's own
    #: ``cost.expert_groups`` (`routepack.ModelShape.expert_groups`: 1 unless the model routes
    #: with groups, e.g. 8 for DeepSeek-V3), what DeepSeek, vLLM and SGLang pass; for
    #: ``eplb_hierarchical``, one group per node of an EP group when they divide the experts.
    eplb_num_groups: Optional[int] = computed(count(1))


@dataclass(frozen=True)
class RoutepackPlacementOptions(StageOptions):
    """Options of the ``routepack`` placement (defaults: the Rust core's)."""

    #: The window is split into this many runs of consecutive samples (chunks) and each
    #: expert's per-chunk demand is balanced too, so per-microbatch peaks fall (0 disables
    #: microbatch awareness; more than the window's samples means one chunk per sample).
    placement_chunks: int = option("placement", "placement_chunks", count(0))
    #: Exchanges (EP groups × microbatches) the predicted-time proxy merges the chunks into, >= 1.
    #: None: EP groups × the lower-bound microbatch count.
    placement_cells: Optional[int] = computed(count(1))
    #: How far above its balanced maximum (a fraction, in [0, 1]) the final placement may
    #: leave a rank's window load.
    placement_slack: float = option("placement", "placement_slack", number(0.0, 1.0))
    #: How far above it the first microbatch pass may go before a tightening pass brings the
    #: maximum back within the slack (a fraction of a rank's load in [slack, 1]; the node
    #: level explores the same absolute band). None: the core's default room
    #: (``DEFAULTS["placement"]["placement_explore"]``) or ``placement_slack``, whichever is
    #: larger (the core's rule, routepack-core's ``placement::routepack::Options::explore``).
    placement_explore: Optional[float] = computed(number(0.0, 1.0))
    #: Swap candidates the microbatch phase prices per layer (its budget, counted, so plans
    #: stay deterministic). The default keeps placement within 5 ms at DeepSeek-V3's size
    #: (58 layers × 256 experts on 32 ranks); more lowers the per-microbatch peaks of the
    #: placement alone, while behind the full ``routepack`` policy no measured step time
    #: changed.
    placement_fluct_evals: int = option("placement", "placement_fluct_evals", count(0))
    #: With ``previous=``, weigh keeping a layer and partial moves against the exposed
    #: migration time; False always re-places and only relabels slots against ``previous``.
    placement_migration_aware: bool = option("placement", "placement_migration_aware", flag())

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.placement_explore is not None and self.placement_explore < self.placement_slack:
            raise RoutepackError(
                f"placement_explore: must be in [slack={self.placement_slack}, 1], got {self.placement_explore}"
            )


def static_placement(ctx: PlanContext, options: NoOptions) -> Placement:
    """Megatron-LM's default: expert e on rank ``e // ceil(E / ep)``, spare slots empty."""
    ctx = stage_context(ctx, options, NoOptions)
    w = ctx.window
    return Placement.static(w.num_layers, w.num_experts, ctx.topo)


def _eplb(ctx: PlanContext, groups: int, source: str) -> Placement:
    """EPLB with ``groups`` expert groups; ``source`` is the argument they came from (named
    by the error when they cannot serve: EPLB's hierarchical policy, which it takes when the
    nodes of an EP group divide the groups, needs the groups to divide the experts)."""
    num_experts, nodes = ctx.window.num_experts, ctx.topo.nodes_per_group
    if groups % nodes == 0 and num_experts % groups:
        raise RoutepackError(
            f"{source}: {groups} expert groups do not divide the window's {num_experts} experts, as EPLB's "
            f"hierarchical policy (taken since the {nodes} node(s) of an EP group divide the groups) needs"
        )
    loads = loads_array(ctx.placement_loads(), ctx.loads_name())
    phy2log = _core.eplb_placement(loads, ctx.topo, groups)
    ctx.reports["placement"] = {"eplb_num_groups": groups}
    return Placement._of_core(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


def eplb_placement(ctx: PlanContext, options: EplbOptions) -> Placement:
    """The EPLB baseline on ``ctx.placement_loads()``, every slot filled, as its users run
    it: ``num_groups`` is the model's expert groups (``ctx.cost.expert_groups``) unless
    ``eplb_num_groups`` says otherwise."""
    ctx = stage_context(ctx, options, EplbOptions)
    if options.eplb_num_groups is None:
        return _eplb(ctx, ctx.cost.expert_groups, "cost.expert_groups")
    return _eplb(ctx, options.eplb_num_groups, "eplb_num_groups")


def eplb_hierarchical_placement(ctx: PlanContext, options: EplbOptions) -> Placement:
    """EPLB with one expert group per node of an EP group (its hierarchical policy, on groups
    of consecutive expert ids the model does not have) unless ``eplb_num_groups`` says
    otherwise; on one node, or when the nodes do not divide the experts, its global policy."""
    ctx = stage_context(ctx, options, EplbOptions)
    if options.eplb_num_groups is None:
        return _eplb(ctx, int(_core.eplb_node_groups(ctx.window.num_experts, ctx.topo)), "eplb_num_groups")
    return _eplb(ctx, options.eplb_num_groups, "eplb_num_groups")


def relibra_placement(ctx: PlanContext, options: NoOptions) -> Placement:
    """ReLibra's per-window expert reordering from ``ctx.placement_loads()`` ([L, E]),
    starting from ``ctx.previous`` (or the static placement)."""
    ctx = stage_context(ctx, options, NoOptions)
    loads = loads_array(ctx.placement_loads(), ctx.loads_name())
    prev: Any = None
    if ctx.previous is not None:
        prev = ctx.previous.phy2log
    phy2log = _core.relibra_placement(loads, ctx.topo, prev)
    return Placement._of_core(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


def routepack_placement(ctx: PlanContext, options: RoutepackPlacementOptions) -> Placement:
    """routepack's placement: optimal replication, node-then-rank packing, microbatch
    awareness from per-chunk demand, migration awareness against ``ctx.previous``. The search
    stops improving when ``ctx.time_budget_s`` (seconds from the call, None: no cap) is spent."""
    start = time.perf_counter()
    ctx = stage_context(ctx, options, RoutepackPlacementOptions)
    win = ctx.demand_window()
    if win is None:
        ctx.placement_loads()  # raises the error that names previous_window
    chunks = min(options.placement_chunks, win.num_samples)
    cells = options.placement_cells
    if cells is None:
        cells = ctx.topo.num_groups * lower_bound_micro(win, ctx.topo, ctx.token_cap)
    demand = _core.chunk_demand(win.seq_lens, win.counts, chunks)
    if chunks > 0 and win is ctx.window and ctx.policy.loads == "window":
        # the window total is the sum of its chunks: skip a second pass over [S, L, E]
        with allocating("window", "its loads [L, E] in float64", demand.shape[0] * demand.shape[1] * 8):
            loads = np.ascontiguousarray(demand.sum(axis=2))
    else:
        loads = loads_array(ctx.placement_loads(), ctx.loads_name())
    previous = ctx.previous.phy2log if ctx.previous is not None else None
    budget = None
    if ctx.time_budget_s is not None:
        # the chunk demand above was part of the share
        budget = max(0.0, ctx.time_budget_s - (time.perf_counter() - start))
    phy2log, report = _core.routepack_placement(
        loads,
        demand,
        ctx.topo,
        ctx.cost,
        previous,
        cells,
        options.placement_slack,
        options.placement_explore,
        options.placement_fluct_evals,
        options.placement_migration_aware,
        time_budget_s=budget,
    )
    report["chunks"] = chunks
    report["cells"] = cells
    ctx.reports["placement"] = report
    return Placement._of_core(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


__all__ = [
    "EplbOptions",
    "RoutepackPlacementOptions",
    "eplb_hierarchical_placement",
    "eplb_placement",
    "relibra_placement",
    "routepack_placement",
    "static_placement",
]
