"""Expert gradients completed inside autograd, before any parameter hook fires.

`EPMoE` runs its experts on the outputs of one autograd node, `SlotLink`: the received
tokens, views of its own slots ``w1``/``w2`` and the replica copies of this microbatch. In
backward that node therefore holds, for the layer, every gradient that belongs to the slots:

* the local one (tokens this rank's slots computed),
* the replica copies' gradients, sent back in fp32 by the ranks that computed them (the
  copy holders post them from this same node, in plan table order, on every rank alike),
* for redundant experts (one expert in several slots), the sum over every slot of the EP
  group (one fp32 all-reduce over only those experts).

It adds them in fp32 and rounds once to the parameter's dtype, and returns that as the
gradient of ``w1``/``w2``. Autograd then accumulates it into ``p.grad`` and fires the
parameter's hooks (DDP buckets, Megatron's ``main_grad`` copy, ``overlap_grad_reduce``,
``register_post_accumulate_grad_hook``) with the complete gradient of this microbatch. No
buffer outlives the node. The expert-data-parallel sum (same slot across EP groups) is the
trainer's own DP reduction, or `PlanRunner.finish_step`'s.

Threading the tokens through the node fixes the order of the backward collectives on every
rank: the experts' backward, then this node's transfers, then the dispatch all-to-all's.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist


class SlotLink(torch.autograd.Function):
    """``(recv, w1, w2) → (recv, w1, w2, w1r, w2r)``: identities on the tokens and the layer's
    slots, plus the replica copies ``w1r`` ``[R, H, 2I]`` / ``w2r`` ``[R, I, H]`` (R may be 0)
    that ``exchange`` received for this layer. Backward: see the module docstring."""

    @staticmethod
    def forward(ctx, recv, w1, w2, mod, exchange):  # type: ignore[override]
        if exchange is not None:
            w1r, w2r = exchange.weights(mod.layer)
            ctx.micro = exchange.micro
        else:
            h, i2 = w1.shape[1], w1.shape[2]
            w1r, w2r = w1.new_empty(0, h, i2), w2.new_empty(0, i2 // 2, h)
            ctx.micro = 0
        ctx.mod, ctx.exchange = mod, exchange
        return recv.view_as(recv), w1.view_as(w1), w2.view_as(w2), w1r, w2r

    @staticmethod
    def backward(ctx, g_recv, g1, g2, g1r, g2r):  # type: ignore[override]
        mod, exchange = ctx.mod, ctx.exchange
        extra: Dict[int, torch.Tensor] = {}
        if exchange is not None:
            for slot, buf in exchange.exchange_grads(ctx.micro, mod.layer, g1r, g2r):
                extra[slot] = buf if slot not in extra else extra[slot] + buf
        g1, g2 = complete_slot_grads(mod, g1, g2, extra)
        return g_recv, g1, g2, None, None


def redundant_experts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ``[n]``: logical experts held by more than one slot of the layer (ascending)."""
    counts = np.bincount(phy2log[phy2log >= 0], minlength=num_experts)
    return np.flatnonzero(counts > 1)


@torch.no_grad()
def complete_slot_grads(mod: Any, g1: torch.Tensor, g2: torch.Tensor,
                        extra: Dict[int, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(g1, g2)`` (``[spr, H, 2I]`` / ``[spr, I, H]``, the parameter's dtype) with each local
    slot's replica gradients ``extra[slot]`` (fp32, flat ``[H*2I + I*H]``) added and every
    redundant expert summed over the EP group, in fp32, rounded once. Collective over
    ``mod.group`` when the layer has redundant experts (every rank of it calls this)."""
    redundant = redundant_experts(mod.phy2log, mod.num_experts)
    local = mod.local_experts().tolist()
    index = {int(e): i for i, e in enumerate(redundant.tolist())}
    touched = sorted(set(extra) | {s for s, e in enumerate(local) if e in index})
    if not touched and redundant.size == 0:
        return g1, g2
    n1, n2 = g1[0].numel(), g2[0].numel()
    acc: Dict[int, torch.Tensor] = {}
    for s in touched:
        a = torch.cat([g1[s].reshape(-1), g2[s].reshape(-1)]).to(torch.float32)
        if s in extra:
            a += extra[s]
        acc[s] = a
    if redundant.size:
        # every rank of the group joins, also one that holds none of the redundant experts
        buf = torch.zeros(redundant.size, n1 + n2, dtype=torch.float32, device=g1.device)
        for s in touched:
            if local[s] in index:
                buf[index[local[s]]] += acc[s]
        dist.all_reduce(buf, group=mod.group)
        for s in touched:
            if local[s] in index:
                acc[s] = buf[index[local[s]]]
    if not touched:
        return g1, g2
    # new tensors: the incoming gradients may be shared with other nodes and are not ours to edit
    out1, out2 = g1.clone(), g2.clone()
    for s in touched:
        out1[s] = acc[s][:n1].view(g1.shape[1:]).to(g1.dtype)
        out2[s] = acc[s][n1:].view(g2.shape[1:]).to(g2.dtype)
    return out1, out2

