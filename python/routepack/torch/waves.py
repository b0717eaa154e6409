"""How much memory a migration holds, and how to move it in waves under a ceiling.

During one wave of `routepack.torch.migrate` (a few layers moved together), EP rank p holds, besides its live tensors:

* a received copy of every row it receives (or copies locally): ``slot_bytes`` each,
* a backup of every slot it overwrites (one per received row), for the rollback: the same,
* a packed buffer of every row it sends to another rank: ``slot_bytes`` each (freed after
  verification, before the backups are taken, but counted as if held with them),

where ``slot_bytes`` is the bytes of one slot of the layer (weights, optimizer state,
``extra_state``). `rank_bytes` adds these per rank; `plan_waves` groups consecutive layers
into waves so no rank exceeds the ceiling in any wave. The figures are exact for the protocol's
buffers (not allocator rounding or the checksums' small temporaries).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from routepack._checks import positive_int
from routepack.errors import RoutepackError


def rank_bytes(rows: np.ndarray, slot_bytes: Sequence[int], ep: int) -> np.ndarray:
    """int64 ``[L, ep]``: extra bytes EP rank p holds when layer l's rows (`MIGRATION_DTYPE`)
    move in one wave; ``slot_bytes`` int ``[L]``."""
    size = np.asarray(slot_bytes, dtype=np.int64)
    out = np.zeros((size.size, ep), dtype=np.int64)
    if rows.size:
        l = rows["layer"].astype(np.int64)
        src, dst = rows["src_rank"].astype(np.int64), rows["dst_rank"].astype(np.int64)
        np.add.at(out, (l, dst), 2 * size[l])  # received copy + backup of the overwritten slot
        remote = src != dst
        np.add.at(out, (l[remote], src[remote]), size[l[remote]])  # packed send buffer
    return out


def plan_waves(
    rows: np.ndarray, slot_bytes: Sequence[int], ep: int, max_bytes_in_flight: Optional[int]
) -> Tuple[List[Tuple[List[int], List[int]]], int]:
    """``([(layers, row indices)] per wave, peak bytes)``: consecutive layers with rows,
    grouped greedily so every rank's extra memory in a wave stays within
    ``max_bytes_in_flight`` (None: one wave). The peak is the largest per-rank figure of
    any wave. Always at least one wave (a migration without rows still commits the
    placement). Raises `RoutepackError` when one layer alone exceeds the ceiling."""
    per_layer = rank_bytes(rows, slot_bytes, ep)
    layer_of = rows["layer"].astype(np.int64) if rows.size else np.zeros(0, dtype=np.int64)
    with_rows = np.unique(layer_of).tolist()
    groups: List[List[int]] = []
    if max_bytes_in_flight is None:
        groups.append(with_rows)
    else:
        ceiling = positive_int(max_bytes_in_flight, "max_bytes_in_flight")
        current: List[int] = []
        held = np.zeros(ep, dtype=np.int64)
        for l in with_rows:
            need = per_layer[l]
            if int(need.max()) > ceiling:
                p = int(need.argmax())
                raise RoutepackError(
                    f"max_bytes_in_flight: {ceiling} bytes, but moving MoE layer {l} alone holds "
                    f"{int(need.max())} bytes on EP rank {p}; raise the ceiling to at least that"
                )
            if current and int((held + need).max()) > ceiling:
                groups.append(current)
                current, held = [], np.zeros(ep, dtype=np.int64)
            current.append(l)
            held = held + need
        groups.append(current)
    waves, peak = [], 0
    for ls in groups:
        idx = np.flatnonzero(np.isin(layer_of, ls)).tolist()
        waves.append((ls, idx))
        if ls:
            peak = max(peak, int(per_layer[ls].sum(axis=0).max()))
    return waves, peak
