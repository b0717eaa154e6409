"""Each logical expert counted once in Megatron's grad norm, whatever the placement (torch,
Megatron).

Under a plan some experts are held more than once: redundant copies (their gradients are
summed over the EP group in the step's last microbatch, so every copy holds the expert's
whole gradient), and slots that hold no expert (empty slots, replica buffers: zero gradient
once the step's microbatches ran). Megatron's grad norm (``get_main_grads_for_grad_norm``,
what clipping divides by) sums the squares of every parameter that is not ``shared``, so it
would count a redundant expert once per copy. Every slot but each logical expert's first copy
(its first physical slot in the placement) is therefore left out:

* ``SequentialMLP`` / ``TEGroupedMLP``: a slot is parameters of its own; they get
  ``shared = True``, with the tensors the optimizer steps for them (fp32 master,
  ``DistributedOptimizer`` shard): Megatron's own ``param_is_not_shared`` skips them.
* ``GroupedMLP``: one parameter (``weight1``, ``weight2``) holds every local slot, so no
  attribute can leave a slot out. The optimizer part that steps it gets its
  ``get_main_grads_for_grad_norm`` wrapped (an attribute of that optimizer object): the
  gradient it lists for the parameter (the parameter's own, its fp32 master's, or this rank's
  ``DistributedOptimizer`` shard of it) is replaced by its pieces that lie in first copies.
  The squares summed are then exactly the stock model's; clipping still scales every slot.

The set of first copies is read from the layer when the norm is taken, so it follows every
migration.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from routepack.integrations.megatron.experts import flat
from routepack.integrations.megatron.slot_state import _owner_of, flat_optimizers, optimizer_tensors

#: attribute of an optimizer part whose norm routepack filters: the layers it filters for
_FILTERED = "_routepack_grouped_layers"


def primary_slots(layer: Any, ep_rank: int) -> np.ndarray:
    """bool ``[num_local_experts]``: which local experts of ``layer`` (a `PlanMoELayer`) are
    their logical expert's first copy in the placement (replica buffers and empty slots never)."""
    row, spr = layer.phy2log, layer.slots_per_rank
    first = np.full(layer.num_logical, -1, dtype=np.int64)
    for p in range(row.size - 1, -1, -1):
        if row[p] >= 0:
            first[row[p]] = p
    local = layer.slot_experts()
    return np.array(
        [s < spr and e >= 0 and first[e] == ep_rank * spr + s for s, e in enumerate(local.tolist())], dtype=bool
    )


def count_each_expert_once(layers: List[Any], optimizer: Any, ep_rank: int) -> None:
    """Marks (per-slot parameters) or filters (``GroupedMLP``) every slot of ``layers`` that is
    not its expert's first copy out of ``optimizer``'s grad norm (module docstring)."""
    grouped = []
    for layer in layers:
        layer.primary = primary_slots(layer, ep_rank)
        if layer.pieces.kind == "GroupedMLP":
            grouped.append(layer)
            continue
        for s, slot in enumerate(layer.pieces.slots):
            for piece in slot:
                for t in [piece.param] + optimizer_tensors(optimizer, piece.param):
                    setattr(t, "shared", not bool(layer.primary[s]))
    if grouped and optimizer is not None:
        for part in flat_optimizers(optimizer):
            mine = [l for l in grouped if any(_owner_of([part], p)[0] != "none" for p in l.pieces.params())]
            if mine:
                _filter_norm(part, mine)


def _filter_norm(part: Any, layers: List[Any]) -> None:
    """Wraps ``part.get_main_grads_for_grad_norm`` once; later calls update its layers."""
    if getattr(part, _FILTERED, None) is not None:
        setattr(part, _FILTERED, layers)
        return
    setattr(part, _FILTERED, layers)
    original: Callable[[], List[torch.Tensor]] = part.get_main_grads_for_grad_norm

    def get_main_grads_for_grad_norm() -> List[torch.Tensor]:
        grads = original()
        pieces: Dict[int, List[torch.Tensor]] = {}
        for layer in getattr(part, _FILTERED):
            for param in layer.pieces.params():
                grad, lo, hi = _norm_grad(part, param)
                if grad is not None:
                    pieces[id(grad)] = _first_copy_pieces(layer, param, flat(grad), lo, hi)
        return [t for g in grads for t in pieces.get(id(g), [g])]

    part.get_main_grads_for_grad_norm = get_main_grads_for_grad_norm


def _norm_grad(part: Any, param: torch.nn.Parameter) -> Tuple[Any, int, int]:
    """(the gradient ``part`` lists for ``param`` in its norm, the range ``[lo, hi)`` of
    ``param``'s elements it holds); (None, 0, 0) where this rank holds none."""
    kind, opt, key = _owner_of([part], param)
    if kind == "keyed":
        return key.grad, 0, param.numel()
    if kind == "dist":
        try:
            gi, go = opt.model_param_group_index_map[param]
        except KeyError:
            return None, 0, 0
        rng = opt._get_model_param_range_map(param)["param"]
        return opt.optimizer.param_groups[gi]["params"][go].grad, rng.start, rng.end
    return None, 0, 0


def _first_copy_pieces(layer: Any, param: torch.nn.Parameter, grad: torch.Tensor, lo: int, hi: int) -> List[Any]:
    """The views of ``grad`` (``param``'s elements ``[lo, hi)``) that lie in first copies."""
    out = []
    for s, slot in enumerate(layer.pieces.slots):
        if not layer.primary[s]:
            continue
        for piece in slot:
            if piece.param is param:
                a, b = max(piece.start, lo), min(piece.start + piece.length, hi)
                if b > a:
                    out.append(grad[a - lo : b - lo])
    return out


__all__ = ["count_each_expert_once", "primary_slots"]
