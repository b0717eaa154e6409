"""A reference expert-parallel MoE layer that carries out a routepack plan.

Each EP rank holds its physical slots' experts as stacked tensors (the grouped-GEMM layout):
``w1`` ``[slots_per_rank, H, 2I]`` (gate and up projections side by side) and ``w2``
``[slots_per_rank, I, H]``; an expert is SwiGLU: ``(silu(x W1_gate) * (x W1_up)) W2``.
Routing is given: the replayed logical top-k ids and their gate weights. Tokens are remapped
to physical slots and replica copies by `routepack.torch.remap` (the plan's own routing
rule), dispatched and combined by all-to-all over the EP process group, and the gate-weighted
sum is taken at the origin. The layer computes the same function as `dense_moe` on the
logical experts whatever the placement and replicas.

It is the test bed of `routepack.torch` and the example of how a trainer wires routepack in:
replace the dispatcher's "expert id → rank" map by `route_tokens`, keep everything else.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from routepack.errors import RoutepackError
from routepack.plan import empty_replicas
from routepack.torch.remap import TokenRoute, expert_counts, route_tokens


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``x`` ``[N, H]``, ``w1`` ``[H, 2I]``, ``w2`` ``[I, H]`` → ``[N, H]``."""
    gate, up = (x @ w1).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Single-process reference: ``y[t] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])``.

    ``x`` ``[T, H]``, ``topk_ids`` int ``[T, k]``, ``topk_weights`` ``[T, k]``, logical weights
    ``w1`` ``[E, H, 2I]`` and ``w2`` ``[E, I, H]``. Returns ``[T, H]``.
    """
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    pairs = x.repeat_interleave(k, dim=0)
    parts, index = [], []
    for e in torch.unique(flat).tolist():
        sel = torch.nonzero(flat == e).squeeze(1)
        parts.append(swiglu(pairs.index_select(0, sel), w1[e], w2[e]))
        index.append(sel)
    out = torch.cat(parts).index_select(0, torch.argsort(torch.cat(index)))
    return (out.view(t, k, -1) * topk_weights.unsqueeze(-1).to(out.dtype)).sum(1)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to EP ranks by ``send_splits``; receives ``recv_splits`` rows. Backward
    runs the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def group_peers(group: Optional[Any]) -> List[int]:
    """Global ranks of ``group`` in group-rank order (EP-local rank r → ``peers[r]``)."""
    n = dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        return list(range(n))
    return [dist.get_global_rank(group, r) for r in range(n)]


class EPMoE(torch.nn.Module):
    """One MoE layer's experts on one EP rank, routed by a plan.

    Args:
        layer:        index of this MoE layer in the plan (row of ``placement.phy2log``).
        num_experts:  E logical experts; ``hidden`` H; ``ffn`` I (per expert).
        topo:         `routepack.Topology` (``ep`` must equal the EP group's size).
        phy2log_row:  int32 ``[ep*slots_per_rank]``: the placement in force for this layer.
        group:        the EP process group (None: the default group).

    Parameters ``w1`` ``[slots_per_rank, H, 2I]`` and ``w2`` ``[slots_per_rank, I, H]`` hold
    this rank's slots; an empty slot (-1) holds whatever it last held and receives no tokens.
    A `routepack.torch.PlanRunner` attaches itself as ``runner`` to supply the cell's replica
    rows and weights; without one the layer routes by its placement alone.
    """

    def __init__(self, layer: int, num_experts: int, hidden: int, ffn: int, topo: Any,
                 phy2log_row: np.ndarray, group: Optional[Any] = None,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
        if dist.get_world_size(group) != topo.ep:
            raise RoutepackError(f"group: has {dist.get_world_size(group)} ranks but topo.ep = {topo.ep}")
        row = np.ascontiguousarray(phy2log_row, dtype=np.int32)
        if row.shape != (topo.num_slots,):
            raise RoutepackError(f"phy2log_row: expected shape ({topo.num_slots},), got {row.shape}")
        if row.min() < -1 or row.max() >= num_experts:
            raise RoutepackError(f"phy2log_row: entries must lie in [-1, {num_experts}), got {row.min()}..{row.max()}")
        self.layer, self.num_experts, self.hidden, self.ffn = int(layer), int(num_experts), int(hidden), int(ffn)
        self.topo, self.group = topo, group
        self.ep_rank = dist.get_rank(group)
        self.peers = group_peers(group)
        self.phy2log = row.copy()
        spr = topo.slots_per_rank
        self.w1 = torch.nn.Parameter(torch.zeros(spr, hidden, 2 * ffn, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.zeros(spr, ffn, hidden, dtype=dtype, device=device))
        self.runner: Any = None
        #: the last forward's `TokenRoute` (for inspection and tests)
        self.last_route: Optional[TokenRoute] = None

    # ------------------------------------------------------------------ slots
    @property
    def slots_per_rank(self) -> int:
        return self.topo.slots_per_rank

    def local_experts(self) -> np.ndarray:
        """int32 ``[slots_per_rank]``: logical expert in each local slot (-1 empty)."""
        lo = self.ep_rank * self.slots_per_rank
        return self.phy2log[lo:lo + self.slots_per_rank]

    def local_slot_of(self, expert: int) -> int:
        """The lowest local slot holding ``expert``; raises if this rank holds none."""
        hit = np.flatnonzero(self.local_experts() == expert)
        if hit.size == 0:
            raise RoutepackError(f"expert {expert} is not on EP rank {self.ep_rank} in layer {self.layer}")
        return int(hit[0])

    @torch.no_grad()
    def load_logical(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Fills every local slot from logical weights ``w1`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]``
        (empty slots are zeroed)."""
        for s, e in enumerate(self.local_experts().tolist()):
            if e < 0:
                self.w1[s].zero_()
                self.w2[s].zero_()
            else:
                self.w1[s].copy_(w1[e])
                self.w2[s].copy_(w2[e])

    # ---------------------------------------------------------------- forward
    def _origin_counts(self, counts: np.ndarray, device: torch.device) -> np.ndarray:
        """All-gathers every EP rank's per-expert pair counts: int64 ``[ep, E]``."""
        mine = torch.from_numpy(counts).to(device)
        bufs = [torch.empty_like(mine) for _ in range(self.topo.ep)]
        dist.all_gather(bufs, mine, group=self.group)
        return torch.stack(bufs).cpu().numpy()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``topk_ids`` int ``[T, k]`` (replayed logical ids), ``topk_weights``
        ``[T, k]`` → ``[T, H]``. Every EP rank of the group must call it (collective)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise RoutepackError(f"x: expected [T, {self.hidden}], got {tuple(x.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise RoutepackError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                                 f"must both be [T={x.shape[0]}, k]")
        t, k = topk_ids.shape
        ids = topk_ids.detach().cpu().numpy()
        origin = self._origin_counts(expert_counts(ids, self.num_experts), x.device)
        runner = self.runner
        rows = runner.cell_rows(self.layer) if runner is not None else empty_replicas()
        route = route_tokens(ids, origin, self.phy2log, self.topo, rows, self.ep_rank)
        self.last_route = route
        send_order = torch.from_numpy(route.send_order).to(x.device)
        recv = _AllToAll.apply(x.index_select(0, send_order // k), route.send_splits, route.recv_splits, self.group)
        if runner is not None:
            runner.record_received(self.layer, int(recv.shape[0]))
            recv, w1r, w2r = runner.replica_link(self.layer, recv, self.w1, self.w2)
        else:
            w1r = w2r = None
        out = self._experts(recv, route.recv_unit, w1r, w2r)
        back = _AllToAll.apply(out, route.recv_splits, route.send_splits, self.group)
        pairs = back.index_select(0, torch.argsort(send_order))
        return (pairs.view(t, k, -1) * topk_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)

    def _experts(self, recv: torch.Tensor, unit: np.ndarray, w1r: Optional[torch.Tensor],
                 w2r: Optional[torch.Tensor]) -> torch.Tensor:
        """Grouped GEMM over compute units: local slots, then replica copies. Rows are sorted by
        unit (stable), computed unit by unit, and put back in arrival order."""
        spr = self.slots_per_rank
        if unit.size == 0:
            # keep the received tensor in the graph so every rank runs the same backward collectives
            return recv * 0
        perm = np.argsort(unit, kind="stable")
        counts = np.bincount(unit, minlength=spr + (0 if w1r is None else w1r.shape[0]))
        perm_t = torch.from_numpy(perm).to(recv.device)
        chunks = torch.split(recv.index_select(0, perm_t), counts.tolist())
        parts = []
        for u, chunk in enumerate(chunks):
            if chunk.shape[0] == 0:
                continue
            if u < spr:
                parts.append(swiglu(chunk, self.w1[u], self.w2[u]))
            else:
                parts.append(swiglu(chunk, w1r[u - spr], w2r[u - spr]))
        out = torch.cat(parts)
        return out.index_select(0, torch.from_numpy(np.argsort(perm)).to(recv.device))
