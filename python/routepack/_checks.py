"""Argument checks shared by the data classes: every failure names the argument and value."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def as_int_array(value: Any, name: str, ndim: int, dtype: type = np.int64) -> np.ndarray:
    """Contiguous integer array of `ndim` dimensions in `dtype`; floats, bools and objects are refused."""
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.size and np.issubdtype(arr.dtype, np.unsignedinteger) and arr.max() > np.iinfo(dtype).max:
        raise ValueError(f"{name}: value {arr.max()} does not fit {np.dtype(dtype).name}")
    if arr.size and np.issubdtype(arr.dtype, np.signedinteger) and arr.dtype.itemsize > np.dtype(dtype).itemsize:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name}: value {hi if hi > info.max else lo} does not fit {np.dtype(dtype).name}")
    return np.ascontiguousarray(arr, dtype=dtype)


#: Largest count the Rust core takes (i64 / usize on 64-bit machines).
MAX_INT = 2**63 - 1


def positive_int(value: Any, name: str, minimum: int = 1, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {value}")
    return int(value)


def instance_of(value: Any, cls: type, name: str) -> Any:
    """`value` if it is a `cls`, else a TypeError naming the argument."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected routepack.{cls.__name__}, got {type(value).__name__}")
    return value


def finite_float(value: Any, name: str, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{name}: must be finite, got an integer too large for a float") from None
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{name}: must be finite and {op} {minimum}, got {value!r}")
    return v
