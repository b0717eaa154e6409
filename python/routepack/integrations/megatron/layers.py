"""Which layers of a Megatron model a plan keys, and how (numpy only).

A plan holds one layer per MoE layer of the decoder, in layer order: plan layer ``i`` is the
``i``-th MoE layer, whatever dense layers lie between (DeepSeek-V3's first three layers,
``moe_layer_freq``). Megatron numbers its ``TransformerLayer`` modules from 1 over the whole
model (``layer_number``, global across pipeline stages); a model's MoE layers are those its
``TransformerConfig.moe_layer_freq`` marks (an int ``f``: layer ``i`` (0-based) when ``i % f
== 0``; a 0/1 list, one entry per layer: ``get_gpt_decoder_layer_specs``' rule). Its
multi-token-prediction layers (``mtp_num_layers``) come after the decoder: MTP layer ``j``'s
``TransformerLayer`` is number ``num_layers + j + 1`` (``MultiTokenPredictionLayer``), with the
spec of the decoder's last layer, so it routes when that layer does. No rollout engine records
routes for MTP layers and verl replays none, so a plan has no rows for them: they are left out
of the plan (`unplanned` names them with the reason) and route live at their static placement,
as the stock model does.
"""

from __future__ import annotations

from typing import Any, Dict, List

from routepack.errors import RoutepackError

#: why an MTP layer's MoE layer is left out of the plan
MTP_UNPLANNED = (
    "an MTP layer, which routes live: rollout engines record routes for the decoder's layers only "
    "(vLLM and SGLang capture no MTP rows) and verl replays none, so no window says its load; it keeps "
    "its static placement and routes as the stock model's"
)


def moe_layer_numbers(config: Any) -> List[int]:
    """Megatron ``layer_number`` (1-based, global) of plan layer 0, 1, ...: the decoder's MoE
    layers in order, from ``config.num_layers`` and ``config.moe_layer_freq``."""
    n = int(config.num_layers)
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        flags = [i % freq == 0 for i in range(n)]
    else:
        flags = [bool(f) for f in freq]
        if len(flags) != n:
            raise RoutepackError(f"config.moe_layer_freq: has {len(flags)} entries for num_layers = {n}")
    return [i + 1 for i, moe in enumerate(flags) if moe]


def plan_layers(config: Any, layer_numbers: List[int]) -> Dict[int, Any]:
    """For each given Megatron ``layer_number`` of a routing layer: its plan layer (an int), or
    the reason it is left out of the plan (a str: an MTP layer). A number the config says is
    dense is refused (the model and its config disagree)."""
    index = {num: i for i, num in enumerate(moe_layer_numbers(config))}
    n = int(config.num_layers)
    out: Dict[int, Any] = {}
    for num in layer_numbers:
        if num in index:
            out[num] = index[num]
        elif num > n:
            out[num] = MTP_UNPLANNED
        else:
            raise RoutepackError(
                f"model: layer {num} routes, but config.moe_layer_freq={getattr(config, 'moe_layer_freq', 1)!r} "
                f"makes it a dense layer; build the model from the config it was planned for"
            )
    return out


__all__ = ["MTP_UNPLANNED", "moe_layer_numbers", "plan_layers"]
