"""Intra-batch hot-expert replication: the plan's replicas carried out.

For each replica ``(micro, group, layer, expert, src_rank, dst_rank, share)`` of this
rank's EP group:

* forward: the copies of one (expert, owner) in a cell travel as a chain, the way
  ``simulate.rs`` prices them: the owner (``src_rank``, its lowest local slot holding the
  expert) sends to the first destination (same node first, then ascending rank), which
  forwards to the next, and so on. `ReplicaExchange.prefetch` posts the first hop of every
  layer of a microbatch asynchronously, so it overlaps the attention before each MoE layer;
  the later hops run when the layer reaches its experts.
* the destination computes the planned share of the expert's tokens with that copy (the
  remapper routes them there, `flow::route_expert`).
* backward: the copies' gradients are reduced back along the chain in fp32 (the last rank
  sends to the one before it, which adds its own, ... down to the owner), from the layer's
  `SlotLink` node (before the dispatch all-to-all's backward, on every rank in the same
  order); the owner adds the sum to its slot's gradient in fp32 inside that node, so the
  parameter's hooks see it (`routepack.torch.slot_link`).

ReLibra-style rows (a copy on an under-loaded rank of the same node) and MindSpeed-style rows
(a copy on every other EP rank, share = that rank's own token fraction) are both just rows.
Each hop moves one expert's weights forward and one fp32 gradient backward: per rank the
bytes the simulator's chain counts (a relay sends once and receives once per chain, the
owner sends once, where a star would make it send once per destination).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

#: gloo matches point-to-point messages by (peer, tag); NCCL ignores tags and relies on both
#: sides posting in the same order, which every exchange here does (table order).
_TAG_WEIGHTS = 0
_TAG_GRADS = 1


def _tag(row_index: int, phase: int, part: int = 0) -> int:
    """The tag of a plan row's message: its weights (``phase`` 0: ``part`` 0 the ``w1``, 1 the
    ``w2``) or its gradient (``phase`` 1)."""
    return 4 * int(row_index) + 2 * phase + part


@dataclass(frozen=True)
class Chain:
    """The copies of one (expert, owner) in one cell, as the simulator prices them.

    * ``hops``: EP ranks after the owner ``src``, same node as the owner first, then ascending
      rank (``simulate.rs``); ``tags``: the plan row index naming each hop's messages.
    * ``mine``: this rank's copy indices (cell order of the rows it receives) in the chain.
    """

    expert: int
    src: int
    hops: Tuple[int, ...]
    tags: Tuple[int, ...]
    mine: Tuple[int, ...]


def chains(idx: np.ndarray, table: Any, topo: Any, me: int) -> List[Chain]:
    """The cell's chains, ordered by (expert, owner), from its rows (``idx`` into
    ``plan.replicas``, ``table`` the rows, table order); ``me``: this EP rank."""
    node = lambda r: r // min(topo.gpus_per_node, topo.ep)  # noqa: E731 (Topology::local_node_of)
    groups: Dict[Tuple[int, int], Dict[int, List[int]]] = {}
    first_tag: Dict[Tuple[int, int, int], int] = {}
    copy = 0
    mine: Dict[Tuple[int, int], List[int]] = {}
    for i, r in zip(idx.tolist(), table if table is not None else []):
        key, dst = (int(r["expert"]), int(r["src_rank"])), int(r["dst_rank"])
        groups.setdefault(key, {}).setdefault(dst, []).append(i)
        first_tag.setdefault(key + (dst,), i)
        if dst == me:
            mine.setdefault(key, []).append(copy)
            copy += 1
    out = []
    for key in sorted(groups):
        src = key[1]
        hops = sorted(groups[key], key=lambda d: (node(d) != node(src), d))
        out.append(
            Chain(
                expert=key[0],
                src=src,
                hops=tuple(hops),
                tags=tuple(first_tag[key + (d,)] for d in hops),
                mine=tuple(mine.get(key, ())),
            )
        )
    return out


class ReplicaExchange:
    """The replica transfers of one EP rank for one window.

    Args:
        layers:   the `EPMoE` layers, index = MoE layer.
        rows:     dict ``(micro, layer) → (indices, table)``: the plan's rows of this EP group for
                  that cell, table order (``indices`` int64 ``[n]`` into ``plan.replicas``).
        timeout:  bound on every wait.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        rows: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]],
        timeout: datetime.timedelta,
    ) -> None:
        self.layers = list(layers)
        self.rows = rows
        self.timeout = timeout
        self.micro = 0
        self._weights: Dict[int, Tuple[list, Tuple[torch.Tensor, torch.Tensor]]] = {}
        self._chain_cache: Dict[Tuple[int, int], List[Chain]] = {}
        self.sent_bytes = 0
        self.received_bytes = 0

    def _cell(self, micro: int, layer: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        empty: Tuple[np.ndarray, Optional[np.ndarray]] = (np.zeros(0, dtype=np.int64), None)
        return self.rows.get((micro, layer), empty)

    def _chains(self, micro: int, layer: int) -> List["Chain"]:
        key = (micro, layer)
        if key not in self._chain_cache:
            mod = self.layers[layer]
            idx, table = self._cell(micro, layer)
            self._chain_cache[key] = chains(idx, table, mod.topo, mod.ep_rank)
        return self._chain_cache[key]

    # ------------------------------------------------------------ forward
    def prefetch(self, micro: int) -> None:
        """Posts the first hop of every layer's weight chains of ``micro`` (asynchronous)."""
        self.micro = micro
        self._weights.clear()
        for layer in range(len(self.layers)):
            self._post_weights(micro, layer)

    def _post_weights(self, micro: int, layer: int) -> None:
        """Posts the first hop of ``layer``'s chains: the owner sends its slot's ``w1`` and
        ``w2`` as they are (no packing copy), the first destination receives them straight into
        its stacks of copies (`weights` returns those stacks: no unpacking copy)."""
        mod = self.layers[layer]
        cs = self._chains(micro, layer)
        h, i2 = mod.w1.shape[1], mod.w1.shape[2]
        copies = sum(len(ch.mine) for ch in cs)
        w1r = mod.w1.new_empty(copies, h, i2)
        w2r = mod.w2.new_empty(copies, i2 // 2, h)
        me = mod.ep_rank
        ops: list = []
        for ch in cs:
            if ch.src == me:
                s = mod.local_slot_of(ch.expert)
                self._send_copy(mod, ops, ch, 0, mod.w1[s].detach(), mod.w2[s].detach())
            elif ch.hops[0] == me:
                self._recv_copy(mod, ops, ch, 0, w1r, w2r)
        works = dist.batch_isend_irecv(ops) if ops else []
        self._weights[layer] = (works, (w1r, w2r))

    def _send_copy(self, mod: Any, ops: list, ch: "Chain", hop: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Appends the sends of one copy (``w1``, ``w2``) on hop ``hop`` of chain ``ch``."""
        for part, w in enumerate((w1, w2)):
            ops.append(
                dist.P2POp(dist.isend, w, mod.peers[ch.hops[hop]], mod.group, _tag(ch.tags[hop], _TAG_WEIGHTS, part))
            )
            self.sent_bytes += w.numel() * w.element_size()

    def _recv_copy(self, mod: Any, ops: list, ch: "Chain", hop: int, w1r: torch.Tensor, w2r: torch.Tensor) -> None:
        """Appends the receives of chain ``ch``'s copy on hop ``hop``, into this rank's first
        copy of it in the stacks ``w1r`` / ``w2r``."""
        prev = ch.src if hop == 0 else ch.hops[hop - 1]
        j = ch.mine[0]
        for part, w in enumerate((w1r[j], w2r[j])):
            ops.append(dist.P2POp(dist.irecv, w, mod.peers[prev], mod.group, _tag(ch.tags[hop], _TAG_WEIGHTS, part)))
            self.received_bytes += w.numel() * w.element_size()

    def weights(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Waits for ``layer``'s transfers of the current microbatch, relaying along each chain
        (hop by hop: a rank forwards the copy it received to the next one); returns this
        rank's copies ``[R, H, 2I]`` and ``[R, I, H]`` in cell order (R may be 0)."""
        if layer not in self._weights:
            self._post_weights(self.micro, layer)
        works, (w1r, w2r) = self._weights.pop(layer)
        for w in works:
            w.wait(self.timeout)
        mod = self.layers[layer]
        me = mod.ep_rank
        cs = self._chains(self.micro, layer)
        for hop in range(1, max((len(ch.hops) for ch in cs), default=0)):
            ops: list = []
            for ch in cs:
                if len(ch.hops) <= hop:
                    continue
                if ch.hops[hop - 1] == me:
                    j = ch.mine[0]
                    self._send_copy(mod, ops, ch, hop, w1r[j], w2r[j])
                elif ch.hops[hop] == me:
                    self._recv_copy(mod, ops, ch, hop, w1r, w2r)
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait(self.timeout)
        for ch in cs:  # a rank holding two copies of one chain received the first only
            for j in ch.mine[1:]:
                w1r[j].copy_(w1r[ch.mine[0]])
                w2r[j].copy_(w2r[ch.mine[0]])
        return w1r, w2r

    # ----------------------------------------------------------- backward
    def exchange_grads(
        self, micro: int, layer: int, g1r: torch.Tensor, g2r: torch.Tensor
    ) -> List[Tuple[int, torch.Tensor]]:
        """Reduces this rank's copy gradients of (``micro``, ``layer``) (``g1r`` ``[R, H, 2I]``,
        ``g2r`` ``[R, I, H]``, cell order) back along each chain in fp32: the last rank sends
        its gradient to the one before it, which adds its own and sends the sum on, down to
        the owner. Returns ``(local slot, fp32 [H*2I + I*H])`` per chain this rank owns.
        Called from `SlotLink`'s backward on every rank of the group alike; the buffers live
        only until the caller has added them."""
        mod = self.layers[layer]
        me = mod.ep_rank
        cs = self._chains(micro, layer)
        numel = mod.w1[0].numel() + mod.w2[0].numel()
        acc: Dict[int, torch.Tensor] = {}
        for c, ch in enumerate(cs):
            for j in ch.mine:
                g = torch.cat([g1r[j].reshape(-1), g2r[j].reshape(-1)]).to(torch.float32)
                acc[c] = g if c not in acc else acc[c] + g
        got: List[Tuple[int, torch.Tensor]] = []
        for hop in range(max((len(ch.hops) for ch in cs), default=0) - 1, -1, -1):
            ops, recvs = [], []
            for c, ch in enumerate(cs):
                if len(ch.hops) <= hop:
                    continue
                prev = ch.src if hop == 0 else ch.hops[hop - 1]
                if ch.hops[hop] == me:
                    ops.append(
                        dist.P2POp(dist.isend, acc[c], mod.peers[prev], mod.group, _tag(ch.tags[hop], _TAG_GRADS))
                    )
                    self.sent_bytes += numel * 4
                elif prev == me:
                    buf = torch.empty(numel, dtype=torch.float32, device=mod.w1.device)
                    ops.append(
                        dist.P2POp(dist.irecv, buf, mod.peers[ch.hops[hop]], mod.group, _tag(ch.tags[hop], _TAG_GRADS))
                    )
                    recvs.append((c, buf))
                    self.received_bytes += numel * 4
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait(self.timeout)
            for c, buf in recvs:
                if hop == 0:
                    got.append((mod.local_slot_of(cs[c].expert), buf))
                else:
                    acc[c] = acc[c] + buf
        return got

    def finish(self) -> None:
        """Nothing left to do: `SlotLink` delivers every copy's gradient inside backward. Kept
        so that callers written for the older after-backward delivery still work."""
