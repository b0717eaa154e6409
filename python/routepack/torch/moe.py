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

from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from routepack._checks import positive_int
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.plan import empty_replicas
from routepack.torch import _args, checkpoint, profile
from routepack.torch.broadcast import group_peers, raise_shared_failure
from routepack.torch.remap import TokenRoute, _route, expert_counts
from routepack.torch.routes import CellRoute, cell_route
from routepack.torch.slot_link import SlotLink


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``x`` ``[N, H]``, ``w1`` ``[H, 2I]``, ``w2`` ``[I, H]`` → ``[N, H]``."""
    gate, up = (x @ w1).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2


def dense_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Single-process reference: ``y[t] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])``.

    ``x`` ``[T, H]``, ``topk_ids`` int ``[T, k]``, ``topk_weights`` ``[T, k]``, logical weights
    ``w1`` ``[E, H, 2I]`` and ``w2`` ``[E, I, H]``. Returns ``[T, H]``; T = 0 (a rank without
    tokens) gives an empty ``[0, H]`` that is still part of the autograd graph.
    """
    t, k, h = check_moe_inputs(x, topk_ids, topk_weights, w1, w2)
    flat = topk_ids.reshape(-1)
    pairs = x.repeat_interleave(k, dim=0)
    parts, index = [], []
    for e in torch.unique(flat).tolist():
        sel = torch.nonzero(flat == e).squeeze(1)
        parts.append(swiglu(pairs.index_select(0, sel), w1[e], w2[e]))
        index.append(sel)
    if not parts:
        # no tokens: an empty result that still depends on x, w1 and w2, so a backward through
        # it runs (and gives zero gradients) like on any other rank
        parts.append(swiglu(pairs, w1[0], w2[0]))
        index.append(torch.arange(0, device=x.device))
    out = torch.cat(parts).index_select(0, torch.argsort(torch.cat(index)))
    # h, not -1: with T = 0 the view would not know its last dimension
    return (out.view(t, k, h) * topk_weights.unsqueeze(-1).to(out.dtype)).sum(1)


