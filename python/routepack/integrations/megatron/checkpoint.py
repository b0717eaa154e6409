"""The logical model in Megatron's distributed checkpoints of a model under a plan (torch,
Megatron): `logical_sharded_state_dict` is the experts' part of a `PlanMoELayer`'s
``sharded_state_dict``, keyed and shaped as the stock model's whatever the placement, for
each expert module Megatron builds:

* ``SequentialMLP`` and ``TEGroupedMLP`` (one set of parameters a local expert:
  ``local_experts.{i}.*``, ``weight{i}`` / ``bias{i}``): the module's own
  ``sharded_state_dict`` is called (Megatron's GLU factories, TE's per-GEMM shards and extra
  states, TP axes, replica ids) and each entry of local expert ``i`` is relabeled from the
  physical expert ``ep_rank * n_local + i`` of ``ep * n_local`` to its logical expert ``e`` of
  ``E`` (the expert axis of its ``ShardedTensor`` / ``ShardedObject``, or the ``experts.{i}.``
  of its key with ``singleton_local_shards``).
* ``GroupedMLP`` (every local expert in ``weight1`` ``[H, n * 2F]`` / ``weight2``
  ``[n * F, H]``): one factory a parameter builds, per local expert, the shards Megatron's
  own ``GroupedMLP`` factory builds for it (expert ``i``'s ``view(n, H, -1)[i]`` transposed,
  GLU halves ``w`` / ``v``), at logical expert ``e``, and merges the loaded experts back into
  a tensor of the parameter's shape.

The first local copy of each expert on a rank is saved (the first copy in the placement is the
main replica, a redundant copy on another rank a non-main replica); second local copies, empty
slots and replica buffers are never saved. Every entry is a ``ShardedTensorFactory`` over its
parameter, so Megatron's optimizers (``optimizer.sharded_state_dict(model_sd)``: FP32, mixed
precision, ``DistributedOptimizer`` in its ``fully_reshardable`` format) key their state by
the same logical shards: a checkpoint of model and optimizer written under one placement
loads into any other (and into the stock model). On load a second local copy takes the first
local copy's loaded tensor (weights and every optimizer state); an empty slot or replica
buffer keeps its weights and gets zero optimizer state. Formats that store optimizer state by
buffer or flattened range are refused (`_refuse_format`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations.megatron.checkpoint_slots import LoadedCopies, Slot, refuse_flattened


def is_moe_layer(m: Any) -> bool:
    """Whether ``m`` is a Megatron ``MoELayer`` (a `PlanMoELayer` too)."""
    return any(c.__name__ == "MoELayer" for c in type(m).__mro__)


def slot_experts(layer: Any) -> np.ndarray:
    """int64 ``[num_local_experts]``: the logical expert of each local Megatron expert of an
    MoE layer (-1: empty or a replica buffer); the stock layer's identity placement."""
    if hasattr(layer, "slot_experts"):
        return layer.slot_experts()
    n = layer.num_local_experts
    return np.arange(n, dtype=np.int64) + dist.get_rank(layer.ep_group) * n


def _slots(layer: Any) -> List[Slot]:
    local = slot_experts(layer)
    n = layer.num_local_experts
    ranks = np.zeros(n, dtype=np.int64)
    if hasattr(layer, "phy2log"):  # copies of an expert numbered in placement-slot order
        me, spr = dist.get_rank(layer.ep_group), layer.slots_per_rank
        seen: Dict[int, int] = {}
        for p, e in enumerate(layer.phy2log.tolist()):
            if e >= 0:
                if me * spr <= p < (me + 1) * spr:
                    ranks[p - me * spr] = seen.get(e, 0)
                seen[e] = seen.get(e, 0) + 1
    first: Dict[int, int] = {}
    out = []
    for i, e in enumerate(local.tolist()):
        if e < 0:
            out.append(Slot(0, "empty", 0))
        else:
            out.append(Slot(int(e), "copy" if e in first else "first", int(ranks[i])))
            first.setdefault(int(e), i)
    return out


