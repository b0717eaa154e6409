"""What a migration moves for one layer on one rank: the state of each physical slot.

`routepack.torch.migrate`'s protocol (check, stage, verify, commit) moves slots of a layer
through a `SlotState`: the bytes of one slot's weights, gradients and optimizer state
(``pack`` / ``unpack``), a local snapshot for the rollback (``backup`` / ``restore``), and an
optional collective ``prepare`` before packing (a state sharded over other ranks, such as
Megatron's ``DistributedOptimizer``, assembles the slots it sends there). `StackedState` is
the layout of `routepack.torch.EPMoE` (tensors with one row per slot);
`routepack.integrations.megatron` has Megatron's.

`stateful_owner` finds an optimizer that has stepped and holds state for some tensors: a
migration without ``optimizer=`` must not leave such state with the old slots.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import Any, Iterable, List, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

#: optimizers seen stepping since routepack.torch was imported (a global post-step hook)
_STEPPED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _note_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPPED.add(optimizer)


register_optimizer_step_post_hook(_note_step)


def _span(t: torch.Tensor) -> tuple:
    """The bytes a (contiguous) tensor covers: (device, first, end)."""
    start = t.data_ptr()
    return (str(t.device), start, start + t.numel() * t.element_size())


def _overlaps(a: tuple, spans: List[tuple]) -> bool:
    return any(a[0] == b[0] and a[1] < b[2] and b[1] < a[2] for b in spans)


def stateful_owner(tensors: Iterable[torch.Tensor], extra: Sequence[Any] = ()) -> Optional[str]:
    """A description of an optimizer that has stepped and keeps state for one of ``tensors``
    (keyed by the tensor itself or by a view of its elements, as Megatron's sharded fp32
    main parameters are), or None. ``extra``: optimizers to check besides those seen
    stepping."""
    tensors = list(tensors)
    spans = [_span(t) for t in tensors if t.numel()]
    ids = {id(t) for t in tensors}
    for opt in list(_STEPPED) + list(extra):
        state = getattr(opt, "state", None)
        if not state:
            continue
        try:
            keys = list(state.keys())
        except Exception:  # noqa: BLE001 (a state that is no mapping: not ours to judge)
            continue
        for k in keys:
            if not isinstance(k, torch.Tensor) or not state[k]:
                continue
            if id(k) in ids or (k.numel() and _overlaps(_span(k), spans)):
                return f"{type(opt).__name__} (state keys {sorted(map(str, state[k]))})"
    return None


def pack_slot(tensors: Sequence[torch.Tensor], slot: int) -> torch.Tensor:
    """Raw bytes of slot ``slot`` of every tensor, concatenated (uint8 ``[slot_bytes]``)."""
    return torch.cat([t.detach()[slot].reshape(-1).view(torch.uint8) for t in tensors])


@torch.no_grad()
def unpack_slot(tensors: Sequence[torch.Tensor], slot: int, buf: torch.Tensor) -> None:
    off = 0
    for t in tensors:
        dst = t.detach()[slot].reshape(-1).view(torch.uint8)
        dst.copy_(buf[off : off + dst.numel()])
        off += dst.numel()


def slot_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return int(sum(t[0].numel() * t.element_size() for t in tensors))


class SlotState(ABC):
    """One layer's per-slot state on this rank (see the module docstring), an abstract base:
    `StackedState` (routepack.torch's layers) and
    `routepack.integrations.megatron.slot_state.MegatronSlotState` implement `pack` and `unpack`
    and set ``nbytes`` (bytes of one packed slot, the same on every rank of the group) and
    ``device``."""

    nbytes: int = 0
    device: Any = None

    def prepare(self, slots: List[int]) -> None:
        """Called before `pack` of ``slots`` (local slot indices, the rows this rank sends
        or copies locally, in row order) in every stage, on every rank alike."""

    @abstractmethod
    def pack(self, slot: int) -> torch.Tensor:
        """Raw bytes of slot ``slot`` (uint8 ``[nbytes]``)."""

    @abstractmethod
    def unpack(self, slot: int, buf: torch.Tensor) -> None:
        """Writes a packed slot (uint8 ``[nbytes]``) into slot ``slot``."""

    def backup(self, slot: int) -> Any:
        return self.pack(slot).clone()

    def restore(self, slot: int, saved: Any) -> None:
        self.unpack(slot, saved)


class StackedState(SlotState):
    """Tensors with one row per slot (`EPMoE`'s ``w1``, ``w2`` and their per-slot state)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.nbytes = slot_bytes(self.tensors)
        self.device = self.tensors[0].device

    def pack(self, slot: int) -> torch.Tensor:
        return pack_slot(self.tensors, slot)

    def unpack(self, slot: int, buf: torch.Tensor) -> None:
        unpack_slot(self.tensors, slot, buf)


__all__ = ["SlotState", "StackedState", "pack_slot", "slot_bytes", "stateful_owner", "unpack_slot"]
