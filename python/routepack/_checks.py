"""Argument checks shared by the data classes and stage options: every failure names the
argument and value, and raises `RoutepackError` (a ValueError) or `RoutepackTypeError` (a
TypeError), so ``except routepack.RoutepackError`` catches every input error."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import weakref
from collections.abc import Mapping, Set
from typing import Any, Iterator, List, Optional

import numpy as np

from routepack.errors import RoutepackError, RoutepackTypeError


def _nbytes(error: MemoryError) -> Optional[int]:
    """Bytes numpy's failed allocation asked for (its ``MemoryError`` carries the shape and
    dtype), or None for another MemoryError."""
    shape, dtype = getattr(error, "shape", None), getattr(error, "dtype", None)
    if shape is None or dtype is None:
        return None
    return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize


@contextlib.contextmanager
def allocating(name: str, what: str, nbytes: Optional[int] = None) -> Iterator[None]:
    """Inside it, an allocation the package makes on the caller's behalf (a copy of the
    caller's array, a list of its items, a table a field of it sizes) that fails raises
    `RoutepackError` naming the argument ``name`` and the bytes, as the core's own refusals do
    (``sizes::check_call``), never a bare ``MemoryError``: under an address-space limit
    (``RLIMIT_AS``) or on a machine without the memory, a huge input is an input error the
    caller can catch with the others. ``nbytes``: what ``what`` takes, where the failure
    itself does not say (numpy's does)."""
    try:
        yield
    except MemoryError as e:
        got = _nbytes(e) or nbytes
        size = (
            f"{got} bytes, which this process cannot allocate" if got else "more memory than this process can allocate"
        )
        raise RoutepackError(f"{name}: {what} would take {size} (a memory limit, or the system's memory)") from None


def as_int_array(value: Any, name: str, ndim: int, dtype: type = np.int64) -> np.ndarray:
    """Contiguous integer array of `ndim` dimensions in `dtype`; floats, bools and objects are refused."""
    with allocating(name, "an array of its items"):
        arr = np.asarray(value)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise RoutepackTypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise RoutepackError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.size and np.issubdtype(arr.dtype, np.unsignedinteger) and arr.max() > np.iinfo(dtype).max:
        raise RoutepackError(f"{name}: value {arr.max()} does not fit {np.dtype(dtype).name}")
    if arr.size and np.issubdtype(arr.dtype, np.signedinteger) and arr.dtype.itemsize > np.dtype(dtype).itemsize:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise RoutepackError(f"{name}: value {hi if hi > info.max else lo} does not fit {np.dtype(dtype).name}")
    with allocating(name, f"a contiguous {np.dtype(dtype).name} copy", arr.size * np.dtype(dtype).itemsize):
        return np.ascontiguousarray(arr, dtype=dtype)


#: Largest count the Rust core takes (i64 / usize on 64-bit machines).
MAX_INT = 2**63 - 1


def positive_int(value: Any, name: str, minimum: int = 1, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RoutepackTypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise RoutepackError(f"{name}: must be >= {minimum}, got {value}")
    if value > maximum:
        raise RoutepackError(f"{name}: must be <= {maximum}, got {value}")
    return int(value)


def token_cap(value: Any, name: str = "token_cap") -> int:
    """A token cap (tokens per microbatch) as an int >= 1, else an error naming ``name``: the one
    check of a cap (`routepack.stages.PlanContext.check` runs it once per `plan_window` call;
    ``tests/test_request.py`` counts it)."""
    return positive_int(value, name)


def index(value: Any, name: str, size: int, what: str) -> int:
    """``value`` as an index into ``size`` items (an int in ``0..size``, numpy ints too, not
    bools or negative ints counted from the end), or an error naming the argument and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RoutepackTypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if not 0 <= value < size:
        raise RoutepackError(f"{name}: must be in [0, {size}) ({size} {what}), got {value}")
    return int(value)


def file_path(path: Any, name: str = "path", open_file: Optional[str] = None) -> Any:
    """``path`` as a str path to pass to ``open``: a non-empty str or an `os.PathLike` giving
    one, without NUL characters. With ``open_file`` ("read" or "write"), an open binary file
    with that method is accepted as well and returned as it is. Anything else (None, bytes,
    an int, which ``open`` would take as a file descriptor, a text file) is refused naming the
    argument, before any file is touched."""
    if open_file is not None and hasattr(path, open_file) and not isinstance(path, (str, os.PathLike)):
        if isinstance(path, io.TextIOBase):
            raise RoutepackTypeError(f"{name}: expected a binary file, got the text file {path!r}")
        return path
    what = "a str or os.PathLike path" + (
        f", or a binary file open for {open_file.rstrip('e')}ing" if open_file else ""
    )
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str):
        raise RoutepackTypeError(f"{name}: expected {what}, got {type(path).__name__} {path!r}")
    if not text:
        raise RoutepackError(f"{name}: is empty; expected {what}")
    if "\0" in text:
        raise RoutepackError(f"{name}: {text!r} contains a NUL character")
    return text


def sequence(value: Any, name: str, what: str = "numbers") -> List[Any]:
    """``value``'s items as a list: a list, tuple, 1-D array or other iterable. A mapping or
    set (whose iteration would silently yield keys or an arbitrary order), a string, or a
    scalar is refused with a TypeError naming the argument."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise RoutepackTypeError(f"{name}: expected a sequence of {what}, got an array of shape {value.shape}")
    elif isinstance(value, (str, bytes, bytearray, Mapping, Set)) or not hasattr(value, "__iter__"):
        raise RoutepackTypeError(f"{name}: expected a sequence of {what}, got {type(value).__name__} {value!r}")
    # a list's pointers, 8 bytes an item (its items' objects come on top)
    with allocating(name, f"a list of its {what}", 8 * len(value) if hasattr(value, "__len__") else None):
        return list(value)


def instance_of(value: Any, cls: type, name: str) -> Any:
    """`value` if it is a `cls`, else a TypeError naming the argument."""
    if not isinstance(value, cls):
        raise RoutepackTypeError(f"{name}: expected routepack.{cls.__name__}, got {type(value).__name__}")
    return value


def _number(value: Any, name: str) -> float:
    """``value`` as a float: a number (not a bool) that a float can hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RoutepackTypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise RoutepackError(f"{name}: must be finite, got an integer too large for a float") from None


def finite_float(value: Any, name: str, minimum: float = 0.0, strict: bool = False) -> float:
    v = _number(value, name)
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        op = ">" if strict else ">="
        raise RoutepackError(f"{name}: must be finite and {op} {minimum}, got {value!r}")
    return v


def bounded_float(value: Any, name: str, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite number in the interval ``lo..hi`` (each end closed unless ``*_open``)."""
    v = _number(value, name)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise RoutepackError(f"{name}: must be finite and in {interval}, got {value!r}")
    return v


def boolean(value: Any, name: str) -> bool:
    """``value`` as a bool; anything but a Python or numpy bool is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise RoutepackTypeError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def loads_array(weight: Any, name: str) -> np.ndarray:
    """float64 ``[L, E]`` contiguous copy of a numeric (integer or float, not bool) array."""
    with allocating(name, "an array of its items"):
        w = np.asarray(weight)
    if w.dtype == np.bool_ or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise RoutepackTypeError(f"{name}: expected a numeric array, got dtype {w.dtype}")
    if w.ndim != 2:
        raise RoutepackError(f"{name}: expected shape [L, E], got {w.shape}")
    with allocating(name, "a contiguous float64 copy", w.size * 8):
        out = np.ascontiguousarray(w, dtype=np.float64)
    # A NaN or negative load makes every max/mean ratio meaningless (NaN compares false, so
    # the ratios read as a perfect 1.0): refuse it here, naming the first bad entry.
    bad = np.flatnonzero(~(np.isfinite(out) & (out >= 0)))
    if bad.size:
        l, e = np.unravel_index(int(bad[0]), out.shape)
        raise RoutepackError(f"{name}: entry [{l}, {e}] is {out[l, e]}; loads must be finite and >= 0")
    return out


def json_value(text: str, name: str) -> Any:
    """``text`` parsed as JSON, or `RoutepackError` naming ``name``: text that is not JSON,
    nesting deeper than the parser's recursion allows (a bare `RecursionError` otherwise),
    or an integer too long to convert (Python's digit limit)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RoutepackError(f"{name}: not valid JSON ({e})") from None
    except RecursionError:
        raise RoutepackError(f"{name}: nested too deeply to read (arrays or objects inside one another)") from None
    except ValueError as e:  # an integer beyond sys.get_int_max_str_digits()
        raise RoutepackError(f"{name}: not readable JSON ({e})") from None


def restated(error: Exception, names: Mapping[str, str]) -> Exception:
    """``error`` (a `RoutepackError` of the core, ``"<argument>: message"``) with its argument
    restated in the caller's words: ``names`` maps the core's name (``num_groups``) to the
    argument the caller passed (``cost.expert_groups``). Another head comes back unchanged."""
    head, sep, rest = str(error).partition(": ")
    if not sep or head not in names:
        return error
    return type(error)(f"{names[head]}: {rest}")


@contextlib.contextmanager
def callers_words(names: Mapping[str, str]) -> Iterator[None]:
    """Inside it, a `RoutepackError` whose argument ``names`` maps is `restated` (the core's
    ``expert_tokens`` as the caller's ``window.expert_tokens``); any other passes unchanged."""
    try:
        yield
    except RoutepackError as e:
        new = restated(e, names)
        if new is e:
            raise
        raise new from None


#: How the core names a window's arrays, and how a caller who passed ``window`` knows them.
WINDOW_WORDS = {"expert_tokens": "window.expert_tokens", "seq_lens": "window.seq_lens"}


#: The read-only arrays `frozen` made, by id: an array here has no writable alias anywhere
#: (an array that merely reads read-only may be a view of a buffer its owner still writes).
_FROZEN: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()


def frozen(arr: np.ndarray, fresh: bool = False, name: str = "array") -> np.ndarray:
    """``arr`` as a read-only array nobody else can write through: itself if `frozen` made
    it, else a read-only copy (or, with ``fresh``, for an array the caller just created and
    holds alone, such as a core result, itself made read-only). What plans hold is frozen, so
    tables derived from it cannot go stale behind an in-place edit. ``name``: the argument
    ``arr`` came from, which a copy that cannot be allocated names (`allocating`)."""
    if _FROZEN.get(id(arr)) is arr:
        return arr
    if fresh:
        out = arr
    else:
        with allocating(name, "a read-only copy", arr.nbytes):
            out = arr.copy()
    out.setflags(write=False)
    _FROZEN[id(out)] = out
    return out
