"""Which plan layer each of a Megatron model's routing layers is (numpy only).

The model's layer pattern is read by `routepack.routes.MoELayers` (the one home of that rule:
Megatron's ``num_layers`` / ``moe_layer_freq`` / ``mtp_num_layers``): plan layer ``i`` is the
``i``-th MoE layer of the decoder, whatever dense layers lie between (DeepSeek-V3's first
three layers), Megatron ``layer_number`` ``rows[i] + 1``. Multi-token-prediction layers come
after the decoder (``MultiTokenPredictionLayer``: ``layer_number`` ``num_layers + j + 1``) and
route when the decoder's last layer does. No rollout engine records routes for MTP layers and
verl replays none, so a plan has no rows for them: they are left out of the plan (the runner's
``unplanned`` names them with `MoELayers.unplanned`'s reason) and route live at their static
placement, as the stock model does.
"""

from __future__ import annotations

from typing import Any, Dict, List, Union

from routepack.errors import RoutepackError
from routepack.routes.layers import MoELayers


def plan_layers(config: Any, layer_numbers: List[int]) -> Dict[int, Union[int, str]]:
    """For each given Megatron ``layer_number`` of a routing layer: its plan layer (an int), or
    the reason it is left out of the plan (a str starting "an MTP layer"). A number the config
    says is dense is refused (the model and its config disagree)."""
    layers = MoELayers.from_config(config)
    unplanned = layers.unplanned()
    out: Dict[int, Union[int, str]] = {}
    for num in layer_numbers:
        if num in unplanned:
            out[num] = f"an MTP layer, {unplanned[num]}"
            continue
        try:
            out[num] = layers.plan_layer(num)
        except RoutepackError as e:
            raise RoutepackError(
                f"model: layer {num} routes, but config.moe_layer_freq={getattr(config, 'moe_layer_freq', 1)!r} "
                f"does not make it an MoE layer ({e}); build the model from the config it was planned for"
            ) from None
    return out


__all__ = ["plan_layers"]
