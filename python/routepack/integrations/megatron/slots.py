"""`slot_topk`: replayed logical top-k → the plan's physical slots (Megatron's expert ids
under ``num_moe_experts = ep * slots_per_rank``), by routepack's routing rule. Its own
module so that `routepack.integrations.megatron` and its torch router both build on it."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from routepack.errors import RoutepackError
from routepack.integrations.shared.arrays import as_numpy


def slot_topk(
    topk_ids: Any, origin: Any, phy2log_row: Any, topo: Any, ep_rank: int, cell_rows: Optional[np.ndarray] = None
) -> np.ndarray:
    """Physical slot ids of this EP rank's replayed logical top-k, one MoE layer.

    Args:
        topk_ids:    int ``[T, k]``: logical expert ids of this rank's tokens (replayed).
        origin:      int64 ``[ep, E]``: every EP rank's (token, k) counts per logical expert
                     (all-gathered); row ``ep_rank`` must be the histogram of ``topk_ids``.
        phy2log_row: int32 ``[ep * slots_per_rank]``: the layer's placement.
        topo:        `routepack.Topology`; ``ep_rank`` in ``[0, ep)``.
        cell_rows:   the cell's ``plan.replicas`` rows, if any: refused when non-empty.

    Returns:
        int64 ``[T, k]``: the slot (``ep_rank' * slots_per_rank + i``, Megatron's expert
        index under `num_moe_experts`) each pair is computed in. Pairs of logical expert e
        taken in ascending flat index ``t*k + j`` go to e's flows from this rank in
        flow-table order: exactly `routepack.torch.route_tokens`'s assignment, so the rows
        each rank receives are the plan's prediction.
    """
    from routepack.plan import REPLICA_DTYPE
    from routepack.torch.remap import route_tokens

    rows = np.zeros(0, dtype=REPLICA_DTYPE) if cell_rows is None else np.asarray(cell_rows)
    if len(rows):
        raise RoutepackError(
            f"cell_rows: {len(rows)} intra-batch replicas; Megatron's stock dispatcher computes placement slots only "
            "(plan with replication='none', e.g. policy='routepack_no_replication')"
        )
    route = route_tokens(topk_ids, origin, phy2log_row, topo, rows, ep_rank)
    ids = as_numpy(topk_ids, "topk_ids")
    # this rank's flows (experts ascending, each in table order) are the slots of its pairs
    # sorted by expert, ascending flat index inside (route_tokens' rule): put them back at
    # the pairs' own positions
    out = route.flows[route.flows["origin"] == ep_rank]
    slot_sorted = np.repeat(out["dst_slot"].astype(np.int64), out["count"])
    order = np.argsort(ids.reshape(-1), kind="stable")
    slots = np.empty(order.shape[0], dtype=np.int64)
    slots[order] = slot_sorted
    # the ranks the slots lie on send the pairs in route_tokens' own order
    by_rank = order[np.argsort(slot_sorted // topo.slots_per_rank, kind="stable")]
    if not np.array_equal(np.asarray(route.send_order), by_rank):  # pragma: no cover - an invariant
        raise RoutepackError("topk_ids: the slots disagree with route_tokens' send order")
    return slots.reshape(ids.shape)


__all__ = ["slot_topk"]
