"""Expert weights of a list of `EPMoE` layers in logical order: `export_logical` /
`import_logical` (what a rollout engine's weight sync or a framework checkpoint wants;
`routepack.torch.checkpoint` has the per-layer parts)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.torch import _args
from routepack.torch.checkpoint import export_layer
from routepack.torch.moe import check_layers


def export_logical(layers: Sequence[Any]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``[(w1 [E, H, 2I], w2 [E, I, H])]`` per `EPMoE` layer, in order: the experts in logical
    order, equal bit for bit to the unsharded model's (`export_layer`). Collective over the
    EP group."""
    return [export_layer(mod) for mod in check_layers(layers)]


def import_logical(layers: Sequence[Any], weights: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Fills every `EPMoE` layer's slots from its logical ``(w1 [E, H, 2I], w2 [E, I, H])``
    (the inverse of `export_logical`; local, no collective)."""
    layers = check_layers(layers)
    if not isinstance(weights, (list, tuple)):
        raise RoutepackTypeError(f"weights: expected a list of (w1, w2) pairs, got {_args.short(weights)}")
    if len(weights) != len(layers):
        raise RoutepackError(f"weights: {len(weights)} (w1, w2) pairs for {len(layers)} layers")
    for mod, pair in zip(layers, weights):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RoutepackTypeError(f"weights[{mod.layer}]: expected a (w1, w2) pair, got {_args.short(pair)}")
        mod.import_logical(*pair)
