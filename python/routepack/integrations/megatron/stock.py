"""A stock-layout view of a Megatron model built with routepack's MoE layers (torch, Megatron):
each EP rank's experts as the stock model's rank holds them, so code written for the stock
model reads and writes the plan's model unchanged.

Megatron's stock model holds ``E / ep`` experts on EP rank r, local expert ``i`` being
logical expert ``r * E / ep + i``. Under a plan, rank r's slots hold whichever experts the
placement put there (redundant copies, empty slots and replica buffers included). `StockChunk`
wraps one model chunk: its ``named_parameters`` yields every parameter outside the MoE experts
as it is (the parameter itself), and each MoE layer's experts as the stock rank's: the first
``E / ep`` local experts' names (``local_experts.{i}.…`` of ``SequentialMLP``, ``weight{i}`` /
``bias{i}`` of ``TEGroupedMLP``) holding logical experts ``r * E / ep + i``, gathered over the
EP group (the first copy of each expert), with the physical parameter's attributes
(``tensor_model_parallel``, ``partition_dim``, ...). Everything else (``config``,
``named_buffers``, ``module``, ...) is the chunk's.

Writing through the view works: a consumer that writes into the yielded expert tensors
(``tensor.copy_(…)``: slime's ``TensorBackuper.restore``, its HF checkpoint load) has its
writes put back into every slot that holds the expert, on every EP rank, once the iteration
ends (the tensors' version counters say which layers were written; the EP ranks agree by one
all-reduce). Iterating is collective over each MoE layer's EP group: every rank of it must
iterate the view alike and to the end (a write into an iteration left unfinished is logged as
lost).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations.megatron.checkpoint import _layer_logical
from routepack.integrations.megatron.layer import PlanMoELayer

LOG = logging.getLogger("routepack.integrations.megatron")
#: attributes of a physical parameter that describe it (copied onto the view's tensors)
_SKIP_ATTRS = ("main_grad", "grad_added_to_main_grad", "shared", "main_param", "_")


def has_plan_layers(model: Any) -> bool:
    """Whether any chunk of ``model`` (a module or a list of chunks) holds a `PlanMoELayer`."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return any(isinstance(m, PlanMoELayer) for c in chunks for m in c.modules())


def stock_view(model: Any) -> Any:
    """``model`` (a list of chunks, or a module) as `StockChunk` s, in the same container kind;
    ``model`` itself where no chunk holds a `PlanMoELayer` (the stock model is its own view)."""
    if not has_plan_layers(model):
        return model
    if isinstance(model, (list, tuple)):
        return [StockChunk(c) for c in model]
    return StockChunk(model)


class StockChunk:
    """One model chunk in the stock layout (module docstring)."""

    def __init__(self, chunk: Any) -> None:
        self.chunk = chunk
        #: "...mlp.experts." name prefix (as the chunk names its parameters) -> the layer
        self.owners: Dict[str, PlanMoELayer] = {
            f"{n}.experts.": m for n, m in chunk.named_modules() if isinstance(m, PlanMoELayer)
        }
        for prefix, layer in self.owners.items():
            E, ep = layer.num_logical, layer.topo.ep
            if E % ep:
                raise RoutepackError(f"stock view: {prefix} has {E} experts, not a multiple of ep={ep}")
            if layer.pieces.kind == "GroupedMLP":
                raise RoutepackError(
                    f"stock view: {prefix} is a GroupedMLP (one parameter holds every slot); the stock-layout view "
                    "supports SequentialMLP and TEGroupedMLP"
                )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.chunk, name)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return self.chunk.named_buffers(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, t in self.named_parameters(recurse=recurse):
            yield t

    def named_parameters(self, prefix: str = "", recurse: bool = True, **kwargs: Any) -> Iterator[Tuple[str, Any]]:
        """The chunk's parameters with every MoE layer's experts in the stock layout (module
        docstring). Collective over the EP group; writes go back when the iteration ends."""
        lead = f"{prefix}." if prefix else ""
        done: set = set()
        shares: List[Tuple[PlanMoELayer, torch.Tensor, int]] = []
        finished = False
        try:
            for name, p in self.chunk.named_parameters(prefix=prefix, recurse=recurse, **kwargs):
                owner = next((k for k in self.owners if name.startswith(lead + k)), None)
                if owner is None:
                    yield name, p
                    continue
                if owner in done:
                    continue
                done.add(owner)
                layer = self.owners[owner]
                share, entries = _stock_experts(layer, lead + owner)
                shares.append((layer, share, share._version))
                yield from entries
            finished = True
        finally:
            if not finished and any(share._version != v for _, share, v in shares):
                LOG.error(
                    "routepack: a stock-layout view of the model was written to but not iterated to the end; "
                    "those writes did not reach the model's experts"
                )
        _write_back(shares)


@torch.no_grad()
def _stock_experts(layer: PlanMoELayer, prefix: str) -> Tuple[torch.Tensor, List[Tuple[str, torch.Tensor]]]:
    """(this rank's stock share ``[E/ep, numel]``, its entries as the stock rank names them):
    logical experts ``r * E/ep + i`` under local expert ``i``'s names, in the physical
    parameters' order."""
    pieces = layer.pieces
    n = layer.num_logical // layer.topo.ep
    base = layer.ep_rank * n
    logical = _layer_logical(layer)
    share = torch.stack([logical[base + i] for i in range(n)]).clone()
    del logical
    where: Dict[int, Tuple[int, int]] = {}
    for s, slot in enumerate(pieces.slots):
        off = 0
        for piece in slot:
            where[id(piece.param)] = (s, off)
            off += piece.length
    entries: List[Tuple[str, torch.Tensor]] = []
    for name, p in layer.experts.named_parameters():
        s, off = where.get(id(p), (-1, 0))
        if s < 0 or s >= n:
            continue
        t = share[s, off : off + p.numel()].view(p.shape)
        for key, value in vars(p).items():
            if not key.startswith(_SKIP_ATTRS):
                setattr(t, key, value)
        entries.append((prefix + name, t))
    return share, entries


@torch.no_grad()
def _write_back(shares: List[Tuple[PlanMoELayer, torch.Tensor, int]]) -> None:
    """Puts written stock shares back into every slot holding their experts (module docstring)."""
    if not shares:
        return
    group = shares[0][0].ep_group
    device = shares[0][1].device
    written = torch.tensor([int(share._version != v) for _, share, v in shares], dtype=torch.int64, device=device)
    dist.all_reduce(written, op=dist.ReduceOp.MAX, group=group)
    for (layer, share, _), flag in zip(shares, written.tolist()):
        if not flag:
            continue
        parts = [torch.empty_like(share) for _ in range(layer.topo.ep)]
        dist.all_gather(parts, share, group=layer.ep_group)
        full = torch.cat(parts)  # [E, numel], logical order
        for s, e in enumerate(layer.local_experts().tolist()):
            if e >= 0:
                layer.pieces.set_weights(s, full[e])


__all__ = ["StockChunk", "has_plan_layers", "stock_view"]
