"""The plan's routing tables for one Megatron MoE layer on one EP rank, and the on-device map
from the router's logical ``(probs, routing_map)`` to Megatron's physical experts.

Megatron's expert index under a plan is ``rank * per_rank + i`` with ``per_rank =
slots_per_rank + replica_slots``: local experts ``0 .. slots_per_rank-1`` are the placement's
slots (``phy2log``), the next ``replica_slots`` hold the cell's intra-batch replica copies
(the j-th row of ``plan.replicas`` with ``dst_rank == rank``, table order, in buffer j).

For each (micro, layer) cell, `layer_tables` runs the plan's own routing rule
(`routepack.torch.flow_table`: ``flow::route_exchange``, what `simulate` prices) on the
cell's per-rank expert counts (window + plan layout) and keeps this rank's flows: for each
logical expert e, the physical experts its pairs go to and how many, in flow-table order.
On the device (`SlotMap.physical`) the pairs of e are taken in token order (what
`routepack.torch.route_tokens` does) and the first ``count[0]`` go to the first copy, the
next ``count[1]`` to the second, ...: a cumulative sum over the routing map, a comparison
with the bounds, a gather and a scatter. No host sync, no collective; the tables are
uploaded once per window. When the ids differ from the window's (no replay), pairs past the
last bound go to the last copy: the layer still computes the logical model's function.

Outside a planned microbatch (evaluation, log-prob passes) `default_table` shares each
expert's pairs among its placement copies in the proportions the plan's rule gives the
window's total load (`SlotMap.physical` with ``micro=None``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from routepack.errors import InvalidPlanError, RoutepackError
from routepack.plan import empty_replicas
from routepack.torch.remap import flow_table
from routepack.torch.routes import cell_origins

#: bound of a padded copy column: no pair index reaches it
_NO_BOUND = 1 << 62


def cell_rows(plan: Any, group: int, micro: int, layer: int) -> np.ndarray:
    """The replicas of (EP group ``group``, ``micro``, ``layer``), table order."""
    r = plan.replicas
    if r.size == 0:
        return empty_replicas()
    sel = (r["group"] == group) & (r["micro"] == micro) & (r["layer"] == layer)
    return r[sel]


def buffer_of(rows: np.ndarray, replica_slots: int, where: str) -> np.ndarray:
    """int64 ``[R]``: the replica buffer (0 .. replica_slots-1) on its destination rank of
    each row (its order among the rows with the same ``dst_rank``); refuses a cell whose
    copies on one rank exceed ``replica_slots``."""
    out = np.zeros(len(rows), dtype=np.int64)
    seen: dict = {}
    for j, d in enumerate(rows["dst_rank"].tolist()):
        out[j] = seen.get(d, 0)
        seen[d] = out[j] + 1
    if len(rows) and int(out.max()) >= replica_slots:
        d = int(rows["dst_rank"][int(out.argmax())])
        raise InvalidPlanError(
            f"plan.replicas: {where} puts {int(out.max()) + 1} copies on EP rank {d}, but the layers hold "
            f"replica_slots={replica_slots} buffers a rank (build them with more, or plan with fewer copies)"
        )
    return out


def _flows_to_table(flows: np.ndarray, rows: np.ndarray, bufs: np.ndarray, topo: Any, per_rank: int, me: int, E: int):
    """This rank's flows as per-expert lists: ([E] lists of physical ids, [E] lists of counts)."""
    spr = topo.slots_per_rank
    mine = flows[flows["origin"] == me]
    ids: list = [[] for _ in range(E)]
    counts: list = [[] for _ in range(E)]
    for f in mine:
        e, d = int(f["expert"]), int(f["dst_rank"])
        if int(f["dst_slot"]) >= 0:
            phys = d * per_rank + int(f["dst_slot"]) - d * spr
        else:
            phys = d * per_rank + spr + int(bufs[int(f["replica"])])
        ids[e].append(phys)
        counts[e].append(int(f["count"]))
    return ids, counts


