"""A `Window` from verl's routing replay (`window_from_verl`): the layout verl keeps in
``batch["routed_experts"]`` (see `routepack.integrations.verl`). numpy only; torch tensors
are read without importing torch."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from routepack import _core
from routepack._checks import positive_int
from routepack._routed import check_ids, native_order, renamed
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.integrations.shared.arrays import as_numpy
from routepack.window import Window

#: verl's replay modes (``actor_rollout_ref.actor.router_replay.mode``) this reads.
MODES = ("R3", "R2")


def window_from_verl(
    batch: Any = None,
    *,
    num_experts: int,
    routed_experts: Any = None,
    attention_mask: Any = None,
    response_mask: Any = None,
    mode: str = "R3",
) -> Window:
    """A `Window` from verl's routing replay.

    Args:
        batch:          a verl ``DataProto`` (its ``.batch``), a ``TensorDict`` or a dict
                        holding ``routed_experts``, ``attention_mask`` and (optionally)
                        ``response_mask``; or None, passing the arrays by name.
        num_experts:    E, logical experts per MoE layer; every counted id lies in [0, E),
                        and E is at least k.
        routed_experts: uint8 | int16 | int32 | int64 ``[B, T, L, k]`` (numpy or torch).
        attention_mask: bool or 0/1 integers ``[B, T]``; sample b's length (int64) is its sum.
        response_mask:  0/1 ``[B, R]`` (verl's, R = response length): in R3 mode, a sample
                        with no response token keeps its final row. Without it every sample
                        is taken to have a response.
        mode:           ``"R3"`` (default): the final real row of each sample with a response
                        is not counted (verl replays it with the trainer's own router, so its
                        experts are unknown); ``"R2"``: every real row is counted.

    Rows at real positions that are all zero with k >= 2 (a token cannot pick expert 0 k
    times: verl's placeholder for a position the recorder did not reach) are not counted
    either; lengths still include them, as the trainer runs them. Padding is ignored.
    Expert demand is int32 ``[B, L, E]``, ``top_k`` = k.
    """
    num_experts = positive_int(num_experts, "num_experts")
    if mode not in MODES:
        raise RoutepackError(f"mode: expected one of {MODES}, got {mode!r}")
    if batch is not None:
        if routed_experts is not None or attention_mask is not None:
            raise RoutepackError("batch: pass either batch or routed_experts/attention_mask, not both")
        fields = getattr(batch, "batch", batch)
        routed_experts = _field(fields, "routed_experts", True)
        attention_mask = _field(fields, "attention_mask", True)
        response_mask = _field(fields, "response_mask", False)
    if routed_experts is None or attention_mask is None:
        raise RoutepackError("routed_experts: both routed_experts and attention_mask are needed")
    routed = check_ids(as_numpy(routed_experts, "routed_experts"), "routed_experts", 4)
    if routed.shape[0] == 0:
        where = "batch" if batch is not None else "routed_experts"
        raise RoutepackError(f"{where}: holds no samples (routed_experts has shape {routed.shape}); a window needs one")
    if routed.shape[3] > num_experts:
        raise RoutepackError(
            f"num_experts: {num_experts} is fewer than the {routed.shape[3]} experts each token picks "
            f"(routed_experts' last dimension, k)"
        )
    keep = _real_positions(as_numpy(attention_mask, "attention_mask"), routed.shape[:2])
    lens = keep.sum(axis=1).astype(np.int64)
    counted = keep.copy()
    if mode == "R3":
        has_response = np.ones(len(lens), dtype=bool)
        if response_mask is not None:
            has_response = _response_rows(as_numpy(response_mask, "response_mask"), len(lens))
        last = routed.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=1)
        rows = np.flatnonzero(has_response)
        counted[rows, last[rows]] = False
    if routed.shape[3] >= 2:
        counted &= (routed != 0).any(axis=(2, 3))
    return _window(routed, counted, lens, num_experts)


def _field(fields: Any, key: str, required: bool) -> Any:
    try:
        return fields[key]
    except (KeyError, TypeError):
        if required:
            raise RoutepackError(f"batch: has no {key!r} field") from None
        return None


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


def _response_rows(mask: np.ndarray, batch: int) -> np.ndarray:
    if mask.ndim != 2 or mask.shape[0] != batch:
        raise RoutepackError(f"response_mask: expected [B={batch}, R], got shape {mask.shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"response_mask: expected bool or integer, got dtype {mask.dtype}")
    return np.asarray(mask.astype(bool).any(axis=1), dtype=bool)


def _window(routed: np.ndarray, counted: np.ndarray, lens: np.ndarray, num_experts: int) -> Window:
    """Counts the ``counted`` positions in the core (samples without one count nothing) and
    sets the lengths; a bad id is named by its position in ``routed_experts``."""
    b_idx, t_idx = np.nonzero(counted)
    per = np.bincount(b_idx, minlength=len(lens))
    shape = (len(lens), routed.shape[2], num_experts)
    counts = np.zeros(shape, dtype=np.uint8)
    some = np.flatnonzero(per)
    if some.size:
        flat = np.ascontiguousarray(native_order(routed[b_idx, t_idx]))
        cu = np.concatenate([[0], np.cumsum(per[some])]).astype(np.int64)
        try:
            _, sub = _core.expert_tokens_from_routed(flat, cu, num_experts)
        except RoutepackError as e:

            def locate(t: int, s: int) -> Tuple[str, str]:
                b, pos = int(b_idx[t]), int(t_idx[t])
                return f"routed_experts[{b}, {pos}]", f"position {pos} (sample {b})"

            raise renamed(e, "routed_experts", locate) from None
        # the counted samples' narrow dtype holds the whole window's (the rest count nothing)
        counts = np.zeros(shape, dtype=sub.dtype)
        counts[some] = sub
    return Window(lens, counts, top_k=int(routed.shape[3]))


__all__ = ["MODES", "window_from_verl"]
