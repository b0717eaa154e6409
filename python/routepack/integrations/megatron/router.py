"""`PlanRouter`: Megatron's router output over a plan's physical slots (torch).

Megatron's ``MoELayer.forward`` calls ``self.router(hidden_states)`` (with ``padding_mask=``
where it has one) and dispatches ``(probs, routing_map)``, both ``[tokens, num_moe_experts]``.
`PlanRouter` runs the logical router (gate over E logical experts, ``RouterReplay``, aux
losses: all unchanged, all in logical ids), then moves each selected (token, expert) pair to
the physical slot `routepack.integrations.megatron.slot_topk` names, keeping its
probability. With ``num_moe_experts = ep * slots_per_rank`` the dispatcher sends the pair to
the slot's EP rank and the grouped MLP computes it with that slot's ``weight{i}``, which holds
the logical expert's weights (`local_experts`): the layer computes the logical model's
function. Attributes the layer reads from its router (``weight``, ``local_tokens_per_expert``,
``set_layer_number``, ...) are the logical router's.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack._checks import index, instance_of
from routepack.errors import RoutepackError
from routepack.integrations.megatron.slots import slot_topk
from routepack.model import Topology
from routepack.plan import Placement


class PlanRouter(torch.nn.Module):
    """See the module docstring. ``placement``: the plan's `Placement`; ``layer``: this MoE
    layer's index in it; ``topo``: the plan's `Topology` (``topo.ep`` EP ranks, the size of
    ``ep_group``; None: a single EP rank, this process)."""

    def __init__(
        self,
        logical_router: torch.nn.Module,
        placement: Placement,
        layer: int,
        topo: Topology,
        ep_group: Optional[Any] = None,
    ) -> None:
        super().__init__()
        instance_of(placement, Placement, "placement")
        instance_of(topo, Topology, "topo")
        layer = index(layer, "layer", placement.num_layers, "MoE layers")
        if placement.num_slots != topo.num_slots:
            raise RoutepackError(f"placement: {placement.num_slots} slots, topo has {topo.num_slots}")
        size = dist.get_world_size(ep_group) if ep_group is not None else 1
        if size != topo.ep:
            raise RoutepackError(f"ep_group: {size} ranks, topo.ep is {topo.ep}")
        self.logical = logical_router
        self.phy2log_row = np.ascontiguousarray(placement.phy2log[layer])
        self.num_experts = placement.num_experts
        self.topo = topo
        self.ep_group = ep_group
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("logical"), name)

    def forward(
        self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if padding_mask is None:
            probs, routing_map = self.logical(input)
        else:
            probs, routing_map = self.logical(input, padding_mask=padding_mask)
        return self.to_physical(probs, routing_map)

    def to_physical(self, probs: torch.Tensor, routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Logical ``probs`` / ``routing_map`` ``[T, E]`` (float / bool) → the same over the
        ``P`` physical slots ``[T, P]``; gradients flow to ``probs``."""
        if routing_map.dim() != 2 or routing_map.shape[1] != self.num_experts:
            raise RoutepackError(f"routing_map: expected [T, {self.num_experts}], got {tuple(routing_map.shape)}")
        tok, exp = torch.nonzero(routing_map, as_tuple=True)  # row-major: ascending (t, e)
        counts = torch.bincount(exp, minlength=self.num_experts).to(torch.int64)
        origin = self._gather(counts)
        ids = exp.cpu().numpy().reshape(-1, 1)
        slots = torch.from_numpy(slot_topk(ids, origin, self.phy2log_row, self.topo, self.ep_rank)[:, 0])
        slots = slots.to(routing_map.device)
        t_n, p_n = routing_map.shape[0], self.topo.num_slots
        phys_map = torch.zeros((t_n, p_n), dtype=torch.bool, device=routing_map.device)
        phys_map[tok, slots] = True
        phys_probs = probs.new_zeros((t_n, p_n))
        phys_probs = phys_probs.index_put((tok, slots), probs[tok, exp])
        return phys_probs, phys_map

    def _gather(self, counts: torch.Tensor) -> np.ndarray:
        """int64 ``[ep, E]``: every EP rank's pair counts (an all-gather over ``ep_group``)."""
        if self.ep_group is None:
            return counts.cpu().numpy()[None, :]
        out = [torch.zeros_like(counts) for _ in range(self.topo.ep)]
        dist.all_gather(out, counts, group=self.ep_group)
        return torch.stack(out).cpu().numpy()


__all__ = ["PlanRouter"]
