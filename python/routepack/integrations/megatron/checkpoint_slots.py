"""What the logical checkpoints of every expert module share (torch): a local expert's
`Slot` (its logical expert and role), the first local copies' loaded tensors that the second
copies take (`LoadedCopies`), and the refusal of optimizer state by flattened range
(`refuse_flattened`). `checkpoint` (``SequentialMLP``, ``TEGroupedMLP``) and
`grouped_checkpoint` (``GroupedMLP``) build on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from routepack.errors import RoutepackError


@dataclass(frozen=True)
class Slot:
    """A local expert in a checkpoint: its logical expert (0 for a slot holding none), role
    ("first": the first local copy, saved; "copy": a later local copy; "empty": no expert or a
    replica buffer) and copy rank (0: the expert's first copy in the placement)."""

    expert: int
    role: str
    rank: int


class LoadedCopies:
    """One layer's ``sharded_state_dict`` call: the loaded tensor of each first local copy by
    (checkpoint key, logical expert), and the second copies' tensors it fills (factory merges
    run in any order)."""

    def __init__(self) -> None:
        self.loaded: Dict[Tuple[str, int], torch.Tensor] = {}
        self.waiting: Dict[Tuple[str, int], List[torch.Tensor]] = {}

    @torch.no_grad()
    def first(self, key: str, e: int, t: torch.Tensor) -> None:
        self.loaded[(key, e)] = t
        for d in self.waiting.get((key, e), []):
            d.copy_(t.reshape(d.shape))

    @torch.no_grad()
    def copy(self, key: str, e: int, d: torch.Tensor) -> None:
        self.waiting.setdefault((key, e), []).append(d)
        if (key, e) in self.loaded:
            d.copy_(self.loaded[(key, e)].reshape(d.shape))


def refuse_flattened(key: str, flattened_range: Any) -> None:
    if flattened_range is not None:
        raise RoutepackError(
            f"checkpoint: {key}: optimizer state with a flattened_range (DistributedOptimizer's default "
            "'fully_sharded_model_space' format, which Megatron 0.16 refuses for the stock model too) cannot "
            "be keyed by logical expert; pass metadata={'distrib_optim_sharding_type': 'fully_reshardable'}"
        )


__all__ = ["LoadedCopies", "Slot", "refuse_flattened"]
