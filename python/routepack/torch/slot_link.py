"""Expert gradients completed inside autograd, before any parameter hook fires.

`EPMoE` runs its experts on the outputs of one autograd node, `SlotLink`: the received
tokens, views of its own slots ``w1``/``w2`` and the replica copies of this microbatch. In
backward that node therefore holds, for the layer, every gradient that belongs to the slots:

* the local one (tokens this rank's slots computed),
* the replica copies' gradients, sent back in fp32 by the ranks that computed them (the
  copy holders post them from this same node, in plan table order, on every rank alike),
* for redundant experts (one expert in several slots), the sum over every slot of the EP
  group (one fp32 all-reduce over only those experts), once per step (`StepSums`).

It adds them in fp32 and rounds once to the parameter's dtype, and returns that as the
gradient of ``w1``/``w2``. Autograd then accumulates it into ``p.grad`` and fires the
parameter's hooks (DDP buckets, Megatron's ``main_grad`` copy, ``overlap_grad_reduce``,
``register_post_accumulate_grad_hook``).

**Redundant experts are summed once per step, not per microbatch.** Under a `PlanRunner` the
node keeps each redundant slot's fp32 gradient (local and replica parts) of the step's
microbatches in `StepSums` and hands autograd zeros for those slots, until the layer's
backward of the step's last microbatch (the ``num_micro``-th backward of the layer since the
window began, in whatever order the microbatches run): that one all-reduces the step's sums
and returns them, rounded once, so every copy of an expert gets the same bits (handing the
local parts on and returning the sum minus them would leave the copies' gradients apart by
rounding, and their optimizer states with them: tests/torch/selfcheck/windows.py checks they
stay identical). Each microbatch's part is added in place into its expert's row of the buffer
the step's all-reduce sends, and the zeros, the sums and the replica gradients are written
into the incoming gradient of the stack where it is the layer's own (`_own`), so no
microbatch copies the stack or a slot (the measured run's profile: copying the stack took
about 4 ms a layer in the last microbatch). Summing per microbatch cost one all-reduce of every redundant
expert's fp32 gradient per layer and microbatch: on the measured run's workload
(`routepack.measure`: 2 gloo ranks, 4 redundant experts a layer, 3 microbatches) that was
17.6 ms of each layer's backward (profiled), 67 ms of a 404 ms step, which the cost model did
not price. So hooks see every slot's complete gradient of the step by the end of the last
microbatch's backward (which is where ``overlap_grad_reduce`` and DDP without ``no_sync``
reduce what they reduce last); on earlier microbatches a redundant slot's hook sees 0. The
fp32 sums are the only buffers that outlive the node: one per redundant slot of this rank,
freed by the last microbatch. Without a runner (no step is known) each call completes its
own gradient as before. The expert-data-parallel sum (same slot across EP groups) is the
trainer's own DP reduction, or `PlanRunner.finish_step`'s.

Threading the tokens through the node fixes the order of the backward collectives on every
rank: the experts' backward, then this node's transfers, then the dispatch all-to-all's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack.torch import profile


class SlotLink(torch.autograd.Function):
    """``(recv, w1, w2) → (recv, w1, w2, w1r, w2r)``: identities on the tokens and the layer's
    slots, plus the replica copies ``w1r`` ``[R, H, 2I]`` / ``w2r`` ``[R, I, H]`` (R may be 0)
    that ``exchange`` received for this layer. Backward: see the module docstring."""

    @staticmethod
    def forward(ctx, recv, w1, w2, mod, exchange):  # type: ignore[override]
        if exchange is not None:
            with profile.region("replica_fill"):
                w1r, w2r = exchange.weights(exchange.index_of(mod))
            ctx.micro = exchange.micro  # the backward returns this micro's copies, whatever is current then
        else:
            h, i2 = w1.shape[1], w1.shape[2]
            w1r, w2r = w1.new_empty(0, h, i2), w2.new_empty(0, i2 // 2, h)
            ctx.micro = 0
        ctx.mod, ctx.exchange = mod, exchange
        return recv.view_as(recv), w1.view_as(w1), w2.view_as(w2), w1r, w2r

    @staticmethod
    def backward(ctx, g_recv, g1, g2, g1r, g2r):  # type: ignore[override]
        mod, exchange = ctx.mod, ctx.exchange
        if exchange is not None and getattr(mod, "runner", None) is not None:
            mod.runner.note_backward(ctx.micro, mod.layer)  # the audit: this cell's backward ran
        extra: Dict[int, torch.Tensor] = {}
        if exchange is not None:
            with profile.region("replica_grads"):
                for slot, buf in exchange.exchange_grads(ctx.micro, exchange.index_of(mod), g1r, g2r):
                    extra[slot] = buf if slot not in extra else extra[slot] + buf
        sums = getattr(mod.runner, "step_sums", None) if exchange is not None else None
        g1, g2 = complete_slot_grads(mod, g1, g2, extra, sums)
        return g_recv, g1, g2, None, None


class StepSums:
    """The fp32 gradients of this rank's redundant slots over one step's microbatches, per
    layer, until the layer's ``num_micro``-th backward of the step sums them over the EP group
    (see the module docstring). `PlanRunner.begin_window` makes one per window."""

    def __init__(self, num_micro: int) -> None:
        self.num_micro = num_micro
        #: layer → backwards of the layer seen in the current step
        self.seen: Dict[int, int] = {}
        #: layer → fp32 ``[redundant experts, H*2I + I*H]``: this rank's gradient of each
        #: redundant expert in the step so far (local and replica parts of its slots), kept back
        #: until the sum (the buffer the sum all-reduces)
        self.pending: Dict[int, torch.Tensor] = {}

    def note_backward(self, layer: int) -> bool:
        """Counts one backward of ``layer``; True when it is the step's last (then the count
        starts again, for the next step of the window)."""
        n = self.seen.get(layer, 0) + 1
        last = n == self.num_micro
        self.seen[layer] = 0 if last else n
        return last

    def unfinished(self) -> Dict[int, int]:
        """layer → backwards seen, for layers whose step is part-way (their sums not delivered)."""
        return {l: n for l, n in sorted(self.seen.items()) if n}


def _own(g: torch.Tensor) -> bool:
    """Whether the gradient of a slot stack may be edited in place: a dense tensor of its own
    (not a view, not expanded). The stacks' gradients reach `SlotLink` from this layer's own
    expert kernels only (``torch._grouped_mm``'s, ``unbind``'s or ``select``'s backward, each
    a fresh tensor nothing else holds), since the slot views it returns feed nothing else."""
    return g._base is None and g.is_contiguous() and g.layout == torch.strided


def redundant_experts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ``[n]``: logical experts held by more than one slot of the layer (ascending)."""
    counts = np.bincount(phy2log[phy2log >= 0], minlength=num_experts)
    return np.flatnonzero(counts > 1)


