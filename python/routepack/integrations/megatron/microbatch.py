"""`MicrobatchState`: what `MegatronRunner` keeps about the microbatches of a step (torch): the
current one, the intra-batch replica copies each cell received in its forward and keeps until
its backward, and how far each MoE layer's backward got. The runner holds one and starts it
afresh at every ``begin_window``; the layer positions ``i`` are those of ``runner.layers``.

Why the copies are kept per (microbatch, layer): under a pipeline schedule several
microbatches are in flight, and a later microbatch's forward refills a layer's replica buffers
before an earlier one's backward; that backward puts its own copies back first (`load`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

import torch


class MicrobatchState:
    """The runner's per-step microbatch state over ``num_layers`` MoE layers (this rank's)."""

    def __init__(self, num_layers: int, restores: int = 0) -> None:
        #: this step's current microbatch (execution order); None outside planned microbatches
        self.micro: Optional[int] = None
        #: (micro, moe layer) cells whose copies arrived since the current microbatch started
        #: (a recomputed forward finds them kept)
        self.filled: Set[Tuple[int, int]] = set()
        #: (micro, layer position) → the copies this rank received for that cell (flat, buffer
        #: order), from the forward until the backward
        self.copies: Dict[Tuple[int, int], List[torch.Tensor]] = {}
        #: layer position → the microbatch whose copies that layer's replica buffers hold now
        self.loaded: Dict[int, int] = {}
        #: per layer position: backwards run in the step so far (0 after the step's last)
        self.backwards: List[int] = [0] * num_layers
        #: per layer position: planned steps completed since the last ``finish_step``
        self.completed: List[int] = [0] * num_layers
        #: how often a backward put its copies back (tests read it)
        self.restores = restores
        #: with the runner's ``recording``: (micro, moe layer) → the tokens each local Megatron
        #: expert received in the last forward of that cell (a host copy per layer: tests)
        self.received: Dict[Tuple[int, int], List[int]] = {}

    def start(self, micro: int) -> None:
        """``micro`` becomes current; no cell of it has its copies yet."""
        self.micro = micro
        self.filled = set()

    def leave(self) -> None:
        """Outside planned microbatches: no current one, no copies kept."""
        self.micro = None
        self.copies, self.loaded = {}, {}

    def keep(self, micro: int, moe_index: int, i: int, receive: Callable[[], List[torch.Tensor]]) -> None:
        """The copies of cell (``micro``, layer position ``i``), received by ``receive`` the
        first time the cell's forward runs in this microbatch (``moe_index``: the layer's plan
        index), kept until its backward; the buffers no longer hold what they held."""
        if (micro, moe_index) not in self.filled:
            self.filled.add((micro, moe_index))
            self.copies[(micro, i)] = receive()
            self.loaded.pop(i, None)

    def load(self, i: int, micro: int, write: Callable[[List[torch.Tensor]], None]) -> bool:
        """Writes (``write``) ``micro``'s kept copies into the buffers of layer position ``i``
        unless they hold them now; True when it wrote."""
        copies = self.copies.get((micro, i))
        if copies is None or self.loaded.get(i) == micro:
            return False
        write(copies)
        self.loaded[i] = micro
        return True

    def drop(self, micro: int, i: int) -> None:
        """The backward of cell (``micro``, ``i``) has run: its copies are no longer needed."""
        self.copies.pop((micro, i), None)

    def count_backward(self, i: int, num_micro: int) -> bool:
        """One more backward of layer position ``i``; True when it was the step's last (of
        ``num_micro``), which completes the layer's step."""
        n = self.backwards[i] + 1
        self.backwards[i] = 0 if n == num_micro else n
        if n == num_micro:
            self.completed[i] += 1
        return n == num_micro

    def part_way(self, moe_indices: List[int]) -> Dict[int, int]:
        """moe layer → backwards run, for the layers whose step is part-way (``moe_indices``:
        the plan index of each layer position)."""
        return {l: n for l, n in zip(moe_indices, self.backwards) if n}

    def take_idle(self, moe_indices: List[int]) -> List[int]:
        """The moe layers that completed no planned step since the last call (which restarts
        the count)."""
        idle = [l for l, n in zip(moe_indices, self.completed) if n == 0]
        self.completed = [0] * len(self.completed)
        return idle


__all__ = ["MicrobatchState"]