def _first_copies(phy2log_row: np.ndarray, topo: Any, per_rank: int, E: int) -> np.ndarray:
    """int64 ``[E]``: Megatron's index of each expert's lowest placement slot."""
    spr = topo.slots_per_rank
    out = np.full(E, -1, dtype=np.int64)
    for p in range(phy2log_row.size - 1, -1, -1):
        e = int(phy2log_row[p])
        if e >= 0:
            out[e] = (p // spr) * per_rank + p % spr
    return out


def _pack(ids: list, counts: list, first: np.ndarray, cumulative: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Per-expert lists as padded ``[E, C]`` arrays: bounds (cumulative counts, or cumulative
    fractions with ``cumulative=False``... see callers) and physical ids."""
    E = len(ids)
    C = max(1, max((len(x) for x in ids), default=1))
    bounds = np.full((E, C), _NO_BOUND if cumulative else 2.0, dtype=np.int64 if cumulative else np.float64)
    slots = np.zeros((E, C), dtype=np.int64)
    for e in range(E):
        if not ids[e]:
            slots[e, :] = first[e]
            continue
        c = np.cumsum(np.asarray(counts[e], dtype=np.int64))
        if cumulative:
            bounds[e, : c.size] = c
        else:
            bounds[e, : c.size] = c / max(int(c[-1]), 1)
        slots[e, : c.size] = ids[e]
        slots[e, c.size :] = ids[e][-1]
    return bounds, slots


def layer_tables(
    plan: Any, window: Any, topo: Any, layer: int, ep_rank: int, group: int, replica_slots: int
) -> Tuple[np.ndarray, np.ndarray]:
    """``(bounds, slots)`` int64 ``[M, E, C]`` of MoE layer ``layer`` on EP rank ``ep_rank`` of
    EP group ``group``: per micro and logical expert, the cumulative pair counts of its flows
    from this rank and their Megatron expert indices (see the module docstring)."""
    per_rank = topo.slots_per_rank + replica_slots
    E = plan.placement.num_experts
    row = plan.placement.phy2log[layer]
    origins = cell_origins(plan, window, group, topo.ep)  # [M, ep, L, E]
    first = _first_copies(row, topo, per_rank, E)
    tabs = []
    for m in range(plan.num_micro):
        rows = cell_rows(plan, group, m, layer)
        bufs = buffer_of(rows, replica_slots, f"(group {group}, micro {m}, layer {layer})")
        flows = flow_table(np.ascontiguousarray(origins[m, :, layer]), row, topo, rows)
        ids, counts = _flows_to_table(flows, rows, bufs, topo, per_rank, ep_rank, E)
        tabs.append(_pack(ids, counts, first, True))
    C = max(b.shape[1] for b, _ in tabs)
    bounds = np.full((len(tabs), E, C), _NO_BOUND, dtype=np.int64)
    slots = np.zeros((len(tabs), E, C), dtype=np.int64)
    for m, (b, s) in enumerate(tabs):
        bounds[m, :, : b.shape[1]] = b
        slots[m, :, : s.shape[1]] = s
        slots[m, :, s.shape[1] :] = s[:, -1:]
    return bounds, slots


def default_table(
    phy2log_row: np.ndarray, topo: Any, ep_rank: int, replica_slots: int, origin: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """``(fractions float64 [E, C], slots int64 [E, C])``: each expert's cumulative share of
    this rank's pairs per placement copy, by the plan's rule on ``origin`` (int ``[ep, E]``,
    e.g. the window's total per-rank counts; None: one pair each). One is added to every count
    so that every expert has a share from every rank."""
    E = int(phy2log_row.max()) + 1 if origin is None else int(origin.shape[1])
    base = np.ones((topo.ep, E), dtype=np.int64) if origin is None else np.asarray(origin, dtype=np.int64) + 1
    per_rank = topo.slots_per_rank + replica_slots
    flows = flow_table(base, phy2log_row, topo, empty_replicas())
    ids, counts = _flows_to_table(flows, empty_replicas(), np.zeros(0, dtype=np.int64), topo, per_rank, ep_rank, E)
    return _pack(ids, counts, _first_copies(phy2log_row, topo, per_rank, E), False)


class SlotMap:
    """One layer's tables on the device and the logical → physical map (see the module
    docstring). ``num_physical``: Megatron's ``num_moe_experts`` under the plan."""

    def __init__(self, num_experts: int, num_physical: int) -> None:
        self.num_experts = num_experts
        self.num_physical = num_physical
        self.bounds: Optional[torch.Tensor] = None  # [M, E, C] int64
        self.slots: Optional[torch.Tensor] = None  # [M, E, C] int64
        self.fractions: Optional[torch.Tensor] = None  # [E, C0] float64
        self.default_slots: Optional[torch.Tensor] = None  # [E, C0] int64
        #: the microbatch being run (None: outside a planned microbatch)
        self.micro: Optional[int] = None

    def upload(self, default: Tuple[np.ndarray, np.ndarray], cells: Optional[Tuple[np.ndarray, np.ndarray]], device):
        """Puts a window's tables on ``device`` (once per window)."""
        dev = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)  # noqa: E731
        self.fractions, self.default_slots = dev(default[0], torch.float64), dev(default[1], torch.int64)
        if cells is None:
            self.bounds = self.slots = None
        else:
            self.bounds, self.slots = dev(cells[0], torch.int64), dev(cells[1], torch.int64)
        self.micro = None

    def _move(self, device: Any) -> None:
        """The tables onto ``device`` (the model was moved after they were uploaded)."""
        for name in ("bounds", "slots", "fractions", "default_slots"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))

    def physical(self, probs: torch.Tensor, routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Logical ``probs`` / ``routing_map`` ``[T, E]`` → ``[T, num_physical]`` by the current
        micro's table (or the default one); gradients flow to ``probs``."""
        rmap = routing_map
        if self.fractions is not None and self.fractions.device != rmap.device:
            self._move(rmap.device)
        rank = torch.cumsum(rmap, dim=0, dtype=torch.int64) - 1  # pair index of (t, e) among e's pairs
        if self.micro is not None and self.bounds is not None and self.slots is not None:
            bounds, slots = self.bounds[self.micro], self.slots[self.micro]
        elif self.fractions is not None and self.default_slots is not None:
            n = rank[-1:] + 1 if rank.shape[0] else rank.new_zeros((1, self.num_experts))  # pairs per expert
            bounds = torch.floor(self.fractions * n.reshape(-1, 1).to(torch.float64) + 0.5).to(torch.int64)
            slots = self.default_slots
        else:
            raise RoutepackError("SlotMap: no tables uploaded (PlanMoELayer.set_placement installs them)")
        copy = (rank.unsqueeze(-1) >= bounds.unsqueeze(0)).sum(-1).clamp_(max=bounds.shape[1] - 1)
        phys = slots.gather(1, copy.t().contiguous()).t()  # [T, E]: the physical expert of each pair
        t = rmap.shape[0]
        phys_map = torch.zeros((t, self.num_physical), dtype=torch.bool, device=rmap.device).scatter_(1, phys, rmap)
        phys_probs = probs.new_zeros((t, self.num_physical)).scatter(1, phys, probs)
        return phys_probs, phys_map


__all__ = ["SlotMap", "buffer_of", "cell_rows", "default_table", "layer_tables"]