@torch.no_grad()
def complete_slot_grads(
    mod: Any, g1: torch.Tensor, g2: torch.Tensor, extra: Dict[int, torch.Tensor], sums: Optional[StepSums] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(g1, g2)`` (``[spr, H, 2I]`` / ``[spr, I, H]``, the parameter's dtype) with each local
    slot's replica gradients ``extra[slot]`` (fp32, flat ``[H*2I + I*H]``) added and every
    redundant expert summed over the EP group, in fp32, rounded once.

    ``sums``: the step's `StepSums` (None: sum now). With it, before the layer's last backward
    of the step a redundant slot gets 0 and its fp32 gradient is added into the step's running
    sum; the last backward all-reduces the sums and returns each copy's total, rounded once,
    so every copy of an expert ends the step with the same bits (what keeps their optimizer
    updates identical). Collective over ``mod.group`` where it sums redundant experts (every
    rank of the group makes the same calls: redundancy is the placement's, and every rank runs
    the step's microbatches).

    No slot is copied for the sums: the running sums are the rows of the buffer the step's
    all-reduce sends (one ``[redundant experts, H*2I + I*H]`` fp32 buffer per layer, made at
    the step's first backward), each backward's part added into its row in place (a bf16 part
    widens exactly), and the result is written into ``g1``/``g2`` themselves where they are the
    layer's own (`_own`: fresh tensors of its expert kernels), else into copies."""
    redundant = redundant_experts(mod.phy2log, mod.num_experts)
    if not extra and redundant.size == 0:
        return g1, g2
    local = mod.local_experts().tolist()
    index = {int(e): i for i, e in enumerate(redundant.tolist())}
    mine = [s for s, e in enumerate(local) if e in index]  # this rank's slots of redundant experts
    n1 = g1[0].numel()
    out1, out2 = g1, g2
    if (extra or mine) and not (_own(g1) and _own(g2)):
        # the incoming gradients may be shared with other nodes: new tensors are returned
        out1, out2 = g1.clone(), g2.clone()
    for s, part in extra.items():  # replica parts of slots that are not redundant: now
        if s not in mine:
            _add_rounded(out1[s], part[:n1])
            _add_rounded(out2[s], part[n1:])
    if redundant.size == 0:
        return out1, out2
    last = sums.note_backward(mod.layer) if sums is not None else True
    acc = sums.pending.pop(mod.layer, None) if sums is not None else None
    if acc is None:
        acc = torch.zeros(redundant.size, out1[0].numel() + out2[0].numel(), dtype=torch.float32, device=g1.device)
    for s in mine:
        row = acc[index[local[s]]]
        row[:n1].view_as(out1[s]).add_(out1[s])
        row[n1:].view_as(out2[s]).add_(out2[s])
        if s in extra:
            row.add_(extra[s])
    if not last:
        sums.pending[mod.layer] = acc  # type: ignore[union-attr]
        for s in mine:
            out1[s].zero_()
            out2[s].zero_()
        return out1, out2
    # every rank of the group joins, also one that holds none of the redundant experts
    with profile.region("redundant_sum"):
        dist.all_reduce(acc, group=mod.group)
    profile.sync()
    for s in mine:
        row = acc[index[local[s]]]
        out1[s].copy_(row[:n1].view_as(out1[s]))
        out2[s].copy_(row[n1:].view_as(out2[s]))
    return out1, out2


def _add_rounded(g: torch.Tensor, part: torch.Tensor) -> None:
    """``g += part`` (flat fp32) in fp32, rounded once to ``g``'s dtype, in place."""
    if g.dtype == torch.float32:
        g.add_(part.view_as(g))
    else:
        g.copy_(g.float().add_(part.view_as(g)))