def check_moe_inputs(x: Any, topk_ids: Any, topk_weights: Any, w1: Any, w2: Any) -> tuple:
    """(T, k, H) after checking `dense_moe`'s arguments: types, shapes, dtypes, devices and
    every id in ``[0, E)``."""
    _args.tensor(x, "x", 2, "float")
    _args.tensor(topk_ids, "topk_ids", 2, "int")
    _args.tensor(topk_weights, "topk_weights", 2, "float")
    _args.tensor(w1, "w1", 3, "float")
    _args.tensor(w2, "w2", 3, "float")
    t, h = x.shape
    e_n, i2 = w1.shape[0], w1.shape[2]
    if e_n == 0 or w1.shape[1] != h or i2 == 0 or i2 % 2:
        raise RoutepackError(f"w1: expected [E >= 1, H={h}, 2I >= 2], got {tuple(w1.shape)}")
    if tuple(w2.shape) != (e_n, i2 // 2, h):
        raise RoutepackError(f"w2: expected [E={e_n}, I={i2 // 2}, H={h}], got {tuple(w2.shape)}")
    if topk_ids.shape[0] != t or topk_ids.shape[1] == 0:
        raise RoutepackError(f"topk_ids: expected [T={t}, k >= 1], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise RoutepackError(
            f"topk_weights: expected {tuple(topk_ids.shape)} like topk_ids, got {tuple(topk_weights.shape)}"
        )
    for name, v in (("w1", w1), ("w2", w2)):
        if v.dtype != x.dtype:
            raise RoutepackTypeError(f"{name}: dtype {v.dtype} differs from x's {x.dtype}")
    for name, v in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w1", w1), ("w2", w2)):
        if v.device != x.device:
            raise RoutepackError(f"{name}: on {v.device}, x on {x.device}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e_n:
            raise RoutepackError(f"topk_ids: expert id {lo if lo < 0 else hi} outside [0, {e_n})")
    return int(t), int(topk_ids.shape[1]), int(h)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to EP ranks by ``send_splits``; receives ``recv_splits`` rows. Backward
    runs the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        profile.sync()
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        profile.sync()
        return out, None, None, None


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

    Gradients: the backward of each forward hands ``w1``/``w2`` their gradient for that
    microbatch (local tokens + replica copies' fp32 gradients, added in fp32, rounded once;
    `routepack.torch.slot_link`), so parameter hooks (DDP, ``main_grad``,
    ``overlap_grad_reduce``) see it; under a `PlanRunner` the slots of redundant experts get
    0 until the step's last microbatch, whose backward hands them the step's gradient summed
    over the EP group (without a runner, each backward sums its own microbatch). Only the sum across
    EP groups (expert data parallelism) is left to the trainer or `PlanRunner.finish_step`.
    """

    #: the backward completes redundant-slot and replica gradients (`sync_redundant_grads`
    #: then only sums across EP groups)
    grads_complete_in_backward = True
    #: the grouped expert kernel ``(rows, counts, w1, w2) -> out`` (None: `grouped_swiglu`);
    #: `routepack.calibrate.exchange` sets a timed wrapper of it on an instance, to tell the
    #: kernel's time from the rest of the layer's
    expert_kernel: Optional[Callable[..., torch.Tensor]] = None

    def __init__(
        self,
        layer: int,
        num_experts: int,
        hidden: int,
        ffn: int,
        topo: Any,
        phy2log_row: np.ndarray,
        group: Optional[Any] = None,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
    ) -> None:
        super().__init__()
        layer = positive_int(layer, "layer", minimum=0, maximum=2**31 - 1)
        num_experts = positive_int(num_experts, "num_experts", maximum=2**31 - 1)  # int32 ids in plans
        hidden = positive_int(hidden, "hidden")
        ffn = positive_int(ffn, "ffn")
        _args.topology(topo)
        _args.group(group)
        dtype = _args.dtype_float(dtype)
        if dist.get_world_size(group) != topo.ep:
            raise RoutepackError(f"group: has {dist.get_world_size(group)} ranks but topo.ep = {topo.ep}")
        row = _args.placement_row(phy2log_row, "phy2log_row", topo.num_slots, num_experts)
        spr = topo.slots_per_rank
        # w1 [spr, H, 2I] + w2 [spr, I, H]: refuse a size the device cannot hold before torch tries
        nbytes = 3 * spr * hidden * ffn * torch.empty(0, dtype=dtype).element_size()
        _args.fits_memory(nbytes, f"hidden={hidden}, ffn={ffn} (w1 and w2 of {spr} slots)", device)
        self.layer, self.num_experts, self.hidden, self.ffn = layer, num_experts, hidden, ffn
        self.topo, self.group = topo, group
        self.ep_rank = dist.get_rank(group)
        self.peers = group_peers(group)
        self.phy2log = row.copy()
        try:
            self.w1 = torch.nn.Parameter(torch.zeros(spr, hidden, 2 * ffn, dtype=dtype, device=device))
            self.w2 = torch.nn.Parameter(torch.zeros(spr, ffn, hidden, dtype=dtype, device=device))
        except RuntimeError as e:  # under the device's total, but not free now (torch's OOM is a RuntimeError)
            raise RoutepackError(
                f"hidden={hidden}, ffn={ffn}: w1 and w2 of {spr} slots ({nbytes} bytes) "
                f"could not be allocated: {str(e).splitlines()[0][:200]}"
            ) from None
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
        return self.phy2log[lo : lo + self.slots_per_rank]

    def local_slot_of(self, expert: int) -> int:
        """The lowest local slot holding ``expert``; raises if this rank holds none."""
        hit = np.flatnonzero(self.local_experts() == expert)
        if hit.size == 0:
            raise RoutepackError(f"expert {expert} is not on EP rank {self.ep_rank} in layer {self.layer}")
        return int(hit[0])

    # ------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> dict:
        """The placement row and the layer's identity, saved in ``state_dict`` as
        ``_extra_state`` (`routepack.torch.checkpoint`)."""
        return checkpoint.extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Restores the placement saved by `get_extra_state` (refuses another rank's or shape's)."""
        checkpoint.set_extra_state(self, state)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        # the placement record is checked before torch copies any weight in, so a checkpoint
        # of another rank or shape leaves this module untouched
        key = prefix + "_extra_state"
        if key in state_dict:
            checkpoint.check_extra_state(self, state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def export_logical(self) -> tuple:
        """``(w1 [E, H, 2I], w2 [E, I, H])``: the experts in logical order, as the unsharded
        model holds them, on every rank. Collective over the EP group."""
        return checkpoint.export_layer(self)

    def import_logical(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Fills every local slot from logical ``w1`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]`` (the
        inverse of `export_logical`; local, no collective)."""
        checkpoint.check_logical(self, w1, w2)
        self.load_logical(w1, w2)

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
    def _origin_counts(self, counts: np.ndarray, ok: bool, device: torch.device) -> np.ndarray:
        """All-gathers every EP rank's status and per-expert pair counts: int64 ``[ep, 1 + E]``
        (column 0: 1 when that rank's inputs were valid)."""
        mine = torch.from_numpy(np.concatenate([[int(ok)], counts]).astype(np.int64)).to(device)
        bufs = [torch.empty_like(mine) for _ in range(self.topo.ep)]
        dist.all_gather(bufs, mine, group=self.group)
        return torch.stack(bufs).cpu().numpy()

    def check_inputs(self, x: Any, topk_ids: Any, topk_weights: Any) -> np.ndarray:
        """This rank's replayed ids as int64 ``[T, k]`` after checking the forward's arguments."""
        _args.tensor(x, "x", 2, "float")
        _args.tensor(topk_ids, "topk_ids", 2, "int")
        _args.tensor(topk_weights, "topk_weights", 2, "float")
        if x.shape[1] != self.hidden:
            raise RoutepackError(f"x: expected [T, {self.hidden}], got {tuple(x.shape)}")
        if x.dtype != self.w1.dtype or x.device != self.w1.device:
            raise RoutepackError(f"x: {x.dtype} on {x.device}, the layer's weights {self.w1.dtype} on {self.w1.device}")
        if topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] == 0:
            raise RoutepackError(f"topk_ids: expected [T={x.shape[0]}, k >= 1], got {tuple(topk_ids.shape)}")
        if topk_weights.shape != topk_ids.shape:
            raise RoutepackError(
                f"topk_weights: expected {tuple(topk_ids.shape)} like topk_ids, got {tuple(topk_weights.shape)}"
            )
        return topk_ids.detach().cpu().numpy().astype(np.int64, copy=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``topk_ids`` int ``[T, k]`` (replayed logical ids), ``topk_weights``
        ``[T, k]`` → ``[T, H]``. Every EP rank of the group must call it (collective).

        T may be 0 (a rank without tokens in this microbatch): the rank still takes part in
        every exchange with empty buffers, computes the tokens other ranks send to its slots,
        and returns an empty ``[0, H]`` in the graph, so its backward runs the same
        collectives. Inputs that fail a check make *every* rank raise: the check's outcome
        travels with the first exchange (the per-expert counts), so no peer is left waiting."""
        runner = self.runner
        if runner is not None:
            runner.begin_forward(self.layer)  # the audit: before any collective of this forward
        # (the marks and regions time the parts where a profile is recorded: routepack.torch.profile)
        x = profile.mark(x, "other", "gather")
        with profile.region("route"):
            cell = runner.route_for(self.layer) if runner is not None else None
            if cell is not None:
                # precomputed for the window (routes.py): no host copy, no all-gather here
                self._check_meta(x, topk_ids, topk_weights, cell)
                runner.note_ids(cell, topk_ids, self.layer)
            else:
                cell = self._route_now(x, topk_ids, topk_weights)
            if runner is not None:
                runner.note_units(self.layer, cell.unit_counts)  # what the kernel computes, per unit
        route, (t, k) = cell.route, (int(topk_ids.shape[0]), cell.k)
        self.last_route = route
        sent = profile.mark(x.index_select(0, cell.src_rows), "gather", "all_to_all")
        recv = _AllToAll.apply(sent, route.send_splits, route.recv_splits, self.group)
        if runner is not None:
            runner.record_received(self.layer, sum(route.recv_splits))
        recv = profile.mark(recv, "all_to_all", "slot_grads")
        # every gradient of the slots is completed inside this node's backward (slot_link.py)
        recv, w1v, w2v, w1r, w2r = SlotLink.apply(
            recv, self.w1, self.w2, self, runner.exchange if runner is not None else None
        )
        out = self._experts(recv, cell, w1v, w2v, w1r, w2r)
        out = profile.mark(out, "unit_sort", "all_to_all")
        back = _AllToAll.apply(out, route.recv_splits, route.send_splits, self.group)
        pairs = profile.mark(back, "all_to_all", "combine").index_select(0, cell.back)
        # hidden, not -1: with T = 0 the view would not know its last dimension
        y = (pairs.view(t, k, self.hidden) * topk_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)
        return profile.mark(y, "combine", "other")

    def _route_now(self, x: Any, topk_ids: Any, topk_weights: Any) -> CellRoute:
        """The cell's route computed in the forward: ids to the host, counts all-gathered (with
        every rank's check outcome), `route_tokens`' rule."""
        err: Optional[BaseException] = None
        try:
            ids = self.check_inputs(x, topk_ids, topk_weights)
            counts = expert_counts(ids, self.num_experts)
        except Exception as e:  # noqa: BLE001 (shared with every rank, then re-raised)
            err, counts = e, np.zeros(self.num_experts, dtype=np.int64)
        got = self._origin_counts(counts, err is None, self.w1.device)
        raise_shared_failure(
            err,
            got[:, 0],
            lambda bad: (
                f"x: EP rank(s) {bad} passed invalid inputs to MoE layer "
                f"{self.layer} (each raised its own error); nothing was dispatched"
            ),
        )
        origin = np.ascontiguousarray(got[:, 1:])
        rows = self.runner.cell_rows(self.layer) if self.runner is not None else empty_replicas()
        route = _route(ids, origin, self.phy2log, self.topo, rows, self.ep_rank)
        return cell_route(route, int(ids.shape[1]), self.slots_per_rank + int(route.replica_rows.size), x.device)

    def _check_meta(self, x: Any, topk_ids: Any, topk_weights: Any, cell: CellRoute) -> None:
        """The forward's arguments against a precomputed route: types, shapes, dtypes and
        devices only (no host copy; the ids themselves are compared on the device,
        `PlanRunner.note_ids`). A mismatch raises here, and the EP peers then wait in the
        dispatch all-to-all until the process group's timeout: feed the replayed microbatch."""
        _args.tensor(x, "x", 2, "float")
        _args.tensor(topk_ids, "topk_ids", 2, "int")
        _args.tensor(topk_weights, "topk_weights", 2, "float")
        want = tuple(cell.ids.shape)
        if (
            tuple(topk_ids.shape) != want
            or tuple(x.shape) != (want[0], self.hidden)
            or tuple(topk_weights.shape) != want
        ):
            raise RoutepackError(
                f"topk_ids: MoE layer {self.layer} expected this micro's replayed ids {want} "
                f"(x [{want[0]}, {self.hidden}]), got ids {tuple(topk_ids.shape)}, "
                f"x {tuple(x.shape)}, weights {tuple(topk_weights.shape)}"
            )
        if x.dtype != self.w1.dtype or x.device != self.w1.device or topk_ids.device != self.w1.device:
            raise RoutepackError(
                f"x: {x.dtype} on {x.device} (ids on {topk_ids.device}), the layer's weights "
                f"{self.w1.dtype} on {self.w1.device}"
            )

    def _experts(
        self,
        recv: torch.Tensor,
        cell: CellRoute,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w1r: torch.Tensor,
        w2r: torch.Tensor,
    ) -> torch.Tensor:
        """One grouped GEMM over the rank's compute units: local slots ``w1`` ``[spr, H, 2I]`` /
        ``w2``, then replica copies ``w1r`` ``[R, H, 2I]`` / ``w2r``. Rows are sorted by unit
        (stable, the cell's precomputed permutation), computed by one kernel call and put back in
        arrival order. One call, not one for the slots and one for the copies: the cost model
        prices one call a rank (``c_call``)."""
        if recv.shape[0] == 0:
            # nothing to compute (recv has no rows): an empty result that keeps the received
            # tensor in the graph, so every rank runs the same backward collectives, and gives
            # w1/w2 a zero gradient like on a rank whose slots did compute (not None)
            return swiglu(recv, w1[0], w2[0])
        counts = cell.unit_counts
        recv = profile.mark(recv, "slot_grads", "unit_sort")
        rows = profile.mark(recv.index_select(0, cell.unit_perm), "unit_sort", "expert")
        kernel = self.expert_kernel or grouped_swiglu
        if counts.shape[0] > self.slots_per_rank:
            out = kernel(rows, counts, (w1, w1r), (w2, w2r))
        else:
            out = kernel(rows, counts, w1, w2)
        out = profile.mark(out, "expert", "unit_sort")
        return out.index_select(0, cell.unit_inv)


#: (device type, dtype) → whether ``torch._grouped_mm`` ran there; filled on first use
_GROUPED_MM_OK: dict = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``torch._grouped_mm``'s
    backward refuses an expanded one (e.g. the gradient of a ``.sum()``)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.contiguous()


def _grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` may take these operands: present in this torch, a dtype it
    supports, and every row stride a multiple of 16 bytes (its layout rule)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if _GROUPED_MM_OK.get((x.device.type, x.dtype)) is False:
        return False
    size = x.element_size()
    return all((d * size) % 16 == 0 for d in (w1.shape[1], w1.shape[2], w1.shape[2] // 2))


def grouped_swiglu(rows: torch.Tensor, counts: np.ndarray, w1: Any, w2: Any) -> torch.Tensor:
    """SwiGLU experts over consecutive groups of rows: ``rows`` ``[N, H]`` sorted by group,
    ``counts`` int64 ``[G]`` (sum N), ``w1`` ``[G, H, 2I]``, ``w2`` ``[G, I, H]`` → ``[N, H]``.
    ``w1`` / ``w2`` may also be a tuple of stacks whose groups add up to G (a rank's slots, then
    its replica copies), computed in the same call.

    One ``torch._grouped_mm`` per projection where this torch offers it for the operands
    (`_grouped_mm_usable`; a tuple of stacks is concatenated for it), else a loop over the
    groups that have rows, on ``unbind`` views: its backward stacks the groups' gradients into
    one ``[G, H, 2I]`` tensor (indexing ``w1[g]`` would build a full zero gradient of ``w1``
    for every group)."""
    w1s = w1 if isinstance(w1, tuple) else (w1,)
    w2s = w2 if isinstance(w2, tuple) else (w2,)
    if _grouped_mm_usable(rows, w1s[0]):
        offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(rows.device)
        s1 = w1s[0] if len(w1s) == 1 else torch.cat(w1s)
        s2 = w2s[0] if len(w2s) == 1 else torch.cat(w2s)
        try:
            gate, up = _ContiguousGrad.apply(torch._grouped_mm(rows.contiguous(), s1, offs=offs)).chunk(2, dim=-1)
            out = _ContiguousGrad.apply(torch._grouped_mm((F.silu(gate) * up).contiguous(), s2, offs=offs))
            _GROUPED_MM_OK[(rows.device.type, rows.dtype)] = True
            return out
        except RuntimeError:  # this build or device refuses it: the loop below computes the same
            _GROUPED_MM_OK[(rows.device.type, rows.dtype)] = False
    g1 = [w for stack in w1s for w in stack.unbind(0)]
    g2 = [w for stack in w2s for w in stack.unbind(0)]
    chunks = torch.split(rows, counts.tolist())
    parts = [swiglu(c, g1[g], g2[g]) for g, c in enumerate(chunks) if c.shape[0]]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def check_layers(layers: Any) -> List[Any]:
    """``layers`` (a list, tuple or ``nn.ModuleList``; index = MoE layer) as a non-empty list of
    `EPMoE` layers."""
    items = list(layers) if isinstance(layers, (list, tuple, torch.nn.ModuleList)) else None
    if not items:
        raise RoutepackTypeError(f"layers: expected a non-empty list of EPMoE layers, got {_args.short(layers)}")
    for i, mod in enumerate(items):
        if not isinstance(mod, EPMoE):
            raise RoutepackTypeError(f"layers[{i}]: expected routepack.torch.EPMoE, got {type(mod).__name__}")
    return items
