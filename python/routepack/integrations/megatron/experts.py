"""One expert slot of Megatron-Core's expert modules as flat pieces of parameters (torch).

A physical slot ``i`` of a rank is Megatron's local expert ``i``. Its weights live in

* ``SequentialMLP``: the parameters of ``local_experts[i]`` (``linear_fc1.weight``,
  ``linear_fc2.weight``, their biases where ``add_bias_linear``), each whole;
* ``TEGroupedMLP``: ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}`` (and ``bias{i}``);
* ``GroupedMLP``: a contiguous range of ``weight1`` / ``weight2`` (its forward reads
  ``weight1.view(num_local_experts, H, -1)[i]``).

`SlotPieces` names each slot as ``(parameter, flat start, length)`` pieces, so every consumer
(replica copies, gradients sent home, redundant sums, migration with ``main_grad`` and
optimizer state, checkpoints) works on flat ranges of the parameters Megatron owns, whatever
the module. Its own module so that the layer, the optimizer mapping and the checkpoint code
share one definition.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import torch

from routepack.errors import RoutepackError


class Piece(NamedTuple):
    """``param.view(-1)[start : start + length]`` is part of a slot; ``name`` is the
    parameter's name inside the experts module (``local_experts.3.linear_fc1.weight``)."""

    param: torch.nn.Parameter
    start: int
    length: int
    name: str


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t``'s elements (``t`` must be contiguous: Megatron's parameters and
    grad buffers are)."""
    if not t.is_contiguous():
        raise RoutepackError(f"expert tensor of shape {tuple(t.shape)} is not contiguous; cannot view its slots")
    return t.view(-1)


class SlotPieces:
    """The slots of one experts module (``num_local_experts`` of them), each a list of pieces
    in a fixed order (the same on every rank: the modules are built alike)."""

    def __init__(self, experts: Any) -> None:
        self.experts = experts
        n = int(getattr(experts, "num_local_experts", 0))
        if n <= 0:
            raise RoutepackError(f"experts: {type(experts).__name__} has no num_local_experts")
        self.num_slots = n
        self.kind = type(experts).__name__
        named = dict(experts.named_parameters())
        self.slots: List[List[Piece]] = [self._pieces(named, i) for i in range(n)]
        sizes = {sum(p.length for p in s) for s in self.slots}
        if len(sizes) != 1:  # pragma: no cover - Megatron builds every expert alike
            raise RoutepackError(f"experts: slots of {self.kind} differ in size: {sorted(sizes)}")
        self.numel = sizes.pop()
        self.dtype = self.slots[0][0].param.dtype
        if any(p.param.dtype != self.dtype for s in self.slots for p in s):
            raise RoutepackError(f"experts: {self.kind} mixes parameter dtypes; routepack moves one dtype per slot")

    @property
    def device(self) -> torch.device:
        """Where the experts are now (read each time: a model built on the CPU is moved after)."""
        return self.slots[0][0].param.device

    def _pieces(self, named: dict, i: int) -> List[Piece]:
        if hasattr(self.experts, "local_experts"):  # SequentialMLP
            prefix = f"local_experts.{i}."
            return [Piece(p, 0, p.numel(), k) for k, p in named.items() if k.startswith(prefix)]
        if hasattr(self.experts, "weight1") and hasattr(self.experts, "weight2"):  # GroupedMLP
            out = []
            for k in ("weight1", "weight2"):
                p = named[k]
                per = p.numel() // self.num_slots
                out.append(Piece(p, i * per, per, k))
            return out
        suffixes = (f".weight{i}", f".bias{i}")  # TEGroupedMLP (GroupedLinear: weight{i}, bias{i})
        out = [Piece(p, 0, p.numel(), k) for k, p in named.items() if k.endswith(suffixes)]
        if not out:
            raise RoutepackError(
                f"experts: {self.kind} is none of SequentialMLP, GroupedMLP, TEGroupedMLP "
                "(no local_experts, weight1/weight2 or weight{i}); routepack cannot name its slots"
            )
        return out

    # ---------------------------------------------------------------- weights
    def params(self) -> List[torch.nn.Parameter]:
        """Every parameter holding some slot, once, in order."""
        seen, out = set(), []
        for s in self.slots:
            for p in s:
                if id(p.param) not in seen:
                    seen.add(id(p.param))
                    out.append(p.param)
        return out

    def weights(self, slot: int) -> torch.Tensor:
        """A 1-D copy of slot ``slot``'s weights."""
        return torch.cat([flat(p.param.detach())[p.start : p.start + p.length] for p in self.slots[slot]])

    @torch.no_grad()
    def set_weights(self, slot: int, buf: torch.Tensor) -> None:
        """Writes a flat copy (`weights`' layout) into slot ``slot``'s parameters."""
        off = 0
        for p in self.slots[slot]:
            flat(p.param.data)[p.start : p.start + p.length].copy_(buf[off : off + p.length])
            off += p.length

    # -------------------------------------------------------------- gradients
    @staticmethod
    def grad_store(param: torch.nn.Parameter, create: bool = False) -> Optional[torch.Tensor]:
        """Where ``param``'s gradient accumulates: Megatron DDP's ``main_grad`` (a view into
        its grad buffer), else ``param.grad`` (None when nothing has accumulated, unless
        ``create``: then zeros are put there)."""
        g = getattr(param, "main_grad", None)
        if g is not None:
            return g
        if param.grad is None and create:
            param.grad = torch.zeros_like(param)
        return param.grad

    def grad(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s accumulated gradient as flat fp32 (zeros where none accumulated)."""
        parts = []
        for p in self.slots[slot]:
            g = self.grad_store(p.param)
            if g is None:
                parts.append(torch.zeros(p.length, dtype=torch.float32, device=p.param.device))
            else:
                parts.append(flat(g)[p.start : p.start + p.length].to(torch.float32))
        return torch.cat(parts)

    @torch.no_grad()
    def set_grad(self, slot: int, buf: Optional[torch.Tensor], add: bool = False) -> None:
        """Writes (``add``: adds) flat fp32 ``buf`` into slot ``slot``'s gradient store, rounded
        once to the store's dtype; ``buf`` None writes zeros."""
        off = 0
        for p in self.slots[slot]:
            g = self.grad_store(p.param, create=buf is not None)
            if g is not None:
                dst = flat(g)[p.start : p.start + p.length]
                if buf is None:
                    dst.zero_()
                elif add:
                    dst.copy_((dst.to(torch.float32) + buf[off : off + p.length]).to(dst.dtype))
                else:
                    dst.copy_(buf[off : off + p.length].to(dst.dtype))
            off += p.length


__all__ = ["Piece", "SlotPieces", "flat"]
