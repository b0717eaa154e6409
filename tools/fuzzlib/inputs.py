"""Malformed values, array mutations and damaged files, drawn from a numpy generator.

The valid random inputs come from the tests (``tests/fuzzing.py``, ``tests/random_plans.py``
and the strategies of ``tests/test_*_fuzz.py``); this module holds what the campaign adds on
top: a pool of wrong scalars and objects, mutations of a valid array (wrong dtype, shape,
values, byte order, memory layout), and damage to a valid file (truncation, bit flips,
forged ``.npy`` headers and zip entries, pickled members, missing or swapped arrays).
"""

from __future__ import annotations

import copy
import fractions
import io
import struct
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from numpy.lib import format as npy_format

# ------------------------------------------------------------------ scalars and objects
#: where an int is expected: wrong types, boundaries, huge ints up to and past 2**64
BAD_INTS: List[Any] = [
    None,
    "2",
    "",
    1.5,
    2.0,
    float("nan"),
    float("inf"),
    -1,
    0,
    True,
    False,
    -(2**63),
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
    {},
    {0: 1},
    [1],
    (2,),
    b"3",
    1j,
    np.float64(2.0),
    np.bool_(True),
    np.array([2]),
    np.uint64(2**64 - 1),
    fractions.Fraction(3, 2),
    object(),
]
#: where a non-negative finite float is expected
BAD_FLOATS: List[Any] = [
    None,
    "1.0",
    "",
    float("nan"),
    float("inf"),
    -float("inf"),
    -1.0,
    -1e-300,
    True,
    10**400,
    {},
    [1.0],
    (0.5,),
    1j,
    np.float32("nan"),
    np.array([1.0]),
    b"1",
    object(),
    {"x": 1.0},
]
#: where an object of a routepack class is expected
BAD_OBJECTS: List[Any] = [None, "x", 0, 1.5, {}, [], (), object(), np.zeros(2), b"", {"dp": 2}]
#: values that are valid ints in disguise (numpy scalars): accepted, same result
INT_ALIASES: List[Callable[[int], Any]] = [int, np.int64, np.int32, np.uint64, np.intp]


def pick(rng: np.random.Generator, pool: List[Any]) -> Any:
    """An entry of ``pool`` (a deep copy, so a call cannot mutate the pool)."""
    v = pool[int(rng.integers(len(pool)))]
    return v if isinstance(v, (np.ndarray, np.generic)) or v is None else copy.deepcopy(v)


def spoil_one(rng: np.random.Generator, args: List[Any], pools: Dict[int, Any], p: float) -> Optional[int]:
    """With probability ``p``, replaces one argument ``args[i]`` (``i`` a key of ``pools``,
    drawn uniformly) by an entry of ``pools[i]`` (a list to `pick` from, or a function of the
    generator); returns ``i``, or None when nothing was replaced."""
    if rng.random() >= p:
        return None
    keys = sorted(pools)
    i = keys[int(rng.integers(len(keys)))]
    pool = pools[i]
    args[i] = pool(rng) if callable(pool) else pick(rng, pool)
    return i


