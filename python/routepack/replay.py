"""Adapters from the routing-replay layouts trainers hold to `Window`.

* verl: ``batch["routed_experts"]`` ``[B, T, L, k]`` zero-padded, with ``attention_mask [B, T]``
  telling real tokens (uint8 ids when E <= 256).
* slime: per sample ``rollout_routed_experts`` ``[T_i, L, k]`` int32, recorded for
  ``tokens - 1`` positions (SGLang does not route the last generated token).
* vLLM / flat: ``[T, L, k]`` plus ``cu_seqlens`` → `Window.from_routed_experts` directly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from routepack._checks import positive_int
from routepack.window import ROUTED_DTYPES, Window


def _check_ids(arr: np.ndarray, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.type not in ROUTED_DTYPES:
        raise TypeError(f"{name}: dtype {arr.dtype} is not one of uint8, int16, int32, int64")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    return arr


def from_verl(routed_experts: np.ndarray, attention_mask: np.ndarray, num_experts: int) -> Window:
    """verl's padded layout → `Window`.

    Args:
        routed_experts: ``[B, T, L, k]`` top-k ids per position (padding positions ignored).
        attention_mask: ``[B, T]`` 1 (or True) for real tokens, 0 for padding; a sample's real
            tokens may sit anywhere in its row (left-padded prompt, right-padded response).
        num_experts: E.
    Sample b's length is its number of real tokens.
    """
    num_experts = positive_int(num_experts, "num_experts")
    routed = _check_ids(routed_experts, "routed_experts", 4)
    mask = np.asarray(attention_mask)
    if mask.ndim != 2 or mask.shape != routed.shape[:2]:
        raise ValueError(
            f"attention_mask: shape {mask.shape} does not match routed_experts' [B, T] = {routed.shape[:2]}"
        )
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise TypeError(f"attention_mask: expected bool or integer, got dtype {mask.dtype}")
    if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask: entries must be 0 or 1")
    keep = mask.astype(bool)
    lens = keep.sum(axis=1)
    empty = np.flatnonzero(lens == 0)
    if empty.size:
        raise ValueError(f"attention_mask: sample {empty[0]} has no real tokens")
    flat = routed[keep]  # [N, L, k], samples in order, tokens in order
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Window.from_routed_experts(flat, cu, num_experts)


def from_slime(per_sample: Sequence[np.ndarray], num_experts: int, add_last_token: bool = True) -> Window:
    """slime's per-sample recordings → `Window`.

    Args:
        per_sample: one ``[T_i, L, k]`` array per sample, same L, k and dtype.
        num_experts: E.
        add_last_token: slime records ``tokens - 1`` positions; with True (default) each
            sample's length is ``T_i + 1`` (the trainer runs every token), while expert demand
            counts the recorded positions.
    """
    num_experts = positive_int(num_experts, "num_experts")
    if isinstance(per_sample, np.ndarray) or len(per_sample) == 0:
        raise ValueError("per_sample: expected a non-empty list of [T_i, L, k] arrays")
    arrays = [_check_ids(a, f"per_sample[{i}]", 3) for i, a in enumerate(per_sample)]
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.shape[1:] != first.shape[1:] or a.dtype != first.dtype:
            raise ValueError(
                f"per_sample[{i}]: shape {a.shape} / dtype {a.dtype} differs from per_sample[0]'s "
                f"[T, {first.shape[1]}, {first.shape[2]}] / {first.dtype}"
            )
        if a.shape[0] == 0:
            raise ValueError(f"per_sample[{i}]: has no tokens")
    lens = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    w = Window.from_routed_experts(np.concatenate(arrays, axis=0), cu, num_experts)
    if add_last_token:
        return Window(w.seq_lens + 1, w.expert_tokens)
    return w


__all__ = ["from_verl", "from_slime"]
