"""Packing stage (docs/design.md stages 2-3): samples into token-capped rows, and rows onto
cells (DP rank, microbatch).

Every choice has the signature ``f(ctx, options, placement) -> (sample_rank [S] int32,
sample_micro [S] int32, num_micro, report dict)``.

* ``sequential`` (`sequential_packing`, no options): arrival-order first fit.
* ``kk`` (`kk_packing`, no options): verl's Karmarkar–Karp balancing.
* ``routepack`` (`routepack_packing`, `RoutepackPackingOptions`): the fewest certified rows,
  then the layout by population annealing.

Every choice meets a pipeline's microbatch rule (at least ``topo.pp`` microbatches per DP rank,
a multiple of ``pp`` under ``vpp`` > 1) and runs a sample over the cap alone where
``ctx.oversize`` is "alone" (docs/design.md, "Samples over the cap").

The annealing budget ``anneal_moves`` is an argument of ``plan_window`` itself (default: the
core's, by topology: `DEFAULT_ANNEAL_MOVES` where an EP group fits in one node,
`DEFAULT_ANNEAL_MOVES_ACROSS_NODES` where it spans nodes), not one of these options; under ``time_budget_s`` the stage's
wall-clock share arrives as ``ctx.time_budget_s`` (seconds, `routepack.planner.BUDGET_WEIGHTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from routepack import _core
from routepack.oversize import split_view
from routepack.stages.context import PackingResult, PlanContext, check_fills_cells, check_placement_fits, stage_context
from routepack.stages.options import DEFAULTS, NoOptions, StageOptions, count, number, option, weights

#: Default search budget of routepack's layout where an EP group fits in one node, in proposed
#: moves over all chains (the core's `DEFAULT_MOVES`). Deterministic, unlike a wall-clock
#: budget. Quality rises slowly with more (benches/packing_quality.py prints the curve).
DEFAULT_ANNEAL_MOVES: int = DEFAULTS["packing"]["anneal_moves"]
#: The default where an EP group spans nodes (the core's `DEFAULT_MOVES_ACROSS_NODES`: 0, the
#: starting layout as it is). There the layout proxy misprices what replication and node-first
#: feeding do with copies on several nodes, and the anneal's gains under it do not survive
#: replication (docs/design.md, "Layout search"; measured on flash windows 0-7).
DEFAULT_ANNEAL_MOVES_ACROSS_NODES: int = DEFAULTS["packing"]["anneal_moves_across_nodes"]


@dataclass(frozen=True)
class RoutepackPackingOptions(StageOptions):
    """Options of the ``routepack`` packing (defaults: the Rust core's)."""

    #: Population size (a chain per core on the 2-core reference machine), >= 1.
    anneal_chains: int = option("packing", "anneal_chains", count(1))
    #: Temperature steps (resampling after each), >= 1.
    anneal_steps: int = option("packing", "anneal_steps", count(1))
    #: Weight of the mean EDP-shard cost next to the slowest one, >= 0.
    anneal_lambda: float = option("packing", "anneal_lambda", number(0.0))
    #: Acceptance of a typical worsening move at the start, in (0, 1).
    anneal_start_accept: float = option("packing", "anneal_start_accept", number(0.0, 1.0, lo_open=True, hi_open=True))
    #: Final temperature / start temperature, in (0, 1].
    anneal_cooling: float = option("packing", "anneal_cooling", number(0.0, 1.0, lo_open=True))
    #: Proposal weights (move, random swap, near-length swap, cell swap): >= 0, not all 0.
    anneal_mix: Tuple[float, float, float, float] = option("packing", "anneal_mix", weights(4))
    #: Node limit of the exact row search, >= 0.
    packing_exact_nodes: int = option("packing", "packing_exact_nodes", count(0, 2**64 - 1))


def _packing_context(ctx: Any, options: Any, options_class: type, placement: Any) -> PlanContext:
    """`stage_context`, ``placement`` fitting the window and topology, and enough samples to
    fill the cells (`check_fills_cells`): what every packing checks first."""
    ctx = stage_context(ctx, options, options_class)
    check_placement_fits(placement, "placement", ctx.window, ctx.topo)
    check_fills_cells(ctx)
    return ctx


def _cells(ctx: PlanContext) -> dict:
    """What every packing is told of the cells beyond the DP ranks: the pipeline's microbatch
    rule (`Topology.min_micro`, `Topology.micro_multiple`) and whether a sample over the cap runs
    alone or is split over a CP group of ``topo.cp`` ranks (``ctx.oversize``, `routepack.oversize`)."""
    return {
        "min_micro": ctx.topo.min_micro,
        "micro_multiple": ctx.topo.micro_multiple,
        "oversize": ctx.oversize if ctx.oversize in ("alone", "split") else None,
        "cp": ctx.topo.cp,
    }


def sequential_packing(ctx: PlanContext, options: NoOptions, placement: Any) -> PackingResult:
    """Arrival-order first fit. Report: rows, fallback (first fit opened more rows than the
    cells take, so the certified rows were laid out: a baseline never refuses a window that
    fits)."""
    ctx = _packing_context(ctx, options, NoOptions, placement)
    rank, micro, m, report = _core.pack_sequential(ctx.window.seq_lens, int(ctx.token_cap), ctx.topo.dp, **_cells(ctx))
    return rank, micro, m, dict(report)


def kk_packing(ctx: PlanContext, options: NoOptions, placement: Any) -> PackingResult:
    """verl: Karmarkar–Karp on 24576·n + n² over DP ranks (equal counts), microbatches per
    rank = ceil(tokens / cap) all-reduced to the max, repartitioned with one more on overflow,
    small microbatches at both ends. Report: rows, micro, first_micro, overflow_retries,
    max_row_tokens, fallback (verl's retries ran out on a window that fits, so the certified
    rows were laid out)."""
    ctx = _packing_context(ctx, options, NoOptions, placement)
    rank, micro, m, report = _core.pack_kk(ctx.window.seq_lens, int(ctx.token_cap), ctx.topo.dp, **_cells(ctx))
    return rank, micro, m, dict(report)


def routepack_packing(ctx: PlanContext, options: RoutepackPackingOptions, placement: Any) -> PackingResult:
    """routepack: the fewest token-capped rows with a certificate, then the (DP rank, microbatch)
    layout that minimises the slowest EDP shard's accumulated attention + expert + all-to-all
    cost under `placement`, by parallel population annealing.

    Under a pipeline (``topo.pp`` > 1) each EP group's microbatches are then put in the order
    that shortens its 1F1B schedule (`routepack._core.order_microbatches`; docs/design.md, "Pipeline
    parallelism"): report key ``order`` {before, after (the slowest group's pipeline seconds
    without replicas), evaluations, groups_reordered}.

    Report keys: rows, micro, rows_lower_bound {L1, L2, rows}, certified, gap, rows_method,
    bins, exact_nodes, layout_init, initial_cost / annealed_cost (proxy step time, s),
    moves (proposed), moves_evaluated, moves_accepted, chains, steps, stopped_by_time,
    anneal_history {temperature, best_cost, best_energy, mean_energy, accept_rate, moves}
    (one entry per temperature step), seconds {rows, proxy, init, anneal} (wall time).
    """
    ctx = _packing_context(ctx, options, RoutepackPackingOptions, placement)
    o = options
    # None: the core's default for the topology (`DEFAULT_ANNEAL_MOVES[_ACROSS_NODES]`)
    rank, micro, m, report = _core.pack_routepack(
        ctx.window.seq_lens,
        ctx.window.counts,
        ctx.topo,
        ctx.cost,
        placement.phy2log,
        ctx.token_cap,
        seed=ctx.seed,
        anneal_moves=ctx.anneal_moves,
        time_budget_s=ctx.time_budget_s,
        chains=o.anneal_chains,
        steps=o.anneal_steps,
        exact_nodes=o.packing_exact_nodes,
        lambda_=o.anneal_lambda,
        start_accept=o.anneal_start_accept,
        cooling=o.anneal_cooling,
        mix=o.anneal_mix,
        oversize=_cells(ctx)["oversize"],  # split over topo.cp
    )
    report = dict(report)
    if ctx.topo.pp > 1:
        # under a pipeline, each EP group's microbatches in the order that shortens its 1F1B
        # schedule (under "split" timed on the pieces, each on its rank of its CP group: a whole
        # EP group's microbatches move together, so a split sample's pieces stay at one)
        window, cell_rank, cell_micro = ctx.window, rank, micro
        if ctx.oversize == "split":
            window, cell_rank, cell_micro = split_view(ctx.window, ctx.token_cap, ctx.topo.cp, rank, micro)
        args = (window.seq_lens, window.counts, ctx.topo, ctx.cost, placement.phy2log)
        micro, order = _core.order_microbatches(*args, cell_rank, cell_micro, m)
        if ctx.oversize == "split":
            # each sample's microbatch is its first piece's
            pieces = np.where(ctx.window.seq_lens > ctx.token_cap, ctx.topo.cp, 1)
            micro = micro[np.cumsum(pieces) - pieces]
        report["order"] = dict(order)
    report["anneal_history"] = dict(report["anneal_history"])
    report["rows_lower_bound"] = dict(report["rows_lower_bound"])
    report["seconds"] = dict(report["seconds"])
    return rank, micro, m, report


__all__ = [
    "DEFAULT_ANNEAL_MOVES",
    "DEFAULT_ANNEAL_MOVES_ACROSS_NODES",
    "RoutepackPackingOptions",
    "kk_packing",
    "routepack_packing",
    "sequential_packing",
]
