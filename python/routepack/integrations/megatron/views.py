"""How the migration protocol and the replica exchange see a Megatron MoE layer (torch,
Megatron): `LayerView`, the attributes `routepack.torch.migrate.migrate_slots` and
`routepack.torch.ReplicaExchange` read of a layer, and `MegatronExchange`, the exchange over
Megatron's expert modules (one flat buffer per expert, copies landing in the replica
buffers). `routepack.integrations.megatron.MegatronRunner` makes one view per layer."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import torch

from routepack.errors import RoutepackError
from routepack.integrations.megatron.layer import PlanMoELayer
from routepack.torch.replicate import ReplicaExchange


class LayerView:
    """One `PlanMoELayer` as the migration protocol and `ReplicaExchange` read a layer:
    ``layer`` (index among this rank's MoE layers), ``phy2log`` (the placement row), ``topo``,
    ``slots_per_rank``, ``num_experts``, ``ep_rank``, ``peers``, ``group``."""

    def __init__(self, mod: PlanMoELayer, index: int, peers: List[int], group: Any) -> None:
        self.mod, self.layer, self.peers, self.group = mod, index, peers, group
        self.topo, self.ep_rank = mod.topo, mod.ep_rank
        self.slots_per_rank, self.num_experts = mod.slots_per_rank, mod.num_logical

    @property
    def phy2log(self) -> np.ndarray:
        return self.mod.phy2log

    @phy2log.setter
    def phy2log(self, row: np.ndarray) -> None:
        self.mod.phy2log = np.ascontiguousarray(row, dtype=np.int32)

    def local_slot_of(self, expert: int) -> int:
        hit = np.flatnonzero(self.mod.local_experts() == expert)
        if hit.size == 0:
            raise RoutepackError(f"expert {expert} is not on EP rank {self.ep_rank} in MoE layer {self.mod.moe_index}")
        return int(hit[0])


class MegatronExchange(ReplicaExchange):
    """`ReplicaExchange` over Megatron's expert modules: one flat buffer per expert
    (`SlotPieces`); copies land in the layer's replica buffers."""

    def slot_flat(self, mod: Any, slot: int) -> torch.Tensor:
        return mod.mod.pieces.weights(slot)

    def flat_spec(self, mod: Any) -> Tuple[int, torch.dtype, torch.device]:
        p = mod.mod.pieces
        return p.numel, p.dtype, p.device

    def unflatten(self, mod: Any, copies: List[torch.Tensor]) -> Any:
        return copies

    def copy_grad(self, grads: Any, copy: int) -> torch.Tensor:
        return grads.mod.pieces.grad(grads.slots_per_rank + copy)


__all__ = ["LayerView", "MegatronExchange"]
