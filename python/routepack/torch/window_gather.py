"""A `Window` assembled from the ranks' own samples: each DP rank counts its samples' routed
expert ids into compact histograms, the ranks all-gather those, and every rank builds the
same window (`window_from_ranks`, `gather_window`).

A rank's histograms travel in the smallest of: dense counts ``[S_r, L, E]`` in the narrowest
unsigned integer that holds them (uint8, uint16) or int32; or sparse ``(flat index, count)``
pairs of the non-zero counts, indices uint32 (int64 past 2**32 entries) and counts narrowest.
Lengths travel in the narrowest of uint16 / uint32 / int64. The raw ids they replace are
``[T_r, L, k]`` (uint8 ids for E <= 256, else int16): a sample of n tokens takes ``L·n·k·i``
bytes of ids against ``L·E·c`` of dense counts, ``n·k·i / (E·c)`` times more (~75x for
`flash`'s ~4,800-token samples, k = 8, E = 512, i = c = 2 bytes), and short samples go sparse.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from routepack._checks import instance_of, positive_int
from routepack.errors import RoutepackError
from routepack.torch import _args
from routepack.torch.gather import gather_payloads
from routepack.window import Window

#: Wire encodings of a rank's histograms, by code (``GatheredWindow.encodings`` names them).
ENCODINGS = ("dense_uint8", "dense_uint16", "dense_int32", "sparse_uint8", "sparse_uint16", "sparse_int32")

_COUNT_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))
_LEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.int64))


@dataclass(frozen=True)
class GatheredWindow:
    """What `gather_window` / `window_from_ranks` return on every rank.

    Attributes:
        window: the assembled `Window`: samples by rank (group-rank order), then each rank's
            local order; ``top_k`` the ranks' common one.
        samples: int64 ``[ranks]``, samples each rank contributed (>= 1 each).
        encodings: the wire encoding each rank chose (`ENCODINGS`).
        payload_bytes: int64 ``[ranks]``, bytes of each rank's encoded histograms and lengths:
            what it put on the wire (plus 8 bytes per header int; the all-gather pads every
            payload to ``sent_bytes``).
        sent_bytes: bytes each rank sent in the padded all-gather (the largest payload).
        raw_id_bytes: int64 ``[ranks]``, what gathering each rank's raw routed ids would take
            (``T_r · L · k`` ids in uint8 for E <= 256, else int16, plus int64 lengths);
            -1 where a rank could not tell (a window without ``top_k``).
    """

    window: Window
    samples: np.ndarray
    encodings: Tuple[str, ...]
    payload_bytes: np.ndarray
    sent_bytes: int
    raw_id_bytes: np.ndarray


def raw_id_bytes(num_tokens: int, num_samples: int, num_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes of raw routed ids ``[T, L, k]`` in the narrowest id dtype (uint8 for E <= 256,
    int16 for E <= 32768, else int32) plus int64 ``cu_seqlens [S+1]``."""
    width = 1 if num_experts <= 256 else 2 if num_experts <= 32768 else 4
    return num_tokens * num_layers * top_k * width + 8 * (num_samples + 1)


def encode(window: Window) -> Tuple[int, np.ndarray]:
    """A window's histograms and lengths as (encoding code into `ENCODINGS`, uint8 payload):
    the smallest encoding (module docstring); codes 0-2 dense, 3-5 sparse, by count dtype
    uint8 / uint16 / int32. `decode` inverts it."""
    counts = window.counts
    size = counts.size
    top = int(counts.max())
    cdt = next(d for d in _COUNT_DTYPES if top <= np.iinfo(d).max)
    ldt = next(d for d in _LEN_DTYPES if int(window.seq_lens.max()) <= np.iinfo(d).max)
    lens = window.seq_lens.astype(ldt).view(np.uint8)
    nnz = int(np.count_nonzero(counts))
    idt = np.dtype(np.uint32) if size <= 2**32 else np.dtype(np.int64)
    if nnz * (idt.itemsize + cdt.itemsize) < size * cdt.itemsize:
        flat = counts.reshape(-1)
        where = np.flatnonzero(flat)
        body = [where.astype(idt).view(np.uint8), flat[where].astype(cdt).view(np.uint8)]
        return 3 + _COUNT_DTYPES.index(cdt), np.concatenate([lens] + body)
    return _COUNT_DTYPES.index(cdt), np.concatenate([lens, counts.astype(cdt, copy=False).reshape(-1).view(np.uint8)])


