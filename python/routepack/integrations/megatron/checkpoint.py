"""The logical model at the boundaries of a Megatron model under a plan (torch, Megatron):
distributed checkpoints and the weight export to a rollout engine or a converter.

* `logical_sharded_state_dict`: the ``sharded_state_dict`` of a `PlanMoELayer`'s
  ``SequentialMLP`` in logical experts. Each local expert's tensors keep Megatron's own
  ``ShardedTensor``s (its MLP builds them: GLU factories, TP axes) with the expert axis at the
  logical index ``e`` of ``num_moe_experts = E`` instead of the physical slot, so the keys and
  shapes are the stock model's. The first local copy of each expert on a rank is saved (the
  first copy in the placement is the main replica); redundant copies, empty slots and replica
  buffers are never saved. Every local expert's entry is a ``ShardedTensorFactory`` over its
  parameter, so Megatron's optimizers (``optimizer.sharded_state_dict(model_sd)``: FP32,
  mixed precision, and ``DistributedOptimizer`` in its ``fully_reshardable`` format) key their
  state by the same logical shards: a checkpoint of model and optimizer written under one
  placement loads into any other (and into the stock model). On load, a second local copy
  takes the first local copy's loaded tensor (weights and every optimizer state), an empty
  slot or replica buffer keeps its weights and gets zero optimizer state. Formats that store
  optimizer state by buffer or flattened range are refused (`_refuse_format`).
* `export_weights`: ``(name, tensor)`` of the whole model with every expert in logical order
  and named as in the stock model without expert parallelism (``local_experts.{e}`` for
  ``SequentialMLP``, ``weight{e}`` / ``bias{e}`` for ``TEGroupedMLP``, ``weight1`` / ``weight2``
  of all E experts for ``GroupedMLP``): what verl's ``per_tensor_generator`` / Megatron-Bridge
  and slime's weight update produce after their EP all-gather, and what the HF↔mcore
  converters take. Works on the stock model too (identity placement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations.megatron.experts import SlotPieces


def _is_moe_layer(m: Any) -> bool:
    return any(c.__name__ == "MoELayer" for c in type(m).__mro__)


def slot_experts(layer: Any) -> np.ndarray:
    """int64 ``[num_local_experts]``: the logical expert of each local Megatron expert of an
    MoE layer (-1: empty or a replica buffer); the stock layer's identity placement."""
    if hasattr(layer, "slot_experts"):
        return layer.slot_experts()
    n = layer.num_local_experts
    return np.arange(n, dtype=np.int64) + dist.get_rank(layer.ep_group) * n


def _num_logical(layer: Any) -> int:
    return int(getattr(layer, "num_logical", layer.config.num_moe_experts))


def _copy_ranks(layer: Any) -> Tuple[np.ndarray, np.ndarray]:
    """(logical id each local expert is keyed by, its copy rank: 0 for the main replica, the
    copies of an expert numbered in placement-slot order; empty slots and replica buffers get
    ranks no copy has)."""
    local = slot_experts(layer)
    n = layer.num_local_experts
    keys = np.where(local >= 0, local, 0)
    if not hasattr(layer, "phy2log"):
        return keys, np.zeros(n, dtype=np.int64)
    ep, me, spr = dist.get_world_size(layer.ep_group), dist.get_rank(layer.ep_group), layer.slots_per_rank
    seen: Dict[int, int] = {}
    copy_of: Dict[int, int] = {}
    for p, e in enumerate(layer.phy2log.tolist()):
        if e >= 0:
            copy_of[p] = seen.get(e, 0)
            seen[e] = copy_of[p] + 1
    ranks = np.array(
        [copy_of[me * spr + i] if i < spr and local[i] >= 0 else ep * n + i for i in range(n)], dtype=np.int64
    )
    return keys, ranks


