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
Under a pipeline schedule a stage keeps several microbatches in flight: the forward of micro
m + 1 (after ``start_micro(m + 1)``) runs before the backward of micro m. Everything here is
therefore keyed by microbatch: the posted first hops per (micro, layer), the chains per
(micro, layer), and the backward takes the microbatch its forward ran (`SlotLink` keeps it in
the autograd context), so micro m's gradients return along micro m's chains whatever micro is
current. A microbatch's copies are held by autograd (saved for the experts' backward) from its
forward until its backward, which returns their gradients before the node ends and frees them;
so a rank holds the ``replica_slots``-bounded copies of each microbatch in flight: at most
``pp`` of them under 1F1B (stage s holds ``pp - s``), every microbatch under GPipe.

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


def _tag(row_index: int, phase: int) -> int:
    return 2 * int(row_index) + phase


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
    node = lambda r: r // min(topo.domain, topo.ep)  # noqa: E731 (Topology::local_node_of)
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
        layers:   the `EPMoE` layers; ``rows``' layer index is the position in this list (the
                  MoE layer, or the position among a pipeline stage's layers: `index_of`).
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
        self._index = {id(mod): i for i, mod in enumerate(self.layers)}
        self.rows = rows
        self.timeout = timeout
        self.micro = 0
        #: (micro, layer) → the posted first hops (works, buffers), until the layer's forward takes them
        self._weights: Dict[Tuple[int, int], Tuple[list, dict]] = {}
        #: micro → layers whose forward took its copies in the current pass over the micro's layers
        self._taken: Dict[int, set] = {}
        self._chain_cache: Dict[Tuple[int, int], List[Chain]] = {}
        self.sent_bytes = 0
        self.received_bytes = 0

    @property
    def posted(self) -> List[Tuple[int, int]]:
        """(micro, layer) cells whose first hops are posted and not yet taken by the layer's
        forward (none once every forward of the step has run)."""
        return sorted(self._weights)

    def index_of(self, mod: Any) -> int:
        """The position of layer ``mod`` in ``layers`` (the index this exchange's methods take)."""
        return self._index[id(mod)]

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
        """Makes ``micro`` current and posts the first hop of every layer's weight chains of
        ``micro`` (asynchronous). Transfers posted for other microbatches stay until their
        layers' forward takes them.

        Each (micro, layer) cell is posted once per pass over the microbatch's layers: under
        the interleaved schedule (``vpp`` > 1) a stage runs ``micro``'s forward chunk by chunk
        and the trainer calls this before each chunk, so the cells already posted (a later
        chunk's layers) or already taken (an earlier chunk's) are left alone. Once every
        layer's forward of ``micro`` has taken its copies, the next call starts a new pass
        (the next step of the window) and posts them all again."""
        self.micro = micro
        taken = self._taken.setdefault(micro, set())
        if len(taken) == len(self.layers):
            taken.clear()
        for layer in range(len(self.layers)):
            if layer not in taken and (micro, layer) not in self._weights:
                self._post_weights(micro, layer)

    def _post_weights(self, micro: int, layer: int) -> None:
        mod = self.layers[layer]
        # held[c]: the copy of chain c this rank received; held[-1 - c]: the owner's send buffer
        me, ops = mod.ep_rank, []
        held: Dict[int, torch.Tensor] = {}
        for c, ch in enumerate(self._chains(micro, layer)):
            if ch.src == me:
                buf = self.slot_flat(mod, mod.local_slot_of(ch.expert))
                ops.append(
                    dist.P2POp(dist.isend, buf, mod.peers[ch.hops[0]], mod.group, _tag(ch.tags[0], _TAG_WEIGHTS))
                )
                held[-1 - c] = buf
                self.sent_bytes += buf.numel() * buf.element_size()
            elif ch.hops[0] == me:
                held[c] = self._recv_weights(mod, ops, ch, 0)
        works = dist.batch_isend_irecv(ops) if ops else []
        self._weights[(micro, layer)] = (works, held)

    # ------------------------------------------------ the layer's slot layout
    # `EPMoE`'s stacked ``w1``/``w2``; `routepack.integrations.megatron` overrides these four
    # for Megatron's expert modules (one flat buffer per expert either way)
    def slot_flat(self, mod: Any, slot: int) -> torch.Tensor:
        """A 1-D copy of local slot ``slot``'s weights (what a copy receives)."""
        return torch.cat([mod.w1[slot].detach().reshape(-1), mod.w2[slot].detach().reshape(-1)])

    def flat_spec(self, mod: Any) -> Tuple[int, torch.dtype, torch.device]:
        """(elements, dtype, device) of one expert's flat weights."""
        return mod.w1[0].numel() + mod.w2[0].numel(), mod.w1.dtype, mod.w1.device

    def unflatten(self, mod: Any, copies: List[torch.Tensor]) -> Any:
        """This rank's copies (flat, cell order) as the layer consumes them: `EPMoE`'s
        ``(w1r [R, H, 2I], w2r [R, I, H])``."""
        h, i2 = mod.w1.shape[1], mod.w1.shape[2]
        n1 = h * i2
        w1r = torch.stack([b[:n1].view(h, i2) for b in copies]) if copies else mod.w1.new_empty(0, h, i2)
        w2r = torch.stack([b[n1:].view(i2 // 2, h) for b in copies]) if copies else mod.w2.new_empty(0, i2 // 2, h)
        return w1r, w2r

    def copy_grad(self, grads: Any, copy: int) -> torch.Tensor:
        """Copy ``copy``'s gradient (cell order) as flat fp32, from what the layer's backward
        holds (`EPMoE`: ``(g1r, g2r)``)."""
        g1r, g2r = grads
        return torch.cat([g1r[copy].reshape(-1), g2r[copy].reshape(-1)]).to(torch.float32)

    def _recv_weights(self, mod: Any, ops: list, ch: "Chain", hop: int) -> torch.Tensor:
        numel, dtype, device = self.flat_spec(mod)
        buf = torch.empty(numel, dtype=dtype, device=device)
        prev = ch.src if hop == 0 else ch.hops[hop - 1]
        ops.append(dist.P2POp(dist.irecv, buf, mod.peers[prev], mod.group, _tag(ch.tags[hop], _TAG_WEIGHTS)))
        self.received_bytes += buf.numel() * buf.element_size()
        return buf

    def weights(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Waits for ``layer``'s transfers of the current microbatch, relaying along each chain
        (hop by hop: a rank forwards the copy it received to the next one); returns this
        rank's copies ``[R, H, 2I]`` and ``[R, I, H]`` in cell order (R may be 0)."""
        if (self.micro, layer) not in self._weights:
            self._post_weights(self.micro, layer)
        works, held = self._weights.pop((self.micro, layer))
        self._taken.setdefault(self.micro, set()).add(layer)
        for w in works:
            w.wait(self.timeout)
        mod = self.layers[layer]
        me = mod.ep_rank
        cs = self._chains(self.micro, layer)
        for hop in range(1, max((len(ch.hops) for ch in cs), default=0)):
            ops = []
            for c, ch in enumerate(cs):
                if len(ch.hops) <= hop:
                    continue
                if ch.hops[hop - 1] == me:
                    ops.append(
                        dist.P2POp(
                            dist.isend, held[c], mod.peers[ch.hops[hop]], mod.group, _tag(ch.tags[hop], _TAG_WEIGHTS)
                        )
                    )
                    self.sent_bytes += held[c].numel() * held[c].element_size()
                elif ch.hops[hop] == me:
                    held[c] = self._recv_weights(mod, ops, ch, hop)
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait(self.timeout)
        by_copy = {j: held[c] for c, ch in enumerate(cs) for j in ch.mine}  # copy index, cell order
        return self.unflatten(mod, [by_copy[j] for j in range(len(by_copy))])

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
        return self.exchange_copy_grads(micro, layer, (g1r, g2r))

    def exchange_copy_grads(self, micro: int, layer: int, grads: Any) -> List[Tuple[int, torch.Tensor]]:
        """`exchange_grads` for any slot layout: ``grads`` is what `copy_grad` reads."""
        mod = self.layers[layer]
        me = mod.ep_rank
        cs = self._chains(micro, layer)
        numel, _, device = self.flat_spec(mod)
        acc: Dict[int, torch.Tensor] = {}
        for c, ch in enumerate(cs):
            for j in ch.mine:
                g = self.copy_grad(grads, j)
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
                    buf = torch.empty(numel, dtype=torch.float32, device=device)
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
