"""Adapters from the routing-replay layouts trainers hold to `Window`.

* verl: ``batch["routed_experts"]`` ``[B, T, L, k]`` zero-padded, with ``attention_mask [B, T]``
  telling real tokens (uint8 ids when E <= 256).
* slime: per sample ``rollout_routed_experts`` ``[T_i, L, k]`` int32, recorded for
  ``tokens - 1`` positions (SGLang does not route the last generated token).
* vLLM / flat: ``[T, L, k]`` plus ``cu_seqlens`` → `Window.from_routed_experts` directly.

Every engine's own layout (vLLM, SGLang, slime, verl's legacy and v1 trainers), dense layers
(``moe_layers``) and per-sample summaries are in `routepack.routes`.

The same adapters are `Window.from_verl` and `Window.from_slime`; the layouts are flattened
in `routepack.routes.ids`.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from routepack.window import SLIME_ADD_LAST_TOKEN, Window


def from_verl(
    routed_experts: np.ndarray, attention_mask: np.ndarray, num_experts: int, moe_layers: Any = None
) -> Window:
    """verl's padded layout → `Window`.

    Args:
        routed_experts: ``[B, T, L, k]`` top-k ids per position (padding positions ignored).
        attention_mask: ``[B, T]`` 1 (or True) for real tokens, 0 for padding; a sample's real
            tokens may sit anywhere in its row (left-padded prompt, right-padded response).
        num_experts: E.
        moe_layers: the rows of the layer axis that are MoE layers (None: all;
            `routepack.routes.MoELayers`).
    Sample b's length is its number of real tokens.
    """
    return Window.from_verl(routed_experts, attention_mask, num_experts, moe_layers)


def from_slime(
    per_sample: Iterable[np.ndarray],
    num_experts: int,
    add_last_token: bool = SLIME_ADD_LAST_TOKEN,
    moe_layers: Any = None,
) -> Window:
    """slime's per-sample recordings → `Window`.

    Args:
        per_sample: one ``[T_i, L, k]`` array per sample, same L, k and dtype (a list, tuple
            or any other iterable of them).
        num_experts: E.
        add_last_token: a bool. slime records ``tokens - 1`` positions; with True (default) each
            sample's length is ``T_i + 1`` (the trainer runs every token), while expert demand
            counts the recorded positions.
        moe_layers: the rows of the layer axis that are MoE layers (None: all).
    """
    return Window.from_slime(per_sample, num_experts, add_last_token, moe_layers)


__all__ = ["from_verl", "from_slime"]
