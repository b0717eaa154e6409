"""Argument checks of `routepack.torch`'s public functions: tensors, expert ids, placement
rows, replica tables, ranks, process groups and timeouts.

Every failure is a `RoutepackError` (a ValueError) or `RoutepackTypeError` (a TypeError)
naming the argument and the value, like `routepack._checks` (whose integer checks these
build on). They live here, not in `_checks`, because they know torch.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from routepack._checks import positive_int
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.model import Topology
from routepack.plan import REPLICA_DTYPE

#: Integer dtypes whose values a torch int64 holds exactly.
_TORCH_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def tensor(value: Any, name: str, ndim: Optional[int] = None, kind: Optional[str] = None) -> torch.Tensor:
    """``value`` if it is a torch tensor of ``ndim`` dimensions and, with ``kind``, of an
    integer (``"int"``, not bool) or floating (``"float"``) dtype."""
    if not isinstance(value, torch.Tensor):
        raise RoutepackTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__} {short(value)}")
    if kind == "int" and value.dtype not in _TORCH_INTS:
        raise RoutepackTypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
    if kind == "float" and not value.dtype.is_floating_point:
        raise RoutepackTypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise RoutepackError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def int_ids(value: Any, name: str, ndim: Optional[int] = None) -> np.ndarray:
    """int64 array of integer ids from a numpy array, a sequence or a torch tensor (copied
    to the host). Floats, bools, strings and objects are refused, not truncated."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TORCH_INTS:
            raise RoutepackTypeError(f"{name}: expected integer ids, got a tensor of dtype {value.dtype}")
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested sequences
        raise RoutepackTypeError(f"{name}: expected an integer array, got {type(value).__name__} ({e})") from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise RoutepackTypeError(f"{name}: expected integer ids, got dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise RoutepackError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise RoutepackError(f"{name}: id {int(arr.max())} does not fit int64")
    return arr.astype(np.int64, copy=False)


def ids_in_range(ids: np.ndarray, name: str, num_experts: int) -> None:
    """Raises naming the first id outside ``[0, num_experts)``."""
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        bad = ids[(ids < 0) | (ids >= num_experts)].reshape(-1)[0]
        raise RoutepackError(f"{name}: expert id {bad} outside [0, {num_experts})")


def topology(value: Any, name: str = "topo") -> Topology:
    if not isinstance(value, Topology):
        raise RoutepackTypeError(f"{name}: expected routepack.Topology, got {type(value).__name__} {short(value)}")
    return value


def rank(value: Any, name: str, size: int) -> int:
    """An int in ``[0, size)`` (a rank of a group of ``size``)."""
    r = positive_int(value, name, minimum=0)
    if r >= size:
        raise RoutepackError(f"{name}: must lie in [0, {size}), got {r}")
    return r


def placement_row(value: Any, name: str, num_slots: int, num_experts: int) -> np.ndarray:
    """int32 ``[num_slots]`` with entries in ``[-1, num_experts)`` and every expert in a slot."""
    arr = int_ids(value, name, 1)
    if arr.shape != (num_slots,):
        raise RoutepackError(f"{name}: expected shape ({num_slots},) (ep*slots_per_rank), got {arr.shape}")
    bad = np.flatnonzero((arr < -1) | (arr >= num_experts))
    if bad.size:
        raise RoutepackError(f"{name}: entry [{int(bad[0])}] = {int(arr[bad[0]])} is outside [-1, {num_experts})")
    missing = np.setdiff1d(np.arange(num_experts), arr)
    if missing.size:
        raise RoutepackError(f"{name}: no slot holds expert {int(missing[0])} (every expert needs one)")
    return arr.astype(np.int32)


def replica_rows(value: Any, name: str, num_experts: int, ep: int) -> np.ndarray:
    """A 1-D array of `routepack.REPLICA_DTYPE` whose experts, ranks and shares are in range."""
    fields = value.dtype.names if isinstance(value, np.ndarray) else None
    if fields is None or not set(REPLICA_DTYPE.names or ()) <= set(fields):
        got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
        raise RoutepackTypeError(f"{name}: expected a structured array of routepack.REPLICA_DTYPE, got {got}")
    if value.ndim != 1:
        raise RoutepackError(f"{name}: expected one dimension, got shape {value.shape}")
    for field, hi in (("expert", num_experts), ("src_rank", ep), ("dst_rank", ep)):
        col = value[field]
        bad = np.flatnonzero((col < 0) | (col >= hi))
        if bad.size:
            raise RoutepackError(f"{name}[{int(bad[0])}].{field}: {int(col[bad[0]])} outside [0, {hi})")
    share = value["share"].astype(np.float64)
    bad = np.flatnonzero(~(np.isfinite(share) & (share >= 0) & (share <= 1)))
    if bad.size:
        raise RoutepackError(f"{name}[{int(bad[0])}].share: {share[bad[0]]} outside [0, 1]")
    return value


def counts_table(value: Any, name: str, ep: int) -> np.ndarray:
    """int64 ``[ep, E]`` of non-negative counts, E >= 1."""
    arr = int_ids(value, name, 2)
    if arr.shape[0] != ep or arr.shape[1] == 0:
        raise RoutepackError(f"{name}: expected shape [ep={ep}, E >= 1], got {arr.shape}")
    if arr.size and arr.min() < 0:
        r, e = np.unravel_index(int(np.argmin(arr)), arr.shape)
        raise RoutepackError(f"{name}[{r}, {e}]: negative count {int(arr[r, e])}")
    return np.ascontiguousarray(arr)


def group(value: Any, name: str = "group") -> Any:
    """None (the default group) or a torch.distributed process group."""
    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise RoutepackTypeError(
            f"{name}: expected a torch.distributed process group or None, got {type(value).__name__} {short(value)}"
        )
    return value


def timeout(value: Any, name: str = "timeout", optional: bool = True) -> Optional[datetime.timedelta]:
    """A positive `datetime.timedelta` (or None where ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
        raise RoutepackTypeError(f"{name}: expected a positive datetime.timedelta, got {short(value)}")
    return value


def dtype_float(value: Any, name: str = "dtype") -> torch.dtype:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise RoutepackTypeError(f"{name}: expected a floating-point torch.dtype, got {short(value)}")
    return value


def fits_memory(nbytes: int, name: str, device: Any) -> None:
    """Raises before allocating ``nbytes`` on ``device`` when that is more than the device holds
    in all (physical RAM for the CPU, total memory for a GPU): the size came from an argument
    and the allocation would otherwise abort or crawl."""
    try:
        dev = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as e:
        raise RoutepackError(f"device: {short(device)} is not a torch device ({e})") from None
    if dev.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(
            dev.index if dev.index is not None else torch.cuda.current_device()
        ).total_memory
    elif dev.type == "cpu" and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # a platform without these names: nothing to compare with
            return
        try:  # an address-space limit on this process (ulimit -v) bounds it further
            import resource

            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            if soft != resource.RLIM_INFINITY and soft > 0:
                total = min(total, soft)
        except (ImportError, ValueError, OSError):
            pass
    else:
        return
    if nbytes > total:
        raise RoutepackError(f"{name}: would take {nbytes} bytes, more than the {total} bytes of {dev}")


def short(value: Any, limit: int = 60) -> str:
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 (a broken repr still gets a message)
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[:limit] + "…"