def logical_sharded_state_dict(layer: Any, prefix: str, sharded_offsets: tuple, metadata: Any) -> Dict[str, Any]:
    """The experts' entries of ``layer.sharded_state_dict`` in logical experts (module
    docstring). ``prefix``: the experts module's (``...mlp.experts.``).

    Every local expert maps to its logical shard; only the first local copy of an expert
    builds a ``ShardedTensor`` (two shards of one tensor on one rank would overlap). A second
    local copy, an empty slot and a replica buffer build a ``LocalNonpersistentObject``
    (neither saved nor read); its merge after a load fills it (`_LoadedCopies`). The weights
    of second copies are also set by `sync_local_copies`, a load-state-dict post-hook."""
    from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
        LocalNonpersistentObject,
        ShardedTensor,
        ShardedTensorFactory,
    )
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding  # type: ignore[import-untyped]
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group  # type: ignore[import-untyped]

    experts = layer.experts
    if not hasattr(experts, "local_experts"):
        raise RoutepackError(
            f"checkpoint: {type(experts).__name__} under a plan: logical sharded_state_dict supports SequentialMLP "
            "only (export_weights supports every expert module)"
        )
    _refuse_format(metadata)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = (metadata or {}).get("singleton_local_shards", False)
    E = _num_logical(layer)
    keys, ranks = _copy_ranks(layer)
    local = slot_experts(layer)
    first = {int(e): i for i, e in reversed(list(enumerate(local.tolist()))) if e >= 0}
    dp, dp_n = experts.dp_group.rank(), experts.dp_group.size()
    copies = _LoadedCopies()
    out: Dict[str, Any] = {}
    for i, expert in enumerate(experts.local_experts):
        e = int(keys[i])
        local_prefix = f"{prefix}local_experts.{i}."
        if singleton:
            sharded_prefix, offsets = f"{prefix}experts.{e}.", sharded_offsets
        else:
            sharded_prefix, offsets = f"{prefix}experts.", (*sharded_offsets, (len(sharded_offsets), e, E))
        sd = expert.sharded_state_dict(local_prefix, offsets, metadata)
        replace_prefix_for_sharding(sd, local_prefix, sharded_prefix)
        role = "empty" if local[i] < 0 else ("first" if first[e] == i else "copy")
        for name, sh in sd.items():
            if role == "first":
                rid = sh.replica_id
                sh.replica_id = (*rid[:2], dp + dp_n * int(ranks[i]))
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                out[name] = _factory(sh, e, role, copies)
            else:  # a ShardedObject (a linear's _extra_state): no optimizer state
                out[name] = sh if role == "first" else LocalNonpersistentObject(sh.data)
    return out


#: DistributedOptimizer formats that store state by buffer or by flattened range of a
#: physical parameter (placement-dependent, or ``flattened_range`` that Megatron 0.16 refuses)
_REFUSED_FORMATS = (
    "dp_reshardable",
    "dp_zero_gather_scatter",
    "fully_sharded_bucket_space",
    "fully_sharded_model_space",
)


def _refuse_format(metadata: Any) -> None:
    fmt = (metadata or {}).get("distrib_optim_sharding_type")
    if fmt in _REFUSED_FORMATS or fmt == "fsdp_dtensor":
        raise RoutepackError(
            f"checkpoint: distrib_optim_sharding_type={fmt!r}: a model under a plan saves optimizer state by "
            "logical expert, which DistributedOptimizer does only in its 'fully_reshardable' format (this one "
            "stores the state of physical slots by buffer or flattened range, so it would load into the wrong "
            "experts under another placement); pass metadata={'distrib_optim_sharding_type': 'fully_reshardable'} "
            "to the model's and the optimizer's sharded_state_dict"
        )


@dataclass
class _Pending:
    """What a not-saved local expert's entry builds: the tensor to fill after a load."""

    key: str
    data: torch.Tensor


class _LoadedCopies:
    """One layer's ``sharded_state_dict`` call: the loaded tensor of each first local copy by
    (checkpoint key, logical expert), and the second copies' tensors it fills (factory merges
    run in any order)."""

    def __init__(self) -> None:
        self.loaded: Dict[Tuple[str, int], torch.Tensor] = {}
        self.waiting: Dict[Tuple[str, int], List[torch.Tensor]] = {}

    @torch.no_grad()
    def first(self, key: str, e: int, t: torch.Tensor) -> None:
        self.loaded[(key, e)] = t
        for d in self.waiting.get((key, e), []):
            d.copy_(t.reshape(d.shape))

    @torch.no_grad()
    def copy(self, key: str, e: int, d: torch.Tensor) -> None:
        self.waiting.setdefault((key, e), []).append(d)
        if (key, e) in self.loaded:
            d.copy_(self.loaded[(key, e)].reshape(d.shape))


