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

from typing import Any

import numpy as np

from routepack._checks import index, instance_of
from routepack.integrations._megatron_slots import slot_topk
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


def plan_router(logical_router: Any, placement: Any, layer: int, topo: Any, ep_group: Any = None) -> Any:
    """A `routepack.integrations._megatron_router.PlanRouter` (a ``torch.nn.Module``) for
    MoE layer ``layer``: assign it as ``moe_layer.router``. ``logical_router``: Megatron's
    ``TopKRouter`` built with ``num_moe_experts = E`` (the logical experts), its
    ``RouterReplay`` fed logical top-k as verl/slime feed it; ``ep_group``: the
    expert-parallel process group (None: this process is the only EP rank)."""
    from routepack.integrations._megatron_router import PlanRouter

    return PlanRouter(logical_router, _placement(placement), layer, topo, ep_group)


__all__ = [
    "checkpoint_to_logical",
    "local_experts",
    "logical_to_checkpoint",
    "num_moe_experts",
    "plan_router",
    "slot_topk",
]
