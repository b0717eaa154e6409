"""The ``.npz`` files `Window.save` / `Plan.save` write and ``load`` reads back.

`write` writes exactly the path it is given (numpy's ``savez`` appends ``.npz`` to a bare
name, which ``load`` then could not find). `read` opens the zip itself instead of trusting
``np.load``: every way a file can be damaged (not a zip, truncated, a corrupt stream, a
missing array, pickled Python objects, a forged header claiming terabytes) becomes one
`RoutepackFileError` naming the path and the fault, and nothing is allocated beyond what
the file can actually hold. Builds on numpy, errors and `_checks` only.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tokenize
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Dict, NoReturn, Sequence, Union

import numpy as np
from numpy.lib import format as npy_format

from routepack._checks import file_path
from routepack.errors import RoutepackFileError

#: deflate cannot expand data by more than about 1032:1; a zip entry claiming more is forged.
_MAX_DEFLATE_RATIO = 1100

#: What reading a damaged member can raise (zip, zlib, numpy's header parser — which tokenizes
#: the header, so an unbalanced bracket is a tokenize.TokenError —, allocation).
_DAMAGE = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    ValueError,
    OSError,
    SyntaxError,
    struct.error,
    MemoryError,
    TypeError,
    OverflowError,
    NotImplementedError,
    KeyError,
    tokenize.TokenError,
)


#: A path, or an open binary file (``routepack.torch`` broadcasts plans through a BytesIO).
Target = Union[str, Path, BinaryIO]


def write(path: Target, **arrays: Any) -> None:
    """Writes ``arrays`` compressed to exactly ``path`` (no suffix added), or into an open
    binary file; any other ``path`` (`_checks.file_path`) raises naming ``path``."""
    target = file_path(path, "path", open_file="write")
    if not isinstance(target, str):
        np.savez_compressed(target, **arrays)
        return
    with open(target, "wb") as fh:
        np.savez_compressed(fh, **arrays)


def _name(path: Target) -> str:
    return repr(os.fspath(path)) if isinstance(path, (str, Path)) else f"<{type(path).__name__}>"


def fail(path: Target, what: str, message: str) -> NoReturn:
    raise RoutepackFileError(f"{what} file {_name(path)}: {message}") from None


class _Damaged(Exception):
    """A member's fault, described for the user."""


def _check_member(info: zipfile.ZipInfo, f: Any) -> None:
    """Reads a member's ``.npy`` header and refuses it unless its data fits the entry."""
    version = npy_format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, _, dtype = npy_format.read_array_header_2_0(f)
    else:
        raise _Damaged(f"unsupported .npy format version {version}")
    if dtype.hasobject:
        raise _Damaged("holds pickled Python objects, which routepack never loads")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > info.file_size:
        raise _Damaged(
            f"header claims shape {shape} of {dtype} ({nbytes} bytes) but the entry holds {info.file_size} bytes"
        )


#: Entries read per chunk when a member is narrowed while it is read (`_member_narrow`).
_NARROW_CHUNK = 1 << 22


#: The zip flag bit of an encrypted entry: numpy never writes one, so it is a damaged flag
#: (zipfile would raise a bare RuntimeError asking for a password).
_ENCRYPTED = 0x1


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, narrow: bool = False) -> np.ndarray:
    if info.flag_bits & _ENCRYPTED:
        raise _Damaged("is marked encrypted (numpy writes no such entry: a damaged flag)")
    if info.file_size > max(info.compress_size, 1) * _MAX_DEFLATE_RATIO + 4096:
        raise _Damaged(f"zip entry claims {info.file_size} bytes from {info.compress_size} compressed")
    with zf.open(info) as f:
        _check_member(info, f)
    if narrow:
        with zf.open(info) as f:
            out = _member_narrow(f)
        if out is not None:
            return out
    with zf.open(info) as f:
        return npy_format.read_array(f, allow_pickle=False)


def _member_narrow(f: Any) -> Any:
    """A C-order integer member wider than uint16 whose values all lie in [0, 65535], read
    chunk by chunk into uint16 (an old int32 window's counts: never the whole int32 array in
    memory); None for any other member, or on the first value outside that range (the caller
    then reads it whole, as written)."""
    version = npy_format.read_magic(f)
    read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    if fortran or dtype.kind not in "iu" or dtype.itemsize <= 2:
        return None
    out = np.empty(shape, np.uint16)
    flat = out.reshape(-1)
    for lo in range(0, flat.size, _NARROW_CHUNK):
        n = min(_NARROW_CHUNK, flat.size - lo)
        raw = f.read(n * dtype.itemsize)
        if len(raw) != n * dtype.itemsize:
            raise _Damaged(f"holds {lo + len(raw) // dtype.itemsize} of its {flat.size} entries")
        chunk = np.frombuffer(raw, dtype)
        if chunk.min() < 0 or chunk.max() > 65535:
            return None
        flat[lo : lo + n] = chunk
    return out


def read(
    path: Target, keys: Sequence[str], what: str, optional: Sequence[str] = (), narrow: Sequence[str] = ()
) -> Dict[str, np.ndarray]:
    """The arrays ``keys`` of the ``.npz`` at ``path``, and those of ``optional`` it holds
    (arrays added after files were first written); `RoutepackFileError` if it is damaged.
    Integer arrays named in ``narrow`` whose values all fit uint16 are read as uint16, chunk
    by chunk (the file's wider array is never held whole); other arrays as written.
    A missing or unreadable path raises the usual `OSError`; a ``path`` that is no path nor
    binary file (`_checks.file_path`) raises naming ``path``."""
    source = file_path(path, "path", open_file="read")
    with contextlib.nullcontext(source) if not isinstance(source, str) else open(source, "rb") as fh:
        try:
            zf = zipfile.ZipFile(fh)
        except _DAMAGE as e:
            fail(path, what, f"not an .npz file ({type(e).__name__}: {e})")
        with zf:
            try:
                names = set(zf.namelist())
            except _DAMAGE as e:
                fail(path, what, f"damaged zip directory ({type(e).__name__}: {e})")
            missing = [k for k in keys if f"{k}.npy" not in names]
            if missing:
                held = sorted(n[:-4] for n in names if n.endswith(".npy"))
                fail(path, what, f"missing arrays {missing} (it holds {held})")
            out = {}
            for k in [*keys, *(k for k in optional if f"{k}.npy" in names)]:
                try:
                    out[k] = _member(zf, zf.getinfo(f"{k}.npy"), k in narrow)
                except _Damaged as e:
                    fail(path, what, f"array {k!r} {e}")
                except _DAMAGE as e:
                    fail(path, what, f"array {k!r} is damaged ({type(e).__name__}: {e})")
    return out


def scalar_int(arrays: Dict[str, np.ndarray], key: str, path: Target, what: str) -> int:
    """``arrays[key]`` as an int: a 0-d integer array (a float such as 2.7 is refused, not truncated)."""
    a = arrays[key]
    if a.ndim != 0 or a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        fail(path, what, f"{key}: expected an integer scalar, got dtype {a.dtype} shape {a.shape}")
    return int(a)


def scalar_str(arrays: Dict[str, np.ndarray], key: str, path: Target, what: str) -> str:
    """``arrays[key]`` as a str: a 0-d unicode array."""
    a = arrays[key]
    if a.ndim != 0 or a.dtype.kind != "U":
        fail(path, what, f"{key}: expected a string scalar, got dtype {a.dtype} shape {a.shape}")
    return str(a)


__all__ = ["fail", "read", "scalar_int", "scalar_str", "write"]
