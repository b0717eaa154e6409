"""routepack inside Megatron-Core: a plan's expert placement carried out by Megatron's own
MoE layer, unchanged.

Megatron pins expert p to EP rank ``p // num_local_experts`` (``MoELayer.local_expert_indices
= ep_rank * n_local + i``, contiguous, asserted by the all-to-all dispatcher), holds its
weights as ``weight{i}`` of ``SequentialMLP`` / ``TEGroupedMLP`` on that rank, and names it
``ep_rank * n_local + i`` in checkpoints. A plan's placement has the same shape: physical
slot p of layer l lives on EP rank ``p // slots_per_rank`` and holds logical expert
``phy2log[l, p]``. So with ``num_moe_experts = ep * slots_per_rank`` (the physical slots)
and a router that turns the replayed logical top-k into slot ids, the stock dispatcher and
grouped MLP run as they are:

* `slot_topk`: logical ids → physical slots, by routepack's routing rule (the flow table of
  ``flow::route_exchange``, the one `routepack.torch.route_tokens` and the simulator use),
  so every EP rank receives exactly the tokens the plan predicts;
* `PlanRouter` (`routepack.integrations._megatron_router`, torch): wraps a logical router
  (Megatron's ``TopKRouter`` with ``num_moe_experts = E``, ``RouterReplay`` included) and
  returns Megatron's ``(probs, routing_map)`` over the physical slots;
* `local_experts`: which logical expert ``weight{i}`` on EP rank r holds (-1: an empty slot);
* `checkpoint_to_logical` / `logical_to_checkpoint`: the logical-id export of a checkpoint
  written in physical slots, and the physical checkpoint loaded from a logical one.

Intra-batch replicas (``plan.replicas``) are copies no Megatron slot holds: `slot_topk`
refuses a cell that has them (plan with ``replication="none"``, e.g. the
``routepack_no_replication`` preset). Megatron's all-to-all dispatcher needs CUDA (it creates a
CUDA stream at construction); tools/gpu_megatron.py runs the whole layer on >= 2 GPUs.
This module needs numpy only; `slot_topk` imports torch (via `routepack.torch`).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from routepack._checks import index, instance_of
from routepack.errors import RoutepackError
from routepack.plan import Placement, Plan


def _placement(plan_or_placement: Any) -> Placement:
    if isinstance(plan_or_placement, Plan):
        return plan_or_placement.placement
    return instance_of(plan_or_placement, Placement, "placement")


def num_moe_experts(plan_or_placement: Any) -> int:
    """What Megatron's ``TransformerConfig.num_moe_experts`` must be under the plan: the
    physical slots ``ep * slots_per_rank`` (``num_local_experts`` = ``slots_per_rank``)."""
    return _placement(plan_or_placement).num_slots


def local_experts(plan_or_placement: Any) -> np.ndarray:
    """int32 ``[L, ep, n_local]``: the logical expert whose weights ``weight{i}`` (or
    ``local_experts[i]``) of MoE layer l hold on EP rank r, -1 for an empty slot (weights
    that receive no token). ``n_local = slots_per_rank``. A view of ``phy2log``."""
    p = _placement(plan_or_placement)
    return p.phy2log.reshape(p.num_layers, p.num_ranks, p.slots_per_rank)


def checkpoint_to_logical(plan_or_placement: Any, layer: int) -> np.ndarray:
    """int64 ``[E]``: for each logical expert e of MoE layer ``layer``, the checkpoint
    expert index (``ep_rank * n_local + i``, a physical slot) to export it from: its first
    copy. Exporting a physical checkpoint ``W [P, ...]`` in logical ids is
    ``W[checkpoint_to_logical(plan, l)]``; every copy of an expert holds the same weights
    (routepack keeps them in sync), so any one would do."""
    p = _placement(plan_or_placement)
    layer = index(layer, "layer", p.num_layers, "MoE layers")
    return p.log2phy[layer, :, 0].astype(np.int64)


def logical_to_checkpoint(plan_or_placement: Any, layer: int) -> np.ndarray:
    """int64 ``[P]``: for each checkpoint expert ``ep_rank * n_local + i`` (physical slot)
    of MoE layer ``layer``, the logical expert it loads, or -1 for an empty slot (leave its
    weights as they are: it receives no token). Loading a logical checkpoint ``W [E, ...]``
    into the plan's layout is ``W[ids]`` at the slots where ``ids >= 0``."""
    p = _placement(plan_or_placement)
    layer = index(layer, "layer", p.num_layers, "MoE layers")
    return p.phy2log[layer].astype(np.int64)


def slot_topk(topk_ids: Any, origin: Any, phy2log_row: Any, topo: Any, ep_rank: int,
              cell_rows: Optional[np.ndarray] = None) -> np.ndarray:
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
    flat = np.asarray(route.send_order)
    ids = np.asarray(topk_ids)
    out = route.flows[route.flows["origin"] == ep_rank]
    slot_sorted = np.repeat(out["dst_slot"].astype(np.int64), out["count"])
    # route_tokens' send order is the expert-sorted pairs regrouped by destination rank
    # (stable); undo that regrouping to recover the expert-sorted order's slots
    order = np.argsort(ids.reshape(-1), kind="stable")
    slots = np.empty(order.shape[0], dtype=np.int64)
    slots[order] = slot_sorted
    if not np.array_equal(flat, order[np.argsort(slot_sorted // topo.slots_per_rank, kind="stable")]):
        raise RoutepackError("topk_ids: send order disagrees with the flow table")  # pragma: no cover - an invariant
    return slots.reshape(ids.shape)


def plan_router(logical_router: Any, placement: Any, layer: int, topo: Any, ep_group: Any = None) -> Any:
    """A `routepack.integrations._megatron_router.PlanRouter` (a ``torch.nn.Module``) for
    MoE layer ``layer``: assign it as ``moe_layer.router``. ``logical_router``: Megatron's
    ``TopKRouter`` built with ``num_moe_experts = E`` (the logical experts), its
    ``RouterReplay`` fed logical top-k as verl/slime feed it; ``ep_group``: the
    expert-parallel process group (None: this process is the only EP rank)."""
    from routepack.integrations._megatron_router import PlanRouter

    return PlanRouter(logical_router, _placement(placement), layer, topo, ep_group)


__all__ = ["checkpoint_to_logical", "local_experts", "logical_to_checkpoint", "num_moe_experts", "plan_router",
           "slot_topk"]
