"""Gradients of experts that live in more than one slot.

A placement may hold a hot expert in several slots (redundant copies, EPLB-style). Each copy
gets the gradient of the tokens it computed; the logical expert's gradient is their sum. Every
copy must step with that sum, or the copies drift apart. `sync_redundant_grads` sums them over
the EP group (one all-reduce per layer, over only the redundant experts) and, where DP has
several EP groups, over the expert-data-parallel group too, so each copy ends with the full
logical gradient and the same optimizer update (all-reduce gives every rank the same bits).

`EPMoE`'s backward already does the EP-group sum (and adds replica gradients) before the
parameter hooks fire (`routepack.torch.slot_link`; under a `PlanRunner`, once per step, in
the last microbatch's backward); for such layers
(``grads_complete_in_backward``) `sync_redundant_grads` only does the sum across EP groups,
which a trainer with its own expert-data-parallel reduction (DDP, Megatron) skips.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from routepack.torch import _args
from routepack.torch.moe import check_layers
from routepack.torch.slot_link import redundant_experts


@torch.no_grad()
def sync_redundant_grads(layers: Sequence[Any], group: Optional[Any] = None, edp_group: Optional[Any] = None) -> None:
    """Sums every logical expert's gradient over all its slots; each slot gets the sum.

    ``layers``: `EPMoE` layers of this rank; ``group``: the EP group; ``edp_group``: ranks that
    hold the same EP-local rank in every EP group (None when there is one EP group). Slots
    without a gradient count as zero. Collective: every rank of both groups calls it. For
    `EPMoE` layers the EP-group sum already happened in backward, so only ``edp_group``'s
    remains.
    """
    layers = check_layers(layers)
    _args.group(group)
    _args.group(edp_group, "edp_group")
    for mod in layers:
        for p in (mod.w1, mod.w2):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if edp_group is not None:
            for p in (mod.w1, mod.w2):
                dist.all_reduce(p.grad, group=edp_group)
        redundant = redundant_experts(mod.phy2log, mod.num_experts)
        if redundant.size == 0 or getattr(mod, "grads_complete_in_backward", False):
            continue
        index = {int(e): i for i, e in enumerate(redundant)}
        n1, n2 = mod.w1[0].numel(), mod.w2[0].numel()
        buf = torch.zeros(redundant.size, n1 + n2, dtype=torch.float32, device=mod.w1.device)
        local = [(s, index[int(e)]) for s, e in enumerate(mod.local_experts().tolist()) if int(e) in index]
        for s, i in local:
            buf[i, :n1] += mod.w1.grad[s].reshape(-1).float()
            buf[i, n1:] += mod.w2.grad[s].reshape(-1).float()
        dist.all_reduce(buf, group=group)
        for s, i in local:
            mod.w1.grad[s].copy_(buf[i, :n1].view(mod.w1.shape[1:]))
            mod.w2.grad[s].copy_(buf[i, n1:].view(mod.w2.shape[1:]))
