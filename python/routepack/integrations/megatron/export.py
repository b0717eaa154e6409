"""The logical model at the weight export: ``export_weights`` yields ``(name, tensor)`` of the
whole model with every expert in logical order and named as in the stock model without expert
parallelism (``local_experts.{e}`` for ``SequentialMLP``, ``weight{e}`` / ``bias{e}`` for
``TEGroupedMLP``, ``weight1`` / ``weight2`` of all E experts for ``GroupedMLP``): what verl's
``per_tensor_generator`` / Megatron-Bridge and slime's weight update produce after their EP
all-gather, and what the HF↔mcore converters take. Works on the stock model too (identity
placement). (torch, Megatron)"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations.megatron.checkpoint import is_moe_layer
from routepack.integrations.megatron.experts import SlotPieces


def _num_logical(layer: Any) -> int:
    return int(getattr(layer, "num_logical", layer.config.num_moe_experts))


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
        layers = {f"{n}.experts.": m for n, m in inner.named_modules() if is_moe_layer(m)}
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
        if pieces.kind == "GroupedMLP":  # weight1 [H, n * 2F], weight2 [n * F, H]: E experts in n's place
            shape = list(piece.param.shape)
            axis = 1 if piece.name == "weight1" else 0
            shape[axis] = shape[axis] * E // pieces.num_slots
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


__all__ = ["export_weights"]