def is_huge(v: Any) -> bool:
    """A Python or numpy int of 2**31 or more (a size no test machine holds)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and int(v) >= 2**31


def bad_for(rng: np.random.Generator, value: Any) -> Any:
    """A wrong value for an argument whose valid value is ``value``."""
    if isinstance(value, bool):
        return pick(rng, ["yes", 1, 0, None, 1.0, np.int64(1), [True]])
    if isinstance(value, (int, np.integer)):
        return pick(rng, BAD_INTS)
    if isinstance(value, (float, np.floating)):
        return pick(rng, BAD_FLOATS)
    if isinstance(value, np.ndarray):
        return mutate_array(rng, value)[1]
    if isinstance(value, str):
        return pick(rng, ["", "nope", "Static", " static", None, 3, b"static", ["static"]])
    if isinstance(value, (list, tuple)):
        return pick(
            rng,
            [
                None,
                "x",
                {0: 1.0},
                {1.0},
                3,
                [],
                list(value)[:-1] or [None],
                [None] * len(value),
                [float("nan")] * len(value),
                [-1.0] * len(value),
            ],
        )
    return pick(rng, BAD_OBJECTS)


# ------------------------------------------------------------------ arrays
#: mutations that keep every value (the library must accept them and give the same result)
SAME_VALUES = ("byteswap", "noncontig", "fortran", "readonly", "list", "int64", "uint64")


def mutate_array(rng: np.random.Generator, a: np.ndarray, only_same: bool = False) -> Tuple[str, Any]:
    """``(label, mutated)``: ``a`` with a wrong dtype, shape or values, or with the same values
    in another byte order or memory layout (labels in `SAME_VALUES`)."""
    a = np.asarray(a)
    kinds = (
        list(SAME_VALUES)
        if only_same
        else list(SAME_VALUES)
        + [
            "float",
            "float_nan",
            "bool",
            "object",
            "str",
            "0d",
            "extra_dim",
            "drop_dim",
            "empty",
            "negative",
            "huge",
            "uint64_max",
            "int8_wrap",
            "longer",
            "none_entry",
            "complex",
            "inf",
        ]
    )
    kind = kinds[int(rng.integers(len(kinds)))]
    return kind, _mutate(kind, rng, a)


def _some(rng: np.random.Generator, a: np.ndarray) -> Tuple[np.ndarray, int]:
    b = np.array(a, copy=True)
    return b, int(rng.integers(b.size)) if b.size else -1


def _mutate(kind: str, rng: np.random.Generator, a: np.ndarray) -> Any:
    if kind == "byteswap":
        return a.astype(a.dtype.newbyteorder())
    if kind == "noncontig":
        if a.ndim == 0:
            return a
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "readonly":
        b = a.copy()
        b.flags.writeable = False
        return b
    if kind == "list":
        return a.tolist()
    if kind == "int64":
        return a.astype(np.int64) if a.dtype.kind in "iu" else a
    if kind == "uint64":
        return a.astype(np.uint64) if a.dtype.kind in "iu" and (a.size == 0 or a.min() >= 0) else a
    if kind == "float":
        return a.astype(np.float64)
    if kind in ("float_nan", "inf"):
        b = a.astype(np.float64)
        if b.size:
            b.flat[int(rng.integers(b.size))] = np.nan if kind == "float_nan" else np.inf
        return b
    if kind == "bool":
        return a.astype(bool)
    if kind == "object":
        return a.astype(object)
    if kind == "str":
        return a.astype(str)
    if kind == "complex":
        return a.astype(np.complex128)
    if kind == "0d":
        return np.asarray(a.flat[0]) if a.size else np.asarray(0)
    if kind == "extra_dim":
        return a[None]
    if kind == "drop_dim":
        return a.reshape(-1) if a.ndim != 1 else (a[0] if a.size else a.reshape(0, 0))
    if kind == "empty":
        return a[:0] if a.ndim else a.reshape(0)
    if kind == "longer":
        return np.concatenate([a, a[:1]]) if a.ndim and a.shape[0] else a
    if kind == "negative":
        b, i = _some(rng, a.astype(np.int64) if a.dtype.kind == "u" else a)
        if i >= 0:
            b.flat[i] = -1 if rng.random() < 0.7 else np.iinfo(b.dtype).min if b.dtype.kind == "i" else -1
        return b
    if kind == "huge":
        b, i = _some(rng, a.astype(np.int64) if a.dtype.kind in "iub" else a)
        if i >= 0:
            b.flat[i] = [2**31, 2**32, 2**62, 2**63 - 1][int(rng.integers(4))]
        return b
    if kind == "uint64_max":
        b, i = _some(rng, np.abs(a.astype(np.int64)).astype(np.uint64) if a.dtype.kind in "iub" else a)
        if i >= 0:
            b.flat[i] = np.uint64(2**64 - 1)
        return b
    if kind == "int8_wrap":
        return a.astype(np.int64).astype(np.int8) if a.dtype.kind in "iu" else a
    if kind == "none_entry":
        b = a.astype(object)
        if b.size:
            b.flat[0] = None
        return b
    raise AssertionError(kind)


# ------------------------------------------------------------------ damaged files
def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    npy_format.write_array(buf, arr, allow_pickle=True)
    return buf.getvalue()


def forged_npy(shape: Tuple[int, ...], descr: str, payload: bytes = b"", fortran: bool = False) -> bytes:
    """A ``.npy`` whose header claims ``shape`` of ``descr`` whatever the payload holds."""
    header = repr({"descr": descr, "fortran_order": fortran, "shape": tuple(shape)}).encode("latin1")
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + payload


def zip_members(raw: bytes) -> List[Tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        return [(n, zf.read(n)) for n in zf.namelist()]


def build_zip(members: List[Tuple[str, bytes]], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return buf.getvalue()


#: the ways `damage` breaks a file (``forge_*`` rebuild the zip with one member forged)
DAMAGES = (
    "truncate",
    "bitflip",
    "bitflips",
    "zero_tail",
    "random",
    "empty",
    "npy_only",
    "drop_member",
    "extra_member",
    "forge_huge_shape",
    "forge_pickle",
    "forge_dtype",
    "forge_ndim",
    "forge_short",
    "forge_fortran",
    "forge_version",
    "forge_string",
    "stored_crc",
    "claimed_size",
    "swap_members",
)


def damage(rng: np.random.Generator, raw: bytes) -> Tuple[str, bytes, bool]:
    """``(label, damaged bytes, forged)``: ``raw`` (a valid ``.npz``) damaged one way.
    ``forged``: a member was replaced by another well-formed array, which may be valid data
    (a string where the policy name is): a successful load then need not give the original.
    Any other damage that still loads (a flip in a timestamp) must give the original data."""
    kind = DAMAGES[int(rng.integers(len(DAMAGES)))]
    n = len(raw)
    if kind == "truncate":
        return kind, raw[: int(rng.integers(0, n))], False
    if kind in ("bitflip", "bitflips"):
        b = bytearray(raw)
        for _ in range(1 if kind == "bitflip" else int(rng.integers(2, 40))):
            i = int(rng.integers(n))
            b[i] ^= 1 << int(rng.integers(8))
        return kind, bytes(b), False
    if kind == "zero_tail":
        k = int(rng.integers(1, max(2, n // 2)))
        return kind, raw[: n - k] + b"\0" * k, False
    if kind == "random":
        return kind, rng.integers(0, 256, size=int(rng.integers(1, 2000)), dtype=np.uint8).tobytes(), False
    if kind == "empty":
        return kind, b"", False
    members = zip_members(raw)
    if kind == "npy_only":
        return kind, members[int(rng.integers(len(members)))][1], False
    i = int(rng.integers(len(members)))
    name, data = members[i]
    if kind == "drop_member":
        return kind + f"({name})", build_zip(members[:i] + members[i + 1 :]), False
    if kind == "extra_member":
        return kind, build_zip(members + [("junk.npy", npy_bytes(np.arange(3)))]), False
    if kind == "swap_members" and len(members) > 1:
        j = (i + 1 + int(rng.integers(len(members) - 1))) % len(members)
        swapped = list(members)
        swapped[i], swapped[j] = (name, members[j][1]), (members[j][0], data)
        return kind + f"({name}<->{members[j][0]})", build_zip(swapped), False
    if kind == "stored_crc":
        b = bytearray(build_zip(members, zipfile.ZIP_STORED))
        at = b.find(data[:16]) if len(data) >= 16 else -1
        if at >= 0:
            b[at + 12] ^= 0xFF
        return kind + f"({name})", bytes(b), False
    if kind == "claimed_size":
        b = bytearray(build_zip(members))
        cd = b.rfind(b"PK\x01\x02")
        if cd >= 0:
            b[cd + 24 : cd + 28] = struct.pack("<I", 0xFFFFFFF0)  # uncompressed size in the directory
        return kind, bytes(b), False
    forged = {
        "forge_huge_shape": lambda: forged_npy((2**40,), "<i8", data[-64:]),
        "forge_pickle": lambda: npy_bytes(np.array([{"x": 1}, None], dtype=object)),
        "forge_dtype": lambda: npy_bytes(np.zeros(3, dtype=np.float64)),
        "forge_ndim": lambda: npy_bytes(np.zeros((2, 2, 2, 2), dtype=np.int32)),
        "forge_short": lambda: forged_npy((1000,), "<i4", b"\0" * 8),
        "forge_fortran": lambda: forged_npy((2, 3), "<i4", b"\0" * 24, fortran=True),
        "forge_version": lambda: b"\x93NUMPY\x09\x00" + data[8:],
        "forge_string": lambda: npy_bytes(np.array("not an array of ints")),
    }[
        kind
        if kind
        in (
            "forge_huge_shape",
            "forge_pickle",
            "forge_dtype",
            "forge_ndim",
            "forge_short",
            "forge_fortran",
            "forge_version",
            "forge_string",
        )
        else "forge_dtype"
    ]
    return kind + f"({name})", build_zip(members[:i] + [(name, forged())] + members[i + 1 :]), True


def damage_text(rng: np.random.Generator, text: str) -> Tuple[str, bytes]:
    """A JSON text file damaged: truncated, bit-flipped (maybe invalid UTF-8), a value
    replaced, a BOM, a non-object, a huge number, NaN."""
    raw = text.encode()
    kinds = ["truncate", "bitflip", "latin1", "bom", "list", "nan", "huge", "null", "dup_key", "utf16", "nested"]
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "truncate":
        return kind, raw[: int(rng.integers(0, len(raw)))]
    if kind == "bitflip":
        b = bytearray(raw)
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        return kind, bytes(b)
    if kind == "latin1":
        return kind, raw.replace(b'"a_lin"', b'"a_l\xefn"', 1)
    if kind == "bom":
        return kind, b"\xef\xbb\xbf" + raw
    if kind == "list":
        return kind, b"[" + raw + b"]"
    if kind == "nan":
        return kind, raw.replace(b'"c_tok": ', b'"c_tok": NaN, "x": ', 1)
    if kind == "huge":
        return kind, raw.replace(b'"c_exp": ', b'"c_exp": 1' + b"0" * 400 + b', "y": ', 1)
    if kind == "null":
        return kind, raw.replace(b'"bw_intra": ', b'"bw_intra": null, "z": ', 1)
    if kind == "dup_key":
        return kind, raw.replace(b"{", b'{"a_lin": -1, ', 1)
    if kind == "utf16":
        return kind, text.encode("utf-16")
    return kind, raw.replace(b'"a_quad": ', b'"a_quad": {"0": ', 1).replace(b"]", b"]}", 1)