def decode(
    code: int,
    payload: np.ndarray,
    samples: int,
    layers: int,
    experts: int,
    max_len: int,
    out: Optional[np.ndarray] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """(seq_lens int64 ``[S]``, expert_tokens int32 ``[S, L, E]``) from `encode`'s output;
    ``max_len`` picks the lengths' dtype as `encode` did. ``out``: a C-contiguous ``[S, L, E]``
    array to decode the counts into instead (saves a copy when assembling many ranks), of the
    dtype they travelled in (`ENCODINGS`) or any wider one: uint8 | uint16 | int32
    (`gather_window` passes the narrowest that holds every rank's)."""
    ldt = next(d for d in _LEN_DTYPES if max_len <= np.iinfo(d).max)
    cut = samples * ldt.itemsize
    lens = payload[:cut].view(ldt).astype(np.int64)
    body = payload[cut:]
    size = samples * layers * experts
    cdt = _COUNT_DTYPES[code % 3]
    counts = np.empty((samples, layers, experts), np.int32) if out is None else out
    flat = counts.reshape(-1)  # a view: `out` is contiguous
    if code < 3:
        flat[:] = body.view(cdt)
    else:
        idt = np.dtype(np.uint32) if size <= 2**32 else np.dtype(np.int64)
        # nnz indices, then nnz counts
        nnz = body.size // (idt.itemsize + cdt.itemsize)
        flat[:] = 0
        flat[body[: nnz * idt.itemsize].view(idt)] = body[nnz * idt.itemsize :].view(cdt)
    return lens, counts


def gather_window(
    local: Window,
    group: Optional[Any] = None,
    raw_bytes: Optional[int] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> GatheredWindow:
    """Collective: every rank of ``group`` passes the `Window` of its own samples (any number
    >= 1, the same L, E and ``top_k`` on every rank) and gets back the whole window (samples
    by group rank, then local order) with the wire figures (`GatheredWindow`).

    ``raw_bytes``: what this rank's raw ids take, for the comparison (default: `raw_id_bytes`
    of its window, which needs ``top_k``). A rank whose argument is bad raises its error and
    its peers raise `RoutepackError` naming it; ranks whose L, E or ``top_k`` differ raise
    on every rank."""
    _args.group(group)
    _args.timeout(timeout)
    err: Optional[BaseException] = None
    header: List[int] = [0] * 7
    payload = None
    try:
        instance_of(local, Window, "local")
        w = local
        raw = (
            -1 if w.top_k is None else raw_id_bytes(w.total_tokens, w.num_samples, w.num_layers, w.top_k, w.num_experts)
        )
        if raw_bytes is not None:
            raw = positive_int(raw_bytes, "raw_bytes", minimum=0)
        code, payload = encode(w)
        header = [
            w.num_samples,
            w.num_layers,
            w.num_experts,
            -1 if w.top_k is None else w.top_k,
            code,
            int(w.seq_lens.max()),
            raw,
        ]
    except Exception as e:  # noqa: BLE001 (shared with the peers, then re-raised)
        err = e
    heads, parts = gather_payloads(header, payload, err, "local", group, timeout=timeout)
    for col, name in ((1, "L (layers)"), (2, "E (experts)"), (3, "top_k")):
        if np.unique(heads[:, col]).size != 1:
            raise RoutepackError(
                f"local: the ranks' windows differ in {name}: {heads[:, col].tolist()} "
                "(in group-rank order; -1: top_k unknown)"
            )
    layers, experts, top_k = (int(heads[0, c]) for c in (1, 2, 3))
    starts = np.concatenate([[0], np.cumsum(heads[:, 0])])
    # the widest dtype any rank sent holds every count: the window is assembled in it, and
    # `Window` narrows it no further than its largest count allows (never through int32)
    cdt = _COUNT_DTYPES[max(int(h[4]) % 3 for h in heads)]
    counts = np.empty((int(starts[-1]), layers, experts), cdt)
    lens = [
        decode(int(h[4]), p, int(h[0]), layers, experts, int(h[5]), out=counts[a:b])[0]
        for h, p, a, b in zip(heads, parts, starts[:-1], starts[1:])
    ]
    window = Window(np.concatenate(lens), counts, None if top_k < 0 else top_k)
    sizes = np.array([p.size for p in parts], np.int64)
    return GatheredWindow(
        window,
        heads[:, 0].copy(),
        tuple(ENCODINGS[int(c)] for c in heads[:, 4]),
        sizes,
        int(sizes.max()),
        heads[:, 6].copy(),
    )


def window_from_ranks(
    routed: Any,
    cu_seqlens: Any,
    num_experts: int,
    group: Optional[Any] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> GatheredWindow:
    """Collective: the window of every rank's routed expert ids, each rank passing only its
    own samples' (`routepack.Window.from_routed_experts`'s layout).

    Args:
        routed: this rank's top-k logical expert ids, uint8 | int16 | int32 | int64 ``[T_r, L,
            k]`` (a numpy array or a torch tensor, copied to the host).
        cu_seqlens: int ``[S_r+1]`` cumulative token offsets of this rank's samples in
            ``routed`` (numpy or torch).
        num_experts: E, the same on every rank.
        group: the process group (None: the default one).

    Returns the `GatheredWindow` (every rank the same window: samples by group rank, then
    local order; ``raw_id_bytes`` counts the ids in their narrowest dtype, `raw_id_bytes`).
    For verl or slime layouts, build the local window with `Window.from_verl` /
    `Window.from_slime` and call `gather_window`."""
    err: Optional[BaseException] = None
    local: Any = None
    try:
        local = Window.from_routed_experts(_host(routed), _host(cu_seqlens), num_experts)
    except Exception as e:  # noqa: BLE001 (shared with the peers in gather_window)
        err, local = e, None
    if err is not None:
        return _join_failed(err, group, timeout)
    return gather_window(local, group, None, timeout)


def _join_failed(err: BaseException, group: Optional[Any], timeout: Optional[datetime.timedelta]) -> GatheredWindow:
    """Takes part in `gather_window`'s collectives with a failure, then raises ``err``."""
    gather_payloads([0] * 7, None, err, "local", group, timeout=timeout)
    raise err  # pragma: no cover - gather_payloads raised it already


def _host(value: Any) -> Any:
    """A torch tensor as a host numpy array of its own dtype; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


__all__ = ["ENCODINGS", "GatheredWindow", "decode", "encode", "gather_window", "raw_id_bytes", "window_from_ranks"]
