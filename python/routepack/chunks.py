"""Pipeline chunks: which MoE layers each model chunk and each pipeline stage holds
(`Topology.chunk_bounds` / `Topology.stage_layers`, which call these).

Chunk ``v * pp + s`` is virtual stage v of stage s; it takes ``topo.layers_per_stage[c]``
consecutive MoE layers, or, where that is None, an even split (Megatron's default). The
results are lists a caller can index; one whose size this process cannot hold (about 2^30
chunks) is refused naming ``num_layers`` and the bytes before it is built
(`_checks.reserve`), never a bare ``MemoryError`` half-way through a list of ints.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from routepack._checks import allocating, positive_int, reserve
from routepack.errors import RoutepackError

#: Bytes one int of a returned list holds: the list's pointer, the int object, and the int64
#: it came from (the estimate of what a list of n layers takes).
_LISTED_INT_BYTES = 8 + 32 + 8


def chunk_bounds(topo: Any, num_layers: int) -> List[int]:
    """``[pp * vpp + 1]``: model chunk c holds MoE layers ``bounds[c]:bounds[c + 1]``."""
    b = bounds(topo, num_layers)
    what = f"the layer bounds of pp*vpp = {topo.pp * topo.vpp} model chunks as a list"
    reserve("num_layers", what, b.size * _LISTED_INT_BYTES)
    with allocating("num_layers", what, b.size * _LISTED_INT_BYTES):
        return b.tolist()


def bounds(topo: Any, num_layers: int) -> np.ndarray:
    """`chunk_bounds` as int64 ``[pp * vpp + 1]``."""
    num_layers = positive_int(num_layers, "num_layers")
    n = topo.pp * topo.vpp
    if topo.layers_per_stage is None and num_layers % n:
        raise RoutepackError(
            f"topo.layers_per_stage: not given, and {num_layers} MoE layers do not split evenly over "
            f"pp*vpp = {topo.pp}*{topo.vpp} = {n} model chunks; give each chunk's layers"
        )
    what = f"the layer bounds of pp*vpp = {n} model chunks"
    reserve("num_layers", what, 2 * (n + 1) * 8)
    with allocating("num_layers", what, 2 * (n + 1) * 8):
        if topo.layers_per_stage is None:
            sizes = np.full(n, num_layers // n, dtype=np.int64)
        else:
            sizes = np.asarray(topo.layers_per_stage, dtype=np.int64)
        out = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
    if int(out[-1]) != num_layers:
        raise RoutepackError(
            f"topo.layers_per_stage: {list(topo.layers_per_stage or ())} holds {int(out[-1])} MoE layers, "
            f"but the model has {num_layers}"
        )
    return out


def stage_layers(topo: Any, stage: int, num_layers: int) -> List[int]:
    """The MoE layers pipeline stage ``stage`` holds, ascending (its chunks' layers)."""
    stage = positive_int(stage, "stage", minimum=0, maximum=topo.pp - 1)
    b = bounds(topo, num_layers)
    what = f"the MoE layers of pipeline stage {stage} of {topo.pp * topo.vpp} model chunks"
    # the stage of every layer (int64 [num_layers], twice), then the stage's as a list
    nbytes = 2 * num_layers * 8 + (num_layers // topo.pp + 1) * _LISTED_INT_BYTES
    reserve("num_layers", what, nbytes)
    with allocating("num_layers", what, nbytes):
        chunk_stage = np.arange(b.size - 1, dtype=np.int64) % topo.pp
        of_layer = np.repeat(chunk_stage, np.diff(b))
        return np.flatnonzero(of_layer == stage).tolist()
