"""A `Window` from verl's routing replay (`window_from_verl`): the layout verl keeps in
``batch["routed_experts"]`` (see `routepack.integrations.verl`). numpy only; torch tensors
are read without importing torch."""

from __future__ import annotations

from typing import Any

from routepack.errors import RoutepackError
from routepack.integrations.shared.arrays import as_numpy
from routepack.routes.verl import DEFAULT_MODE, MODES, verl_summary
from routepack.window import Window


def window_from_verl(
    batch: Any = None,
    *,
    num_experts: int,
    routed_experts: Any = None,
    attention_mask: Any = None,
    response_mask: Any = None,
    mode: str = DEFAULT_MODE,
    moe_layers: Any = None,
) -> Window:
    """A `Window` from verl's routing replay.

    Args:
        batch:          a verl ``DataProto`` (its ``.batch``), a ``TensorDict`` or a dict
                        holding ``routed_experts``, ``attention_mask`` and (optionally)
                        ``response_mask``; or None, passing the arrays by name.
        num_experts:    E, logical experts per MoE layer; every counted id lies in [0, E),
                        and E is at least k.
        routed_experts: uint8 | int16 | int32 | int64 ``[B, T, L, k]`` (numpy or torch), or
                        the v1 trainer's jagged nested ``[B, j, L, k]`` (no mask then).
        attention_mask: bool or 0/1 integers ``[B, T]``; sample b's length (int64) is its sum.
        response_mask:  0/1 ``[B, R]`` (verl's, R = response length): in R3 mode, a sample
                        with no response token keeps its final row. Without it every sample
                        is taken to have a response.
        mode:           ``"R3"`` (default): the final real row of each sample with a response
                        is not counted (verl replays it with the trainer's own router, so its
                        experts are unknown); ``"R2"``: every real row is counted.
        moe_layers:     the rows of the layer axis that are MoE layers (``L =
                        num_hidden_layers`` rows, a dense layer's zero:
                        ``routepack.routes.MoELayers.from_config(hf_config).moe_layers(L)``);
                        None: every row.

    Rows at real positions whose counted layers are all zero with k >= 2 (a token cannot pick
    expert 0 k times: verl's placeholder for a position the recorder did not reach) are not
    counted either; lengths still include them, as the trainer runs them. Padding is ignored.
    Expert demand is ``[B, L', E]``, ``top_k`` = k; the counting is
    `routepack.routes.verl_summary`'s.
    """
    if batch is not None:
        if routed_experts is not None or attention_mask is not None:
            raise RoutepackError("batch: pass either batch or routed_experts/attention_mask, not both")
        fields = getattr(batch, "batch", batch)
        routed_experts = _field(fields, "routed_experts", True)
        attention_mask = _field(fields, "attention_mask", not getattr(routed_experts, "is_nested", False))
        response_mask = _field(fields, "response_mask", False)
        if getattr(routed_experts, "is_nested", False):
            attention_mask = None
    if routed_experts is None or (attention_mask is None and not getattr(routed_experts, "is_nested", False)):
        raise RoutepackError("routed_experts: both routed_experts and attention_mask are needed")
    if batch is not None and not getattr(routed_experts, "is_nested", False):
        shape: Any = getattr(routed_experts, "shape", ())
        if len(shape) and shape[0] == 0:
            raise RoutepackError(
                f"batch: holds no samples (routed_experts has shape {tuple(shape)}); a window needs one"
            )
    return Window.from_summary(
        verl_summary(
            as_numpy(routed_experts, "routed_experts")
            if not getattr(routed_experts, "is_nested", False)
            else routed_experts,
            num_experts,
            None if attention_mask is None else as_numpy(attention_mask, "attention_mask"),
            response_mask
            if getattr(response_mask, "is_nested", False) or response_mask is None
            else as_numpy(response_mask, "response_mask"),
            mode,
            moe_layers,
        )
    )


def _field(fields: Any, key: str, required: bool) -> Any:
    try:
        return fields[key]
    except (KeyError, TypeError):
        if required:
            raise RoutepackError(f"batch: has no {key!r} field") from None
        return None


__all__ = ["MODES", "window_from_verl"]
