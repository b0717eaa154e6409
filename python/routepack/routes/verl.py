"""verl's routing replay: ``batch["routed_experts"]``.

How verl 0.9.1 builds it (``verl/experimental/agent_loop/agent_loop.py``):

* from the engine's per-sample routes (vLLM's ``[n - 1, L, k]``, SGLang's decoded
  ``[n - 1, L, k]``), cast to int16, ``L = num_hidden_layers`` (dense layers' rows zero);
* the legacy trainer (``_agent_loop_postprocess``): ``[1, P + R, L, k]`` zeros, prompts
  left-padded to ``P``, responses right-padded to ``R``, the routes written from the first real
  prompt token (``start_pos = P - len(prompt_ids)``), stacked to ``[B, P + R, L, k]`` with
  ``attention_mask [B, P + R]``;
* the v1 trainer (``AgentLoopOutput.as_dict``): per sample ``[prompt + response, L, k]``
  zeros with the routes in the first rows, kept unpadded (a jagged nested tensor in the
  batch);
* either way the final response token has no route (its row is zero filler) and multi-turn
  loops stop recording at the last generation (trailing zero rows); under R3 the replay mask
  (``verl/utils/megatron/router_replay_utils.py``, ``build_r3_replay_mask``) leaves the final
  row to the trainer's own router.

`verl_summary` counts what verl replays: the real rows, minus the final one of each sample
with a response (R3), minus rows with no route (every counted MoE row zero, k >= 2: a router
never picks expert 0 k times); lengths count every real token.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from routepack._checks import allocating, positive_int
from routepack.routes.ids import check_ids, host_array, native_order
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.routes.layers import check_moe_layers
from routepack.routes.summary import RouteSummary, summarize_flat

#: verl's replay modes (``actor_rollout_ref.actor.router_replay.mode``) this reads.
MODES = ("R3", "R2")
#: `verl_summary`'s default: routes the rollout recorded (verl's R3).
DEFAULT_MODE = "R3"


def verl_summary(
    routed_experts: Any,
    num_experts: int,
    attention_mask: Any = None,
    response_mask: Any = None,
    mode: str = DEFAULT_MODE,
    moe_layers: Any = None,
) -> RouteSummary:
    """The `RouteSummary` of a verl batch.

    Args:
        routed_experts: uint8 | int16 | int32 | int64 ``[B, T, L, k]`` (numpy or torch; the
                        legacy trainer's padded layout), or a jagged nested torch tensor of
                        per-sample ``[n_b, L, k]`` (the v1 trainer's).
        num_experts:    E; every counted id lies in [0, E), and E is at least k.
        attention_mask: bool or 0/1 ``[B, T]``, 1 for real tokens (padded layout only; a
                        sample's length is its sum).
        response_mask:  0/1 ``[B, R]`` (or nested ``[r_b]``): in R3 mode, a sample with no
                        response token keeps its final row. Without it every sample is taken
                        to have a response.
        mode:           ``"R3"`` (default): each sample's final real row is not counted;
                        ``"R2"`` (routes the trainer recorded): every real row is counted.
        moe_layers:     rows of the layer axis to count (`MoELayers.moe_layers`); None:
                        every row.

    A bad id is named by its position in ``routed_experts`` (``routed_experts[b, t]``).
    """
    num_experts = positive_int(num_experts, "num_experts")
    if mode not in MODES:
        raise RoutepackError(f"mode: expected one of {MODES}, got {mode!r}")
    if getattr(routed_experts, "is_nested", False):
        if attention_mask is not None:
            raise RoutepackError("attention_mask: a nested routed_experts holds real tokens only; pass no mask")
        routed, keep = _jagged(routed_experts)
    else:
        if attention_mask is None:
            raise RoutepackError("attention_mask: needed with a padded [B, T, L, k] routed_experts")
        routed = check_ids(host_array(routed_experts, "routed_experts"), "routed_experts", 4)
        if routed.shape[0] == 0:
            raise RoutepackError(f"routed_experts: holds no samples (shape {routed.shape}); a window needs one")
        keep = _real_positions(host_array(attention_mask, "attention_mask"), routed.shape[:2])
    if routed.shape[3] > num_experts:
        raise RoutepackError(
            f"num_experts: {num_experts} is fewer than the {routed.shape[3]} experts each token picks "
            "(routed_experts' last dimension, k)"
        )
    rows = check_moe_layers(moe_layers, int(routed.shape[2]))
    lens = keep.sum(axis=1).astype(np.int64)
    counted = keep.copy()
    if mode == "R3":
        has_response = np.ones(len(lens), dtype=bool)
        if response_mask is not None:
            has_response = _response_rows(response_mask, len(lens))
        last = routed.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=1)
        hit = np.flatnonzero(has_response)
        counted[hit, last[hit]] = False
    if routed.shape[3] >= 2:
        moe = routed if rows is None else routed[:, :, rows]
        with allocating("routed_experts", "a mask of positions with a route", counted.size):
            counted &= (moe != 0).any(axis=(2, 3))
    b_idx, t_idx = np.nonzero(counted)
    with allocating("routed_experts", "the counted positions' ids", int(b_idx.size) * routed[0, 0].nbytes):
        flat = np.ascontiguousarray(native_order(routed[b_idx, t_idx]))
    recorded = np.bincount(b_idx, minlength=len(lens)).astype(np.int64)

    def locate(t: int, b: int) -> Tuple[str, str]:
        pos = int(t_idx[t])
        return f"routed_experts[{b}, {pos}]", f"position {pos} (sample {b})"

    return summarize_flat(flat, recorded, lens, num_experts, rows, locate)


def _jagged(routes: Any) -> Tuple[np.ndarray, np.ndarray]:
    """A nested ``[B, j, L, k]`` tensor as the padded layout: ``[B, max n, L, k]`` (zeros
    after each sample's rows) and its real-token mask."""
    values = check_ids(host_array(routes.values(), "routed_experts"), "routed_experts.values()", 3)
    offsets = host_array(routes.offsets(), "routed_experts.offsets()").astype(np.int64)
    lens = np.diff(offsets)
    if lens.size == 0 or (lens < 1).any():
        raise RoutepackError(f"routed_experts: every sample needs a token, got lengths {lens.tolist()}")
    b, width = int(lens.size), int(lens.max())
    with allocating("routed_experts", "the padded routes", b * width * values[0].nbytes):
        padded = np.zeros((b, width) + values.shape[1:], dtype=values.dtype)
        keep = np.arange(width)[None, :] < lens[:, None]
        padded[keep] = values
    return padded, keep


def _real_positions(mask: np.ndarray, shape: tuple) -> np.ndarray:
    """bool ``[B, T]`` of verl's attention mask, checked against ``routed_experts``' [B, T]."""
    if mask.shape != tuple(shape):
        raise RoutepackError(f"attention_mask: shape {mask.shape} does not match routed_experts' [B, T] = {shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"attention_mask: expected bool or integer, got dtype {mask.dtype}")
    if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
        raise RoutepackError("attention_mask: entries must be 0 or 1")
    keep = mask.astype(bool)
    empty = np.flatnonzero(~keep.any(axis=1))
    if empty.size:
        raise RoutepackError(f"attention_mask: sample {empty[0]} has no real tokens")
    return keep


def _response_rows(response_mask: Any, batch: int) -> np.ndarray:
    """bool ``[B]``: which samples have a response token."""
    if getattr(response_mask, "is_nested", False):
        values = host_array(response_mask.values(), "response_mask")
        offsets = host_array(response_mask.offsets(), "response_mask").astype(np.int64)
        if offsets.size != batch + 1:
            raise RoutepackError(f"response_mask: {offsets.size - 1} samples, routed_experts has {batch}")
        return np.array([bool(values[a:b].any()) for a, b in zip(offsets[:-1], offsets[1:])], dtype=bool)
    mask = host_array(response_mask, "response_mask")
    if mask.ndim != 2 or mask.shape[0] != batch:
        raise RoutepackError(f"response_mask: expected [B={batch}, R], got shape {mask.shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"response_mask: expected bool or integer, got dtype {mask.dtype}")
    return np.asarray(mask.astype(bool).any(axis=1), dtype=bool)


__all__ = ["DEFAULT_MODE", "MODES", "verl_summary"]
