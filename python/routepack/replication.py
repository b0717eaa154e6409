"""Intra-batch replication (DESIGN.md stage 4) and ReLibra's node-level expert reordering.

Replication stages return a structured array of `REPLICA_DTYPE` rows: in microbatch
``micro`` of EP group ``group``, layer ``layer``, the weights of ``expert`` go from EP-local
rank ``src_rank`` (which hosts it) to ``dst_rank``, which computes ``share`` of that expert's
tokens in that cell (routing rule: routepack-core/src/flow.rs).

* ``hot_n``: MindSpeed's balanced MoE. Per cell, N hot experts (option ``hot_experts``,
  default 3) chosen by repeatedly taking the most loaded EP rank and its largest expert;
  their weights go to every EP rank, each computing its own tokens for them.
* ``relibra``: ReLibra's intra-node replication: per cell and node, the hottest expert of the
  most loaded rank is copied to the least loaded rank of the node with the share that levels
  them, at most ``replica_slots`` copies per rank.
* ``routepack``: per cell, the rows and shares that minimise that layer's simulated time
  (expert max, all-to-all, replication traffic not hidden by attention), at most
  ``replica_slots`` copies per rank (default 2), never slower than no replication.

Placement ``relibra``: per window, swaps experts between nodes to balance node loads (and
between the ranks of each node), starting from ``previous`` (or the static placement).

Options (``plan_window(..., **options)``): ``hot_experts`` (int >= 1), ``replica_slots``
(int >= 0, default 2), ``replication_candidates`` (int >= 1: experts and destinations
routepack tries per bottleneck list and step; default 1, which keeps a `flash` plan near
1 s; 2 finds a little more on static placements at about twice the time).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from routepack import _core
from routepack._checks import positive_int
from routepack.plan import REPLICA_DTYPE, Placement
from routepack.policies import KNOWN_OPTIONS, PLACEMENTS, REPLICATIONS, PlanContext

#: MindSpeed's default ``--balanced-moe-hot-expert-num``.
DEFAULT_HOT_EXPERTS = 3
#: Copies a rank may hold per (micro, layer) for `relibra` and `routepack` replication.
DEFAULT_REPLICA_SLOTS = 2
#: Experts and destinations routepack tries per bottleneck list and step (quality vs time).
DEFAULT_CANDIDATES = 1


def replica_table(columns: tuple) -> np.ndarray:
    """Columns ``(micro, group, layer, expert, src_rank, dst_rank: int32 [N], share: float32
    [N])`` → structured array of `REPLICA_DTYPE` [N]."""
    table = np.zeros(len(columns[0]), dtype=REPLICA_DTYPE)
    for name, col in zip(REPLICA_DTYPE.names, columns):
        table[name] = col
    return table


def _option(ctx: PlanContext, name: str, default: int, minimum: int) -> int:
    return positive_int(ctx.options.get(name, default), name, minimum=minimum)


def _common(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray, sample_micro: np.ndarray,
            num_micro: int) -> tuple:
    w = ctx.window
    return (w.seq_lens, w.expert_tokens, placement.phy2log,
            np.ascontiguousarray(sample_rank, dtype=np.int32),
            np.ascontiguousarray(sample_micro, dtype=np.int32), int(num_micro), ctx.topo, ctx.cost)


def hot_n_replication(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray,
                      sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """MindSpeed's hot-expert broadcast; option ``hot_experts`` (default 3)."""
    n = _option(ctx, "hot_experts", DEFAULT_HOT_EXPERTS, 1)
    cols = _core.replicate_hot_n(*_common(ctx, placement, sample_rank, sample_micro, num_micro), n)
    return replica_table(cols)


def relibra_replication(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray,
                        sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """ReLibra's intra-node replication; option ``replica_slots`` (default 2)."""
    slots = _option(ctx, "replica_slots", DEFAULT_REPLICA_SLOTS, 0)
    cols = _core.replicate_relibra(*_common(ctx, placement, sample_rank, sample_micro, num_micro), slots)
    return replica_table(cols)


def routepack_replication(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray,
                          sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """routepack's replication; options ``replica_slots`` (default 2) and
    ``replication_candidates`` (default 1)."""
    slots = _option(ctx, "replica_slots", DEFAULT_REPLICA_SLOTS, 0)
    k = _option(ctx, "replication_candidates", DEFAULT_CANDIDATES, 1)
    cols = _core.replicate_routepack(*_common(ctx, placement, sample_rank, sample_micro, num_micro), slots, k, k)
    return replica_table(cols)


def relibra_placement(ctx: PlanContext) -> Placement:
    """ReLibra's per-window expert reordering from ``ctx.placement_loads()`` ([L, E]),
    starting from ``ctx.previous`` (or the static placement)."""
    loads = np.ascontiguousarray(ctx.placement_loads(), dtype=np.float64)
    prev: Any = None
    if ctx.previous is not None:
        prev = ctx.previous.phy2log
    phy2log = _core.relibra_placement(loads, ctx.topo, prev)
    return Placement(phy2log, ctx.window.num_experts, ctx.topo.slots_per_rank)


REPLICATIONS["hot_n"] = hot_n_replication
KNOWN_OPTIONS.update({"hot_experts", "replica_slots", "replication_candidates"})
REPLICATIONS["relibra"] = relibra_replication
REPLICATIONS["routepack"] = routepack_replication
PLACEMENTS["relibra"] = relibra_placement

__all__ = [
    "DEFAULT_HOT_EXPERTS",
    "DEFAULT_REPLICA_SLOTS",
    "hot_n_replication",
    "relibra_placement",
    "relibra_replication",
    "replica_table",
    "routepack_replication",
]
