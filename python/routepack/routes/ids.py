"""Expert-id arrays as every route layout holds them: the id dtypes, their checks, the
layouts flattened to ``(routed [T, L, k], cu_seqlens [S+1])`` (what
`Window.from_routed_experts` counts), and the way back from the flattened token a counting
error names to the position in the caller's layout. Builds on numpy, errors and `_checks`
only (nothing in `routepack.routes` imports `window`), so `window` and the engine modules both
build on it.

* verl: ``batch["routed_experts"]`` ``[B, T, L, k]`` zero-padded, with ``attention_mask [B, T]``
  telling real tokens (uint8 ids when E <= 256).
* slime: per sample ``rollout_routed_experts`` ``[T_i, L, k]`` int32, recorded for
  ``tokens - 1`` positions (SGLang does not route the last generated token).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Tuple

import numpy as np

from routepack._checks import allocating, sequence
from routepack.errors import RoutepackError, RoutepackTypeError

#: The dtypes expert ids may come in (counted without a copy).
ROUTED_DTYPES = (np.uint8, np.int16, np.int32, np.int64)


def check_ids(arr: np.ndarray, name: str, ndim: int) -> np.ndarray:
    """``arr`` as an array of expert ids in one of `ROUTED_DTYPES` with ``ndim`` dimensions."""
    arr = np.asarray(arr)
    if arr.dtype.type not in ROUTED_DTYPES:
        raise RoutepackTypeError(f"{name}: dtype {arr.dtype} is not one of uint8, int16, int32, int64")
    if arr.ndim != ndim:
        raise RoutepackError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    return native_order(arr, name)


def host_array(value: Any, name: str) -> np.ndarray:
    """numpy view of a numpy array (read-only ones too: slime's ``np.frombuffer``), a CPU torch
    tensor (read without importing torch) or a nested list; a tensor on another device is
    refused, naming ``name``."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        if getattr(getattr(value, "device", None), "type", "cpu") != "cpu":
            raise RoutepackError(f"{name}: a {value.device} tensor; pass it on the CPU (.cpu())")
        return value.detach().numpy()
    with allocating(name, "an array of its items"):
        return np.asarray(value)


def check_same_layout(arrays: "list[np.ndarray]", name: str) -> None:
    """Every per-sample array of ``arrays`` (``name[i]``, each ``[T_i, L, k]``) has the first
    one's ``[L, k]`` and dtype, else `RoutepackError` naming the first that differs."""
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.shape[1:] != first.shape[1:] or a.dtype != first.dtype:
            raise RoutepackError(
                f"{name}[{i}]: shape {a.shape} / dtype {a.dtype} differs from {name}[0]'s "
                f"[T, {first.shape[1]}, {first.shape[2]}] / {first.dtype}"
            )


def native_order(arr: np.ndarray, name: str = "routed") -> np.ndarray:
    """``arr`` (the argument ``name``) in the machine's byte order: a big-endian trace (read
    from a file written on another machine) is converted, since the core reads ids in native
    order."""
    if not arr.dtype.isnative:
        with allocating(name, "a copy in native byte order", arr.nbytes):
            return arr.astype(arr.dtype.newbyteorder("="))
    return arr


def flatten_verl(routed_experts: np.ndarray, attention_mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """verl's padded ``[B, T, L, k]`` + ``[B, T]`` mask → (real tokens ``[N, L, k]`` in
    order, cu_seqlens int64 ``[B+1]``)."""
    routed = check_ids(routed_experts, "routed_experts", 4)
    if routed.shape[0] == 0:
        raise RoutepackError(f"routed_experts: holds no samples (shape {routed.shape}); a window needs one")
    mask = np.asarray(attention_mask)
    if mask.ndim != 2 or mask.shape != routed.shape[:2]:
        raise RoutepackError(
            f"attention_mask: shape {mask.shape} does not match routed_experts' [B, T] = {routed.shape[:2]}"
        )
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"attention_mask: expected bool or integer, got dtype {mask.dtype}")
    with allocating("attention_mask", "its boolean copies", 2 * mask.size):
        if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
            raise RoutepackError("attention_mask: entries must be 0 or 1")
        keep = mask.astype(bool)
        lens = keep.sum(axis=1)
    empty = np.flatnonzero(lens == 0)
    if empty.size:
        raise RoutepackError(f"attention_mask: sample {empty[0]} has no real tokens")
    with allocating("routed_experts", "the real tokens' ids", int(lens.sum()) * routed[0, 0].nbytes):
        flat = routed[keep]  # [N, L, k], samples in order, tokens in order
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return flat, cu


def flatten_slime(per_sample: Iterable[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """slime's per-sample ``[T_i, L, k]`` arrays (a list, tuple or any other iterable of them)
    → (their concatenation ``[T, L, k]``, cu_seqlens int64 ``[S+1]``)."""
    if isinstance(per_sample, np.ndarray):
        raise RoutepackTypeError(
            f"per_sample: expected a list of [T_i, L, k] arrays, got one array of shape {per_sample.shape}"
        )
    items = sequence(per_sample, "per_sample", "[T_i, L, k] arrays")
    if not items:
        raise RoutepackError("per_sample: expected a non-empty list of [T_i, L, k] arrays, got none")
    arrays = [check_ids(a, f"per_sample[{i}]", 3) for i, a in enumerate(items)]
    check_same_layout(arrays, "per_sample")
    for i, a in enumerate(arrays):
        if a.shape[0] == 0:
            raise RoutepackError(f"per_sample[{i}]: has no tokens")
    lens = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    with allocating("per_sample", "the samples' ids in one array", sum(a.nbytes for a in arrays)):
        return np.concatenate(arrays, axis=0), cu


#: Where the core's counting errors name a token: its index in the flattened ``[T, L, k]``
#: array and its sample (`routepack-core/src/ingest.rs`).
_TOKEN = re.compile(r"token (\d+) \(sample (\d+)\)")

#: A token's place in a trainer's layout, from (flattened token index, sample): the argument
#: (or its element) that holds it, and the token as the message names it there.
Locate = Callable[[int, int], Tuple[str, str]]


def renamed(error: RoutepackError, name: str, locate: Locate) -> RoutepackError:
    """A counting error of `Window.from_routed_experts` (which names its own ``routed`` and
    ``cu_seqlens``) restated for an adapter's argument ``name``: a token the error names is
    located by ``locate`` in that argument's layout (``per_sample[3]: token 5 (sample 3)``).
    Other errors come back unchanged."""
    head, sep, rest = str(error).partition(": ")
    if not sep or head not in ("routed", "cu_seqlens"):
        return error
    m = _TOKEN.search(rest)
    if m:
        name, token = locate(int(m.group(1)), int(m.group(2)))
        rest = rest[: m.start()] + token + rest[m.end() :]
    return type(error)(f"{name}: {rest}")


def verl_location(attention_mask: Any, cu: np.ndarray) -> Locate:
    """Token t (of sample s) of `flatten_verl`'s output as its position in ``routed_experts``."""

    def locate(t: int, s: int) -> Tuple[str, str]:
        pos = int(np.flatnonzero(np.asarray(attention_mask)[s])[t - int(cu[s])])
        return f"routed_experts[{s}, {pos}]", f"position {pos} (sample {s})"

    return locate


def slime_location(cu: np.ndarray) -> Locate:
    """Token t (of sample s) of `flatten_slime`'s output as its row of ``per_sample[s]``."""
    return lambda t, s: (f"per_sample[{s}]", f"token {t - int(cu[s])} (sample {s})")


__all__ = [
    "ROUTED_DTYPES",
    "check_ids",
    "check_same_layout",
    "flatten_slime",
    "host_array",
    "flatten_verl",
    "native_order",
    "renamed",
    "slime_location",
    "verl_location",
]
