"""The logical model at the boundaries of a Megatron model under a plan (torch, Megatron):
distributed checkpoints and the weight export to a rollout engine or a converter.

* `logical_sharded_state_dict`: the ``sharded_state_dict`` of a `PlanMoELayer`'s
  ``SequentialMLP`` in logical experts. Each local expert's tensors keep Megatron's own
  ``ShardedTensor``s (its MLP builds them: GLU factories, TP axes) with the expert axis at the
  logical index ``e`` of ``num_moe_experts = E`` instead of the physical slot, so the keys and
  shapes are the stock model's. The first copy of each expert is the main replica (saved);
  redundant copies, empty slots and replica buffers are non-main replicas (loaded, never
  saved; an empty slot or buffer loads expert 0, which it never computes). Megatron's
  optimizer state follows the model's sharded tensors, so it is logical too: a checkpoint
  written under one placement loads into any other (and into the stock model).
* `export_weights`: ``(name, tensor)`` of the whole model with every expert in logical order
  and named as in the stock model without expert parallelism (``local_experts.{e}`` for
  ``SequentialMLP``, ``weight{e}`` / ``bias{e}`` for ``TEGroupedMLP``, ``weight1`` / ``weight2``
  of all E experts for ``GroupedMLP``): what verl's ``per_tensor_generator`` / Megatron-Bridge
  and slime's weight update produce after their EP all-gather, and what the HF↔mcore
  converters take. Works on the stock model too (identity placement).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations._megatron_experts import SlotPieces


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

    Every local expert that first holds a logical expert on this rank maps to its logical
    shard; a second local copy of the same expert, an empty slot and a replica buffer are
    ``LocalNonpersistentObject``s (neither saved nor read: two shards of one tensor on one rank
    would overlap), and a load puts the first local copy's weights into the second
    (`sync_local_copies`, a load-state-dict post-hook)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject  # type: ignore[import-untyped]
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding  # type: ignore[import-untyped]
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group  # type: ignore[import-untyped]

    experts = layer.experts
    if not hasattr(experts, "local_experts"):
        raise RoutepackError(
            f"checkpoint: {type(experts).__name__} under a plan: logical sharded_state_dict supports SequentialMLP "
            "only (export_weights supports every expert module)"
        )
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = (metadata or {}).get("singleton_local_shards", False)
    E = _num_logical(layer)
    keys, ranks = _copy_ranks(layer)
    local = slot_experts(layer)
    first = {int(e): i for i, e in reversed(list(enumerate(local.tolist()))) if e >= 0}
    dp, dp_n = experts.dp_group.rank(), experts.dp_group.size()
    out: Dict[str, Any] = {}
    for i, expert in enumerate(experts.local_experts):
        e = int(keys[i])
        local_prefix = f"{prefix}local_experts.{i}."
        if singleton:
            sharded_prefix, offsets = f"{prefix}experts.{e}.", sharded_offsets
        else:
            sharded_prefix, offsets = f"{prefix}experts.", (*sharded_offsets, (len(sharded_offsets), e, E))
        sd = expert.sharded_state_dict(local_prefix, offsets, metadata)
        if local[i] < 0 or first[e] != i:
            out.update({k: LocalNonpersistentObject(v.data) for k, v in sd.items()})
            continue
        replace_prefix_for_sharding(sd, local_prefix, sharded_prefix)
        for sh in sd.values():
            rid = sh.replica_id
            sh.replica_id = (*rid[:2], dp + dp_n * int(ranks[i]))
        out.update(sd)
    return out


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
