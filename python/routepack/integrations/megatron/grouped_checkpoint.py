"""Logical checkpoints of Megatron's ``GroupedMLP`` under a plan (torch, Megatron).

``GroupedMLP`` holds its ``n`` local experts in two parameters, ``weight1`` ``[H, n * 2F]``
(local expert ``i`` is ``weight1.view(n, H, -1)[i]``, ``linear_fc1.weight`` transposed) and
``weight2`` ``[n * F, H]`` (``weight2.view(n, -1, H)[i]``). Its own ``sharded_state_dict``
saves each as one tensor of the rank's contiguous experts ``ep_rank * n ..``: under a plan
the slots hold other experts, some twice, some none. `grouped_sharded_state_dict` gives each
parameter a factory whose ``build`` makes, for every local expert that is its logical
expert's first local copy, the shards Megatron's ``GroupedMLP`` factory makes for an expert
(key ``{prefix}experts.linear_fc1.weight``, the expert transposed to ``SequentialMLP``'s
layout, GLU halves ``w`` / ``v`` along the output axis, or one key an expert with
``singleton_local_shards``), placed at the logical expert ``e`` of ``E``; so its checkpoint is
the stock ``GroupedMLP``'s (and ``SequentialMLP``'s, for weights) whatever the placement.
``merge`` puts the loaded experts back into a tensor of the parameter's shape: second local
copies take their first copy's, empty slots and replica buffers keep their weights (and get
zero optimizer state). Megatron's optimizers call the same ``build`` with their state tensors
(``make_sharded_optimizer_tensor``), so optimizer state is keyed by logical expert too.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from routepack.integrations.megatron.checkpoint_slots import LoadedCopies, Slot, refuse_flattened


def grouped_sharded_state_dict(
    experts: Any,
    slots: List[Slot],
    E: int,
    prefix: str,
    sharded_offsets: tuple,
    singleton: bool,
    edp: Tuple[int, int],
    copies: LoadedCopies,
) -> Dict[str, Any]:
    """The entries of a ``GroupedMLP``'s ``sharded_state_dict`` in logical experts (module
    docstring). ``slots``: each local expert's logical expert and role; ``edp``: (this rank's
    expert-data-parallel rank, that group's size)."""
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint  # type: ignore[import-untyped]

    glu = bool(experts.config.gated_linear_unit)
    out: Dict[str, Any] = {}
    for name, mod, is_glu in (("weight1", "linear_fc1", glu), ("weight2", "linear_fc2", False)):
        param = getattr(experts, name)
        key = f"{prefix}experts.{mod}.weight"
        out[f"{prefix}{name}"] = _Factory(
            experts, name, param, key, slots, E, sharded_offsets, singleton, edp, is_glu
        )()
    prepend = len(sharded_offsets)
    for s in slots:  # Megatron's fake extra states, kept for checkpoints shared with SequentialMLP
        if s.role != "first":
            continue
        for mod in ("linear_fc1", "linear_fc2"):
            if singleton:
                obj_key, offsets = f"{prefix}experts.{s.expert}.{mod}._extra_state", sharded_offsets
            else:
                obj_key, offsets = f"{prefix}experts.{mod}._extra_state", (*sharded_offsets, (prepend, s.expert, E))
            out[f"{prefix}expert{s.expert}.{mod}._extra_state"] = make_sharded_object_for_checkpoint(
                None, obj_key, offsets, (0, 0, edp[0] + edp[1] * s.rank)
            )
    return out


class _Factory:
    """The ``ShardedTensorFactory`` of one ``GroupedMLP`` parameter (module docstring)."""

    def __init__(
        self,
        experts: Any,
        name: str,
        param: torch.nn.Parameter,
        key: str,
        slots: List[Slot],
        E: int,
        sharded_offsets: tuple,
        singleton: bool,
        edp: Tuple[int, int],
        glu: bool,
    ) -> None:
        self.n, self.hidden = experts.num_local_experts, experts.config.hidden_size
        self.name, self.param, self.key, self.slots, self.E = name, param, key, slots, E
        self.offsets, self.singleton, self.edp, self.glu = sharded_offsets, singleton, edp, glu
        self.prefix = key[: key.index("experts.") + len("experts.")]
        self.first = [i for i, s in enumerate(slots) if s.role == "first"]

    def __call__(self) -> Any:
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # type: ignore[import-untyped]

        return ShardedTensorFactory(self.key, self.param, self.build, self.merge, (0, 0, self.edp[0]))

    def expert_view(self, data: torch.Tensor, i: int) -> torch.Tensor:
        """Local expert ``i`` of ``data`` (the parameter's shape) in ``SequentialMLP``'s layout
        (``[2F, H]`` / ``[H, F]``): a view."""
        per = data.view(self.n, self.hidden, -1) if self.name == "weight1" else data.view(self.n, -1, self.hidden)
        return per[i].transpose(0, 1)

    def build(self, key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor  # type: ignore[import-untyped]

        refuse_flattened(key, flattened_range)
        prepend = len(self.offsets)
        shards = []
        for i in self.first:
            s = self.slots[i]
            rid = (*replica_id[:2], self.edp[0] + self.edp[1] * s.rank)
            t = self.expert_view(data, i)
            parts = torch.chunk(t, 2, 0) if self.glu else (t,)
            built = []
            for half, part in enumerate(parts):
                if self.singleton:
                    k = key.replace(self.prefix, f"{self.prefix}{s.expert}.", 1) + (
                        ("_w", "_v")[half] if self.glu else ""
                    )
                    built.append(
                        ShardedTensor.from_rank_offsets(
                            k, part.contiguous(), *self.offsets, replica_id=rid, prepend_axis_num=prepend
                        )
                    )
                else:
                    glu_axis = ((prepend + 1, half, 2),) if self.glu else ()
                    built.append(
                        ShardedTensor.from_rank_offsets(
                            key,
                            part.unsqueeze(0).contiguous(),
                            *self.offsets,
                            (prepend, s.expert, self.E),
                            *glu_axis,
                            replica_id=rid,
                            prepend_axis_num=prepend,
                        )
                    )
            shards.append(built)
        return {"experts": shards, "data": LocalNonpersistentObject(data)}

    @torch.no_grad()
    def merge(self, loaded: Any) -> torch.Tensor:
        data = loaded["data"]
        out = data.detach().clone() if data is self.param else torch.zeros_like(data)
        got: Dict[int, int] = {}
        for i, parts in zip(self.first, loaded["experts"]):
            whole = (
                torch.cat([p.reshape(p.shape[-2:]) for p in parts], 0)
                if self.glu
                else parts[0].reshape(parts[0].shape[-2:])
            )
            self.expert_view(out, i).copy_(whole)
            got[self.slots[i].expert] = i
        for i, s in enumerate(self.slots):
            if s.role == "copy":
                self.expert_view(out, i).copy_(self.expert_view(out, got[s.expert]))
        return out


__all__ = ["grouped_sharded_state_dict"]
