"""Intra-batch hot-expert replication: the plan's replicas carried out.

For each replica ``(micro, group, layer, expert, src_rank, dst_rank, share)`` of this
rank's EP group:

* forward: the owner (``src_rank``) sends the expert's weights (its lowest local slot holding
  it) to ``dst_rank``. `ReplicaExchange.prefetch` posts these transfers asynchronously for a
  whole microbatch, so they overlap the attention that precedes each MoE layer; the layer
  waits for its own layer's transfers only when it reaches its experts.
* the destination computes the planned share of the expert's tokens with that copy (the
  remapper routes them there, `flow::route_expert`).
* backward: the copy's gradient is sent back in fp32 from the layer's `SlotLink` node (before
  the dispatch all-to-all's backward, on every rank in the same order); the owner adds it to
  its slot's gradient in fp32 inside that node, so the parameter's hooks see it
  (`routepack.torch.slot_link`).

ReLibra-style rows (a copy on an under-loaded rank of the same node) and MindSpeed-style rows
(a copy on every other EP rank, share = that rank's own token fraction) are both just rows.
Transfers are point-to-point owner ↔ destination (a star); the simulator prices a chain
src → dsts, which moves the same bytes per destination but fewer through the owner.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

#: gloo matches point-to-point messages by (peer, tag); NCCL ignores tags and relies on both
#: sides posting in the same order, which every exchange here does (table order).
_TAG_WEIGHTS = 0
_TAG_GRADS = 1


def _tag(row_index: int, phase: int) -> int:
    return 2 * int(row_index) + phase


class ReplicaExchange:
    """The replica transfers of one EP rank for one window.

    Args:
        layers:   the `EPMoE` layers, index = MoE layer.
        rows:     dict ``(micro, layer) → (indices, table)``: the plan's rows of this EP group for
                  that cell, table order (``indices`` int64 ``[n]`` into ``plan.replicas``).
        timeout:  bound on every wait.
    """

    def __init__(self, layers: Sequence[Any], rows: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]],
                 timeout: datetime.timedelta) -> None:
        self.layers = list(layers)
        self.rows = rows
        self.timeout = timeout
        self.micro = 0
        self._weights: Dict[int, Tuple[list, list, np.ndarray]] = {}
        self.sent_bytes = 0
        self.received_bytes = 0

    def _cell(self, micro: int, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        empty = (np.zeros(0, dtype=np.int64), None)
        return self.rows.get((micro, layer), empty)

    # ------------------------------------------------------------ forward
    def prefetch(self, micro: int) -> None:
        """Posts the weight transfers of every layer of ``micro`` (asynchronous)."""
        self.micro = micro
        self._weights.clear()
        for layer in range(len(self.layers)):
            self._post_weights(micro, layer)

    def _post_weights(self, micro: int, layer: int) -> None:
        mod = self.layers[layer]
        idx, table = self._cell(micro, layer)
        me, ops, bufs = mod.ep_rank, [], []
        numel = mod.w1[0].numel() + mod.w2[0].numel()
        mine = []
        for i, r in zip(idx.tolist(), table if table is not None else []):
            src, dst = int(r["src_rank"]), int(r["dst_rank"])
            if src == me:
                s = mod.local_slot_of(int(r["expert"]))
                buf = torch.cat([mod.w1[s].detach().reshape(-1), mod.w2[s].detach().reshape(-1)])
                ops.append(dist.P2POp(dist.isend, buf, mod.peers[dst], mod.group, _tag(i, _TAG_WEIGHTS)))
                bufs.append(buf)
                self.sent_bytes += buf.numel() * buf.element_size()
            elif dst == me:
                buf = torch.empty(numel, dtype=mod.w1.dtype, device=mod.w1.device)
                ops.append(dist.P2POp(dist.irecv, buf, mod.peers[src], mod.group, _tag(i, _TAG_WEIGHTS)))
                bufs.append(buf)
                mine.append(len(bufs) - 1)
                self.received_bytes += buf.numel() * buf.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        self._weights[layer] = (works, bufs, np.asarray(mine, dtype=np.int64))

    def weights(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Waits for ``layer``'s transfers of the current microbatch; returns this rank's copies
        ``[R, H, 2I]`` and ``[R, I, H]`` in cell order (R may be 0)."""
        if layer not in self._weights:
            self._post_weights(self.micro, layer)
        works, bufs, mine = self._weights.pop(layer)
        for w in works:
            w.wait(self.timeout)
        mod = self.layers[layer]
        h, i2 = mod.w1.shape[1], mod.w1.shape[2]
        n1 = h * i2
        w1r = torch.stack([bufs[j][:n1].view(h, i2) for j in mine.tolist()]) if mine.size else mod.w1.new_empty(0, h, i2)
        w2r = torch.stack([bufs[j][n1:].view(i2 // 2, h) for j in mine.tolist()]) if mine.size else mod.w2.new_empty(0, i2 // 2, h)
        return w1r, w2r

    # ----------------------------------------------------------- backward
    def exchange_grads(self, micro: int, layer: int, g1r: torch.Tensor,
                       g2r: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
        """Sends this rank's copy gradients of (``micro``, ``layer``) (``g1r`` ``[R, H, 2I]``,
        ``g2r`` ``[R, I, H]``, cell order) to their owners in fp32 and receives the ones owed to
        its slots; waits for both. Returns ``(local slot, fp32 [H*2I + I*H])`` per received row,
        in table order. Called from `SlotLink`'s backward on every rank of the group alike;
        the buffers live only until the caller has added them."""
        mod = self.layers[layer]
        idx, table = self._cell(micro, layer)
        me, ops, got = mod.ep_rank, [], []
        numel = mod.w1[0].numel() + mod.w2[0].numel()
        j = 0
        for i, r in zip(idx.tolist(), table if table is not None else []):
            src, dst = int(r["src_rank"]), int(r["dst_rank"])
            if dst == me:
                buf = torch.cat([g1r[j].reshape(-1), g2r[j].reshape(-1)]).to(torch.float32)
                j += 1
                ops.append(dist.P2POp(dist.isend, buf, mod.peers[src], mod.group, _tag(i, _TAG_GRADS)))
                self.sent_bytes += buf.numel() * 4
            elif src == me:
                buf = torch.empty(numel, dtype=torch.float32, device=mod.w1.device)
                ops.append(dist.P2POp(dist.irecv, buf, mod.peers[dst], mod.group, _tag(i, _TAG_GRADS)))
                got.append((mod.local_slot_of(int(r["expert"])), buf))
                self.received_bytes += buf.numel() * 4
        for w in (dist.batch_isend_irecv(ops) if ops else []):
            w.wait(self.timeout)
        return got

    def finish(self) -> None:
        """Nothing left to do: `SlotLink` delivers every copy's gradient inside backward. Kept
        so that callers written for the older after-backward delivery still work."""
