"""Placement stages (DESIGN.md stage 1): the EPLB baseline and routepack's placement.

Both register in ``PLACEMENTS`` and read their loads through ``ctx.placement_loads()``:
this window's (``Policy(loads="window")``, an oracle) or the previous window's
(``Policy(loads="previous")`` with ``previous_window=``, what EPLB does in practice).

Options (``plan_window(..., **options)``):

* ``eplb_num_groups`` (int): EPLB's number of expert groups (``E / num_groups`` consecutive
  experts each). Default: one group per node of an EP group when the experts divide evenly,
  which selects EPLB's hierarchical policy; 1 (or any count the nodes do not divide)
  selects its global policy.
* ``placement_chunks`` (int, default 32): routepack splits the window into this many runs of
  consecutive samples and balances each expert's per-run demand too, so per-microbatch
  peaks fall (0 disables microbatch awareness).
* ``placement_cells`` (int): cells (EP groups × microbatches) the predicted-time proxy merges
  the chunks into; default EP groups × the lower-bound microbatch count.
* ``placement_slack`` (float, default 5e-5): how far above its balanced maximum (a fraction)
  the final placement may leave a rank's window load.
* ``placement_explore`` (float, default 0.01, >= slack): how far above it the first
  microbatch pass may go before a tightening pass brings the maximum back within the slack
  (a fraction of a rank's load; the node level explores the same absolute band).
* ``placement_fluct_evals`` (int, default 1000): swap candidates the microbatch phase prices
  per layer (its budget, counted, so plans stay deterministic). The default keeps placement
  within 5 ms at DeepSeek-V3's size (58 layers × 256 experts on 32 ranks); more lowers the
  per-microbatch peaks of the placement alone (with sequential packing, `flash`'s simulated
  step 1.5% lower at 8000, for about twice the placement time), while behind the full
  ``routepack`` policy (packing, layout and replication after it) no measured step time
  changed.
* ``placement_migration_aware`` (bool, default True): with ``previous=``, weigh keeping a
  layer and partial moves against the exposed migration time; False always re-places and
  only relabels slots against ``previous``.

routepack's per-layer decisions land in ``plan.report["stage_reports"]["placement"]``.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from routepack import _core
from routepack._checks import finite_float, positive_int
from routepack.plan import Placement
from routepack.policies import KNOWN_OPTIONS, PLACEMENTS, PlanContext
from routepack.simulate import lower_bound_micro

DEFAULT_CHUNKS = 32
DEFAULT_FLUCT_EVALS = 1_000
DEFAULT_EXPLORE = 0.01
DEFAULT_SLACK = 5e-5


def _loads_array(weight: Any, name: str) -> np.ndarray:
    w = np.asarray(weight)
    if w.dtype == np.bool_ or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise TypeError(f"{name}: expected a numeric array, got dtype {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"{name}: expected shape [L, E], got {w.shape}")
    return np.ascontiguousarray(w, dtype=np.float64)


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's entry point, same arguments and results (computed in Rust).

    Args:
        weight: ``[L, E]`` load of each logical expert (any numeric dtype; used as float64).
        num_replicas: physical slots R per layer, a multiple of ``num_gpus``.
        num_groups: expert groups; hierarchical policy when ``num_groups % num_nodes == 0``.
        num_nodes, num_gpus: ``num_gpus`` a multiple of ``num_nodes``.

    Returns:
        ``phy2log`` int64 ``[L, R]`` (slot p on GPU ``p // (R // num_gpus)``), ``log2phy``
        int64 ``[L, E, X]`` padded with -1 (X = the largest replica count), ``logcnt`` int64
        ``[L, E]``.
    """
    w = _loads_array(weight, "weight")
    return _core.rebalance_experts(w, positive_int(num_replicas, "num_replicas"),
                                   positive_int(num_groups, "num_groups"),
                                   positive_int(num_nodes, "num_nodes"), positive_int(num_gpus, "num_gpus"))