def _factory(sh: Any, e: int, role: str, copies: _LoadedCopies) -> Any:
    """A ``ShardedTensorFactory`` over ``sh`` (the local expert's ``ShardedTensor`` or GLU
    factory, keyed by logical expert ``e``) whose ``build`` Megatron's optimizers call with
    their own key and state tensor (``make_sharded_optimizer_tensor`` replaces key and data)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory  # type: ignore[import-untyped]

    param = sh.data
    inner_factory = isinstance(sh, ShardedTensorFactory)

    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        if flattened_range is not None:
            raise RoutepackError(
                f"checkpoint: {key}: optimizer state with a flattened_range (DistributedOptimizer's default "
                "'fully_sharded_model_space' format, which Megatron 0.16 refuses for the stock model too) cannot "
                "be keyed by logical expert; pass metadata={'distrib_optim_sharding_type': 'fully_reshardable'}"
            )
        if role != "first":
            return LocalNonpersistentObject(_Pending(key, data))
        if inner_factory:
            built = replace(sh, key=key, data=data, replica_id=replica_id).build()
        else:
            built = replace(sh, key=key, data=data, dtype=data.dtype, replica_id=replica_id)
            built.validate_metadata_integrity()
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


@torch.no_grad()
def _layer_logical(layer: Any) -> Dict[int, torch.Tensor]:
    """Logical expert → its flat weights (the first copy's), gathered over the EP group."""
    pieces = SlotPieces(layer.experts)
    mine = torch.stack([pieces.weights(s) for s in range(pieces.num_slots)])
    ep = dist.get_world_size(layer.ep_group)
    bufs = [torch.empty_like(mine) for _ in range(ep)]
    dist.all_gather(bufs, mine, group=layer.ep_group)
    n = pieces.num_slots
    allw = torch.cat(bufs)
    out: Dict[int, torch.Tensor] = {}
    for q in range(ep * n):
        e, first = _slot_key(layer, q, n)
        if e >= 0 and first and e not in out:
            out[e] = allw[q]
    return out


def _slot_key(layer: Any, q: int, per_rank: int) -> Tuple[int, bool]:
    """(logical expert, whether it is the expert's first copy) of Megatron expert ``q``."""
    if hasattr(layer, "phy2log"):
        r, i = divmod(q, per_rank)
        if i >= layer.slots_per_rank:
            return -1, False
        p = r * layer.slots_per_rank + i
        e = int(layer.phy2log[p])
        return e, e >= 0 and int(np.flatnonzero(layer.phy2log == e)[0]) == p
    return q, True


def export_weights(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """The model's parameters (and persistent buffers such as ``expert_bias``) with every MoE
    layer's experts in logical order (module docstring). Collective over each MoE layer's EP
    group: every rank of it iterates alike and gets the same experts."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for c in chunks:
        inner = c
        while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        layers = {f"{n}.experts.": m for n, m in inner.named_modules() if _is_moe_layer(m)}
        done = set()
        params = dict(inner.named_parameters())
        for name, p in params.items():
            owner = next((k for k in layers if name.startswith(k)), None)
            if owner is None:
                yield name, p.detach()
                continue
            if owner in done:
                continue
            done.add(owner)
            yield from _export_layer(owner, layers[owner])
        for name, b in inner.state_dict(keep_vars=True).items():
            if name not in params and "_extra_state" not in name and torch.is_tensor(b):
                yield name, b.detach()


def _export_layer(prefix: str, layer: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    pieces = SlotPieces(layer.experts)
    E = _num_logical(layer)
    logical = _layer_logical(layer)
    if set(logical) != set(range(E)):  # pragma: no cover - a valid placement holds every expert
        raise RoutepackError(f"export: MoE layer {prefix} holds experts {sorted(logical)}, not 0..{E - 1}")
    spec = pieces.slots[0]
    off = 0
    for piece in spec:
        chunks = [logical[e][off : off + piece.length] for e in range(E)]
        if pieces.kind == "GroupedMLP":
            shape = list(piece.param.shape)
            shape[1] = shape[1] * E // pieces.num_slots
            yield prefix + piece.name, torch.cat(chunks).view(*shape)
        else:
            for e, flat_w in enumerate(chunks):
                yield prefix + _rename(piece.name, e), flat_w.view(piece.param.shape)
        off += piece.length


def _rename(name: str, e: int) -> str:
    """``local_experts.{i}.x`` → ``local_experts.{e}.x``; ``x.weight{i}`` → ``x.weight{e}``."""
    if name.startswith("local_experts."):
        return re.sub(r"^local_experts\.\d+\.", f"local_experts.{e}.", name)
    return re.sub(r"(weight|bias)\d+$", lambda m: f"{m.group(1)}{e}", name)


__all__ = ["export_weights", "logical_sharded_state_dict", "slot_experts", "sync_local_copies"]