def logical_sharded_state_dict(layer: Any, prefix: str, sharded_offsets: tuple, metadata: Any) -> Dict[str, Any]:
    """The experts' entries of ``layer.sharded_state_dict`` in logical experts (module
    docstring). ``prefix``: the experts module's (``...mlp.experts.``)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group  # type: ignore[import-untyped]

    _refuse_format(metadata)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    slots = _slots(layer)
    E = int(getattr(layer, "num_logical", layer.config.num_moe_experts))
    experts = layer.experts
    singleton = bool((metadata or {}).get("singleton_local_shards", False))
    edp_group = _expert_dp_group(experts)
    edp = dist.get_rank(edp_group) if edp_group is not None else 0
    edp_n = dist.get_world_size(edp_group) if edp_group is not None else 1
    copies = LoadedCopies()
    if hasattr(experts, "weight1"):  # GroupedMLP
        from routepack.integrations.megatron.grouped_checkpoint import grouped_sharded_state_dict

        return grouped_sharded_state_dict(experts, slots, E, prefix, sharded_offsets, singleton, (edp, edp_n), copies)
    n = experts.num_local_experts
    base = dist.get_rank(experts.ep_group) * n
    axis = len(sharded_offsets)
    out: Dict[str, Any] = {}
    for name, sh in experts.sharded_state_dict(prefix, sharded_offsets, metadata).items():
        i = _local_index(name[len(prefix) :])
        slot = slots[i]
        relabel = _relabeler(axis, base + i, slot.expert, E, singleton)
        if slot.role == "first":
            rid = sh.replica_id
            sh.replica_id = (*rid[:2], edp + edp_n * slot.rank)
        out[name] = _entry(sh, slot, relabel, copies)
    return out


def _expert_dp_group(experts: Any) -> Any:
    """The expert-data-parallel group the experts' checkpoint replicas are over:
    ``SequentialMLP`` / ``GroupedMLP`` hold it (``dp_group``); ``TEGroupedMLP`` does not, its
    ``TEGroupedLinear`` modules do (``_pg_collection.expt_dp``, what their own
    ``_sharded_state_dict_grouped`` reads). None: no such group (one replica)."""
    group = getattr(experts, "dp_group", None)
    if group is None:
        pgs = getattr(getattr(experts, "linear_fc1", None), "_pg_collection", None)
        group = getattr(pgs, "expt_dp", None)
    return group


def _local_index(name: str) -> int:
    """Local expert of an experts module's state-dict entry: ``local_experts.{i}.…``
    (``SequentialMLP``), ``linear_fc{1,2}.weight{i}`` / ``bias{i}`` / ``_extra_state{i}``
    (``TEGroupedMLP``; TE names the first GEMM's extra state ``_extra_state``)."""
    m = re.match(r"local_experts\.(\d+)\.", name) or re.search(r"(?:weight|bias|_extra_state)(\d*)$", name)
    if m is None:
        raise RoutepackError(f"checkpoint: cannot tell which local expert the entry {name!r} belongs to")
    return int(m.group(1) or 0)


def _relabeler(axis: int, physical: int, e: int, E: int, singleton: bool) -> Callable[[Any], Any]:
    """A function moving a ``ShardedTensor`` / ``ShardedObject`` of physical expert
    ``physical`` to logical expert ``e`` of ``E``: its expert axis ``axis`` (a prepended axis:
    one fragment an expert), or with ``singleton_local_shards`` the ``experts.{i}.`` in its key."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # type: ignore[import-untyped]

    def put(t: tuple, value: int) -> tuple:
        return (*t[:axis], value, *t[axis + 1 :])

    def relabel(sh: Any) -> Any:
        if singleton:
            return replace(sh, key=sh.key.replace(f"experts.{physical}.", f"experts.{e}.", 1))
        if isinstance(sh, ShardedTensor):
            return replace(
                sh,
                global_shape=put(sh.global_shape, E),
                global_offset=put(sh.global_offset, e),
                axis_fragmentations=put(sh.axis_fragmentations, E),
            )
        if isinstance(sh, ShardedObject):
            return replace(sh, global_shape=put(sh.global_shape, E), global_offset=put(sh.global_offset, e))
        return sh

    return relabel


def _entry(sh: Any, slot: Slot, relabel: Callable[[Any], Any], copies: LoadedCopies) -> Any:
    """``sh`` (a stock entry of ``slot``) as the plan's checkpoint holds it."""
    from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
        LocalNonpersistentObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
        return _factory(sh, slot, relabel, copies)
    # a ShardedObject (a linear's _extra_state): no optimizer state
    return relabel(sh) if slot.role == "first" else LocalNonpersistentObject(sh.data)


#: DistributedOptimizer formats that store state by buffer or by flattened range of a
#: physical parameter (placement-dependent, or ``flattened_range`` that Megatron 0.16 refuses)
_REFUSED_FORMATS = (
    "dp_reshardable",
    "dp_zero_gather_scatter",
    "fully_sharded_bucket_space",
    "fully_sharded_model_space",
)


#: the setting that makes Megatron-LM's and verl's checkpoint code pass 'fully_reshardable'
FULLY_RESHARDABLE_SETTING = (
    "set dist_ckpt_optim_fully_reshardable=True (Megatron-LM: --dist-ckpt-optim-fully-reshardable; verl: "
    "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=True), or pass "
    "metadata={'distrib_optim_sharding_type': 'fully_reshardable'} to the model's and the optimizer's "
    "sharded_state_dict"
)


def _get(settings: Any, key: str) -> Any:
    return settings.get(key) if isinstance(settings, dict) else getattr(settings, key, None)


def checkpoint_format(settings: Any) -> Any:
    """The ``distrib_optim_sharding_type`` a trainer's checkpoint code will pass, from its
    settings: the metadata dict itself (``distrib_optim_sharding_type``), or Megatron-LM's
    ``args`` / verl's Megatron engine config, whose checkpoint code
    (``_build_sharded_state_dict_metadata`` in both) passes ``'fsdp_dtensor'`` under Megatron
    FSDP (``use_megatron_fsdp`` / ``ckpt_format='fsdp_dtensor'``), else with
    ``DistributedOptimizer`` (``use_distributed_optimizer``, absent: on, verl's default)
    ``'fully_reshardable'`` where ``dist_ckpt_optim_fully_reshardable`` and ``'dp_reshardable'``
    (its default) where not. None: no ``DistributedOptimizer`` format (its state by parameter)."""
    if _get(settings, "distrib_optim_sharding_type") is not None:
        return _get(settings, "distrib_optim_sharding_type")
    if _get(settings, "use_megatron_fsdp") or _get(settings, "ckpt_format") == "fsdp_dtensor":
        return "fsdp_dtensor"
    if _get(settings, "use_distributed_optimizer") is False:
        return None
    if _get(settings, "dist_ckpt_optim_fully_reshardable") is None:
        raise RoutepackError(
            f"checkpoint: {type(settings).__name__} has neither distrib_optim_sharding_type (the metadata passed to "
            "sharded_state_dict) nor dist_ckpt_optim_fully_reshardable (Megatron-LM's args, verl's megatron config)"
        )
    return "fully_reshardable" if _get(settings, "dist_ckpt_optim_fully_reshardable") else "dp_reshardable"


def refuse_checkpoint_format(settings: Any) -> None:
    """Refuses (`RoutepackError` naming the setting to change) checkpoint settings
    (`checkpoint_format`'s forms) whose ``DistributedOptimizer`` format stores the state of
    physical slots: what `MegatronRunner` checks when it is built."""
    _refuse(checkpoint_format(settings))


def _refuse_format(metadata: Any) -> None:
    """The same for the metadata a ``sharded_state_dict`` call gets (no format named: the
    optimizer's state is by parameter, or Megatron's default, refused at its own flattened ranges)."""
    _refuse((metadata or {}).get("distrib_optim_sharding_type"))


def _refuse(fmt: Any) -> None:
    if fmt in _REFUSED_FORMATS or fmt == "fsdp_dtensor":
        raise RoutepackError(
            f"checkpoint: distrib_optim_sharding_type={fmt!r}: a model under a plan saves optimizer state by "
            "logical expert, which DistributedOptimizer does only in its 'fully_reshardable' format (this one "
            "stores the state of physical slots by buffer or flattened range, so it would load into the wrong "
            f"experts under another placement); {FULLY_RESHARDABLE_SETTING}"
        )


@dataclass
class _Pending:
    """What a not-saved local expert's entry builds: the tensor to fill after a load."""

    key: str
    data: torch.Tensor


def _apply(relabel: Callable[[Any], Any], built: Any) -> Any:
    """``relabel`` on every sharded entry of a factory's built structure (dicts, lists)."""
    if isinstance(built, dict):
        return {k: _apply(relabel, v) for k, v in built.items()}
    if isinstance(built, list):
        return [_apply(relabel, v) for v in built]
    return relabel(built)


def _factory(sh: Any, slot: Slot, relabel: Callable[[Any], Any], copies: LoadedCopies) -> Any:
    """A ``ShardedTensorFactory`` over ``sh`` (a local expert's ``ShardedTensor`` or GLU factory)
    whose ``build`` Megatron's optimizers call with their own key and state tensor
    (``make_sharded_optimizer_tensor`` replaces key and data); what it builds is relabeled to
    the slot's logical expert."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory  # type: ignore[import-untyped]

    param = sh.data
    inner_factory = isinstance(sh, ShardedTensorFactory)
    e, role = slot.expert, slot.role

    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        refuse_flattened(key, flattened_range)
        if role != "first":
            return LocalNonpersistentObject(_Pending(key, data))
        if inner_factory:
            built = replace(sh, key=key, data=data, replica_id=replica_id).build()
        else:
            built = replace(sh, key=key, data=data, dtype=data.dtype, replica_id=replica_id)
        built = _apply(relabel, built)
        _apply(lambda t: t.validate_metadata_integrity() if hasattr(t, "validate_metadata_integrity") else t, built)
        return {"tensor": built, "key": LocalNonpersistentObject(key)}

    @torch.no_grad()
    def merge(loaded: Any) -> Any:
        if role == "first":
            t = sh.merge_fn(loaded["tensor"]) if inner_factory else loaded["tensor"]
            copies.first(loaded["key"], e, t)
            return t
        if role == "copy":
            copies.copy(loaded.key, e, loaded.data)
        elif loaded.data is not param:  # optimizer state of a slot that holds no expert
            loaded.data.zero_()
        return loaded.data

    return ShardedTensorFactory(sh.key, param, build, merge, sh.replica_id)


@torch.no_grad()
def sync_local_copies(layer: Any, *_: Any) -> None:
    """Every second local copy of a logical expert takes the first local copy's weights (after
    a load: the sharded state dict reads each expert once per rank)."""
    local = slot_experts(layer)
    first: Dict[int, int] = {}
    for i, e in enumerate(local.tolist()):
        if e < 0:
            continue
        if e in first:
            layer.pieces.set_weights(i, layer.pieces.weights(first[e]))
        else:
            first[e] = i


__all__ = [
    "FULLY_RESHARDABLE_SETTING",
    "checkpoint_format",
    "refuse_checkpoint_format",
    "is_moe_layer",
    "logical_sharded_state_dict",
    "slot_experts",
    "sync_local_copies",
]
