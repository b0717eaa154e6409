"""Checkpoints and weight sync of `EPMoE` layers: the placement in ``state_dict``, and the
experts in logical order.

* ``EPMoE.state_dict()`` holds this rank's slots (``w1``, ``w2``) and, as ``_extra_state``,
  the layer's placement row ``phy2log`` with the identity it belongs to (layer, E, EP rank,
  EP size, slots per rank). ``load_state_dict`` restores both, so a resumed job keeps the
  placement its weights were saved under; a checkpoint of another rank or shape is refused.
* `export_layer` gathers a layer's experts in logical order, ``[E, H, 2I]`` / ``[E, I, H]``,
  what the unsharded model holds (a rollout engine's weight sync, a framework checkpoint, or
  verl/slime's ``expert // experts_per_rank`` mapping), each from the first slot holding it
  (all copies are equal); ``EPMoE.import_logical`` is its inverse (every slot from its
  expert). `routepack.torch.logical` does both for a list of layers.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.torch import _args

#: version of the ``_extra_state`` layout
_VERSION = 1


def extra_state(mod: Any) -> Dict[str, Any]:
    """What `EPMoE.get_extra_state` saves: the placement row and the layer's identity."""
    return {
        "version": _VERSION,
        "phy2log": torch.from_numpy(mod.phy2log.astype(np.int32, copy=True)),
        "layer": mod.layer,
        "num_experts": mod.num_experts,
        "ep_rank": mod.ep_rank,
        "ep": mod.topo.ep,
        "slots_per_rank": mod.slots_per_rank,
    }


def set_extra_state(mod: Any, state: Any) -> None:
    """`EPMoE.set_extra_state`: installs the placement row of ``state`` (`check_extra_state`)."""
    mod.phy2log = check_extra_state(mod, state)


def check_extra_state(mod: Any, state: Any) -> np.ndarray:
    """The placement row (int32 ``[ep*slots_per_rank]``) of ``state`` after checking that it was
    saved by this EP rank of a layer of the same shape; raises `RoutepackError` naming the
    field otherwise."""
    if not isinstance(state, dict) or "phy2log" not in state:
        raise RoutepackTypeError(
            f"state_dict['_extra_state'] of MoE layer {mod.layer}: expected routepack's "
            f"placement record, got {_args.short(state)}"
        )
    want = {
        "layer": mod.layer,
        "num_experts": mod.num_experts,
        "ep_rank": mod.ep_rank,
        "ep": mod.topo.ep,
        "slots_per_rank": mod.slots_per_rank,
    }
    for key, value in want.items():
        if state.get(key) != value:
            raise RoutepackError(
                f"state_dict['_extra_state'][{key!r}] of MoE layer {mod.layer}: the checkpoint has "
                f"{state.get(key)!r}, this module {value!r} (a checkpoint of another rank or model)"
            )
    row = state["phy2log"]
    row = row.cpu().numpy() if isinstance(row, torch.Tensor) else row
    return _args.placement_row(row, "state_dict['_extra_state']['phy2log']", mod.topo.num_slots, mod.num_experts)


def first_slots(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ``[E]``: the lowest physical slot holding each logical expert."""
    out = np.full(num_experts, -1, dtype=np.int64)
    for s in range(phy2log.size - 1, -1, -1):
        if phy2log[s] >= 0:
            out[phy2log[s]] = s
    return out


@torch.no_grad()
def export_layer(mod: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer's experts in logical order: ``w1`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]`` (the
    parameters' dtype and device), bit for bit the slots' contents, on every rank. Collective
    over the layer's EP group (one all-gather of every rank's slots)."""
    spr, n1 = mod.slots_per_rank, mod.w1[0].numel()
    mine = torch.cat([mod.w1.detach().reshape(spr, -1), mod.w2.detach().reshape(spr, -1)], dim=1).contiguous()
    bufs = [torch.empty_like(mine) for _ in range(mod.topo.ep)]
    dist.all_gather(bufs, mine, group=mod.group)
    slots = torch.cat(bufs)
    pick = torch.from_numpy(first_slots(mod.phy2log, mod.num_experts)).to(slots.device)
    flat = slots.index_select(0, pick)
    return (
        flat[:, :n1].reshape(mod.num_experts, *mod.w1.shape[1:]).clone(),
        flat[:, n1:].reshape(mod.num_experts, *mod.w2.shape[1:]).clone(),
    )


def check_logical(mod: Any, w1: Any, w2: Any) -> None:
    """``w1`` ``[E, H, 2I]`` and ``w2`` ``[E, I, H]`` fit the layer (shapes; a float dtype)."""
    _args.tensor(w1, "w1", 3, "float")
    _args.tensor(w2, "w2", 3, "float")
    for name, t, p in (("w1", w1, mod.w1), ("w2", w2, mod.w2)):
        want = (mod.num_experts,) + tuple(p.shape[1:])
        if tuple(t.shape) != want:
            raise RoutepackError(f"{name}: expected logical weights of shape {want}, got {tuple(t.shape)}")