def eplb_num_groups(ctx: PlanContext) -> int:
    """``eplb_num_groups`` from the options, else EPLB's default for this topology."""
    g = ctx.options.get("eplb_num_groups")
    if g is None:
        return int(_core.eplb_default_num_groups(ctx.window.num_experts, ctx.topo))
    return positive_int(g, "eplb_num_groups")


def eplb_placement(ctx: PlanContext) -> Placement:
    """The EPLB baseline on ``ctx.placement_loads()``, every slot filled."""
    loads = _loads_array(ctx.placement_loads(), "loads")
    phy2log = _core.eplb_placement(loads, ctx.topo, eplb_num_groups(ctx))
    return Placement(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


def _demand_window(ctx: PlanContext) -> Any:
    """The window whose samples gave ``ctx.placement_loads()``."""
    return ctx.previous_window if ctx.policy.loads == "previous" else ctx.window


def routepack_placement(ctx: PlanContext) -> Placement:
    """routepack's placement: optimal replication, node-then-rank packing, microbatch
    awareness from per-chunk demand, migration awareness against ``ctx.previous``."""
    opts = ctx.options
    win = _demand_window(ctx)
    if win is None:
        ctx.placement_loads()  # raises the error that names previous_window
    chunks = positive_int(opts.get("placement_chunks", DEFAULT_CHUNKS), "placement_chunks", minimum=0)
    chunks = min(chunks, win.num_samples)
    cells = opts.get("placement_cells")
    if cells is None:
        cells = ctx.topo.num_groups * lower_bound_micro(win, ctx.topo, ctx.token_cap)
    cells = positive_int(cells, "placement_cells")
    slack = finite_float(opts.get("placement_slack", DEFAULT_SLACK), "placement_slack")
    explore = finite_float(opts.get("placement_explore", max(DEFAULT_EXPLORE, slack)), "placement_explore")
    evals = positive_int(opts.get("placement_fluct_evals", DEFAULT_FLUCT_EVALS), "placement_fluct_evals", minimum=0)
    aware = opts.get("placement_migration_aware", True)
    if not isinstance(aware, (bool, np.bool_)):
        raise TypeError(f"placement_migration_aware: expected a bool, got {aware!r}")
    demand = _core.chunk_demand(win.seq_lens, win.expert_tokens, chunks)
    if chunks > 0 and win is ctx.window and ctx.policy.loads == "window":
        # the window total is the sum of its chunks: skip a second pass over [S, L, E]
        loads = np.ascontiguousarray(demand.sum(axis=2))
    else:
        loads = _loads_array(ctx.placement_loads(), "loads")
    previous = ctx.previous.phy2log if ctx.previous is not None else None
    phy2log, report = _core.routepack_placement(loads, demand, ctx.topo, ctx.cost, previous, cells, slack,
                                                explore, evals, bool(aware))
    report["chunks"] = chunks
    report["cells"] = cells
    ctx.reports["placement"] = report
    return Placement(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


def aggregate_imbalance(placement: Placement, loads: Any) -> np.ndarray:
    """float64 ``[L]``: max / mean over EP ranks of window load per rank (each expert's
    ``loads [L, E]`` split evenly over its replicas)."""
    return _core.aggregate_imbalance(placement.phy2log, placement.num_experts, placement.slots_per_rank,
                                     _loads_array(loads, "loads"))


def imbalance_lower_bound(loads: Any, topo: Any) -> np.ndarray:
    """float64 ``[L]``: the lowest aggregate imbalance any placement on ``topo`` can reach,
    max(mean rank load, optimal largest per-replica load) / mean rank load."""
    return _core.imbalance_lower_bound(_loads_array(loads, "loads"), topo.num_slots, topo.ep)


KNOWN_OPTIONS.update({"eplb_num_groups", "placement_chunks", "placement_cells", "placement_slack",
                      "placement_explore", "placement_fluct_evals", "placement_migration_aware"})
PLACEMENTS["eplb"] = eplb_placement
PLACEMENTS["routepack"] = routepack_placement

__all__ = ["rebalance_experts", "eplb_placement", "routepack_placement", "aggregate_imbalance", "imbalance_lower_bound"]
