"""routepack inside Megatron-Core: the whole plan (placement, migration, redundant experts,
intra-batch replicas) carried out by Megatron's own MoE layer, dispatcher and expert MLPs.

Megatron pins expert p to EP rank ``p // num_local_experts`` (``MoELayer.local_expert_indices
= ep_rank * n_local + i``, contiguous, asserted by the all-to-all dispatcher), holds its
weights as ``local_experts[i]`` (``SequentialMLP``) or ``weight{i}`` (``TEGroupedMLP``) on that
rank. A plan's placement has the same shape: physical slot p of layer l lives on EP rank
``p // slots_per_rank`` and holds logical expert ``phy2log[l, p]``. So a layer with
``ep * (slots_per_rank + replica_slots)`` physical experts whose router maps the logical top-k
to physical experts lets the stock dispatcher and expert MLPs run as they are. The training
loop changes by a few lines (docs/megatron.md)::

    spec = rm.plan_layer_spec(get_gpt_layer_local_spec(num_experts=E), topo, replica_slots=2)
    model = GPTModel(config, spec, ...)                 # config.num_moe_experts stays E
    runner = rm.MegatronRunner(ddp_model, topo)
    for plan, window in windows:
        runner.begin_window(plan, window, optimizer)    # migrate weights + main_grad + optimizer state
        forward_backward_func(..., data_iterator=runner.microbatches(data_iterator))
        runner.finish_step(); optimizer.step()

* `plan_layer_spec` / `PlanMoELayer` (`routepack.integrations.megatron.layer`): the stock
  ``MoELayer`` over physical slots; its router is the stock router class over the E logical
  experts (one ``RouterReplay`` entry per layer, ``layer_number`` set, stock checkpoint key)
  whose output is mapped to physical experts on the device, from tables uploaded once per
  window (`routepack.integrations.megatron.tables`): no host sync, no extra collective.
* `MegatronRunner` (`routepack.integrations.megatron.runner`), over the process groups it is
  given (`MegatronGroups`: expert-parallel, pipeline, data-parallel rank and size) or, by
  default, its layers' EP group and Megatron's ``parallel_state`` for the rest
  (`groups_from_parallel_state`); its state within a step is one
  `routepack.integrations.megatron.microbatch.MicrobatchState`. ``begin_window`` migrates
  what the plan moves, with ``main_grad`` and the optimizer's state (``torch.optim``,
  Megatron's FP32 / Float16 / Distributed optimizers:
  `routepack.integrations.megatron.slot_state`); replicas are filled per microbatch and their
  gradients sent home in backward; redundant experts' gradients are summed once per step.
* `export_weights` / checkpoints (`routepack.integrations.megatron.checkpoint`): logical experts at
  every boundary: ``sharded_state_dict`` keeps stock keys (any checkpoint loads into any
  placement), the export names experts as the stock model without EP does.

The numpy-only helpers below (`num_moe_experts`, `local_experts`, `checkpoint_to_logical`,
`logical_to_checkpoint`, `slot_topk`) and the older `plan_router` (a wrapper that routes on
the host: one copy of the ids and an all-gather per forward; no replicas) are kept. This
module imports Megatron and torch only when a name that needs them is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from routepack._checks import index, instance_of
from routepack.integrations.megatron.groups import MegatronGroups, groups_from_parallel_state
from routepack.integrations.megatron.slots import slot_topk
from routepack.plan import Placement, Plan
from routepack.errors import RoutepackTypeError


def _placement(plan_or_placement: Any) -> Placement:
    """The placement of a `Plan`, or a `Placement` itself, its fields checked; anything else
    is refused naming the argument the caller passed, ``plan_or_placement``."""
    if isinstance(plan_or_placement, Plan):
        return instance_of(plan_or_placement.placement, Placement, "plan_or_placement.placement")._check_fields(
            "plan_or_placement.placement"
        )
    if not isinstance(plan_or_placement, Placement):
        raise RoutepackTypeError(
            f"plan_or_placement: expected a routepack.Plan or routepack.Placement, got {type(plan_or_placement).__name__}"
        )
    return plan_or_placement._check_fields("plan_or_placement")


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
    """A `routepack.integrations.megatron.router.PlanRouter` (a ``torch.nn.Module``) for
    MoE layer ``layer``: assign it as ``moe_layer.router``. ``logical_router``: Megatron's
    ``TopKRouter`` built with ``num_moe_experts = E`` (the logical experts), its
    ``RouterReplay`` fed logical top-k as verl/slime feed it; ``ep_group``: the
    expert-parallel process group (None: this process is the only EP rank)."""
    from routepack.integrations.megatron.router import PlanRouter

    return PlanRouter(logical_router, _placement(placement), layer, topo, ep_group)


#: What this execution carries out on a trainer's workers beyond the schedule, where an
#: adapter hands it the plans (`routepack.integrations.shared.trainer.backend_runs`): verl's Megatron
#: engine through `routepack.integrations.verl`'s hooks, slime's actor through the calls of
#: `routepack.integrations.slime` (docs/trainers.md); each adapter blocks what its trainer's
#: configuration does not let it map.
EXECUTES = frozenset({"placement", "replicas"})

#: names served lazily from the torch/Megatron modules (importing this module needs numpy only)
_LAZY = {
    "PlanMoELayer": "routepack.integrations.megatron.layer",
    "plan_layer_spec": "routepack.integrations.megatron.layer",
    "MegatronRunner": "routepack.integrations.megatron.runner",
    "export_weights": "routepack.integrations.megatron.checkpoint",
    "slot_experts": "routepack.integrations.megatron.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EXECUTES",
    "MegatronGroups",
    "MegatronRunner",  # noqa: F822 (lazy: _LAZY)
    "PlanMoELayer",  # noqa: F822 (lazy: _LAZY)
    "checkpoint_to_logical",
    "export_weights",  # noqa: F822 (lazy: _LAZY)
    "groups_from_parallel_state",
    "local_experts",
    "logical_to_checkpoint",
    "num_moe_experts",
    "plan_layer_spec",  # noqa: F822 (lazy: _LAZY)
    "plan_router",
    "slot_experts",  # noqa: F822 (lazy: _LAZY)
    "slot_topk",
]
