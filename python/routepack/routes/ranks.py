"""The routes each training rank replays: the split over PP / VPP (layers) and CP / TP
(tokens), as each trainer makes it, so a trainer or a runner takes its share from one place.

Layers: a pipeline stage's model chunk holds transformer layers ``[first, first + count)``
(Megatron's ``get_transformer_layer_offset`` / ``get_num_layers_to_build``, `megatron_chunk`);
its routers replay the route rows of the MoE layers among them (`chunk_rows`), in layer order,
as slime's ``fill_routing_replay`` (``slime/backends/megatron_utils/actor.py``) and verl's
``set_router_replay_data`` (``verl/utils/megatron/router_replay_utils.py``: by absolute layer
when the tensor has a row per layer, by MoE ordinal when it has MoE rows only) index them, and
in the order Megatron's ``RouterReplay.set_replay_data`` takes one tensor per local router
(``megatron/core/transformer/moe/router_replay.py``).

Tokens: each rank replays the rows of the tokens it runs, in the packed order its trainer
builds. A split is an index map ``take`` (int64 ``[local rows]``): entry ``t >= 0`` is row
``t`` of the samples' routes one after another, ``t < 0`` a padding row, ``-1 - t`` its place
in its pad block (`gather`: zeros for verl, slime's ``arange(L·k) % E`` rows for slime).

* verl (`verl_take`): ``preprocess_thd_engine`` (``verl/models/mcore/util.py``, the zigzag
  layout): each sample padded with zero rows to a multiple of ``tp · cp · 2`` (``tp`` without
  CP), every CP rank takes the sample's chunk ``cp_rank`` and chunk ``2·cp - 1 - cp_rank`` of
  ``2·cp``; then ``scatter_to_sequence_parallel_region``: TP rank ``r`` takes the ``r``-th of
  ``tp`` equal parts.
* slime (`slime_take`): ``prepare_routed_experts_for_routing_replay``
  (``slime/backends/megatron_utils/cp_utils.py``): each sample's recorded ``T - 1`` rows and
  one pad row for its last token; per sample ``slice_with_cp`` (padded to ``2·cp`` equal
  chunks, the same two chunks), or with ``allgather_cp`` the whole batch cut in ``cp``
  contiguous parts; the batch padded to a multiple of ``tp · data_pad_size_multiplier``; with
  ``sequence_parallel`` TP rank ``r`` takes the ``r``-th of ``tp`` parts.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from routepack._checks import allocating, as_int_array, boolean, positive_int
from routepack.errors import RoutepackError
from routepack.routes.layers import MoELayers


def chunk_rows(layers: MoELayers, first: int, count: int, num_rows: int) -> List[int]:
    """The route rows a model chunk's routers replay, in layer order: the MoE layers among
    transformer layers ``[first, first + count)`` (0-based), as rows of a route tensor with
    ``num_rows`` rows on its layer axis (a row per layer: the layer index; MoE rows only: the
    MoE ordinal; see `MoELayers.moe_layers`)."""
    first = positive_int(first, "first", minimum=0)
    count = positive_int(count, "count", minimum=0)
    if first + count > layers.num_layers:
        raise RoutepackError(f"count: layers {first}..{first + count - 1} run past the model's {layers.num_layers}")
    layers.moe_layers(num_rows)  # refuses a row count the model cannot have
    by_layer = num_rows == layers.num_layers or num_rows != len(layers.rows)
    out = []
    for i, layer in enumerate(layers.rows):
        if first <= layer < first + count:
            out.append(layer if by_layer else i)
    return out


def megatron_chunk(config: Any, pp_rank: int, vp_stage: Any = None) -> Tuple[int, int]:
    """``(first, count)``: the decoder layers Megatron builds on pipeline rank ``pp_rank``'s
    chunk ``vp_stage`` (Megatron's own ``get_transformer_layer_offset`` and
    ``get_num_layers_to_build``; imports megatron-core)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build  # type: ignore[import-untyped]
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # type: ignore[import-untyped]

    pp_rank = positive_int(pp_rank, "pp_rank", minimum=0)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return int(first), int(get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def replay_list(local: np.ndarray, rows: Sequence[int]) -> List[np.ndarray]:
    """``RouterReplay.set_replay_data``'s argument: per local router (``rows``, `chunk_rows`
    of each chunk in order) its int64 ``[tokens, k]`` targets from the rank's routes
    ``local [tokens, L, k]``."""
    return [np.ascontiguousarray(local[:, r, :], dtype=np.int64) for r in rows]


# ---------------------------------------------------------------- token splits
def _sizes(lengths: Any, name: str) -> np.ndarray:
    lens = as_int_array(lengths, name, 1, np.int64)
    if lens.size == 0 or (lens < 1).any():
        raise RoutepackError(f"{name}: expected one length >= 1 per sample, got {lens.tolist()}")
    return lens


def _rank(rank: int, size: int, name: str) -> int:
    return positive_int(rank, name, minimum=0, maximum=size - 1)


def verl_take(lengths: Any, tp_size: int = 1, tp_rank: int = 0, cp_size: int = 1, cp_rank: int = 0) -> np.ndarray:
    """verl's split (module docstring) of samples of ``lengths`` tokens (each with a row per
    token, the placeholder rows included): the rank's index map."""
    lens = _sizes(lengths, "lengths")
    tp, cp = positive_int(tp_size, "tp_size"), positive_int(cp_size, "cp_size")
    tp_rank, cp_rank = _rank(tp_rank, tp, "tp_rank"), _rank(cp_rank, cp, "cp_rank")
    align = tp * cp * (2 if cp > 1 else 1)
    padded = lens + (align - lens % align) % align
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    parts = []
    for n, p, s in zip(lens.tolist(), padded.tolist(), starts.tolist()):
        pos = np.arange(p)
        if cp > 1:
            half = p // cp // 2
            pos = np.concatenate(
                [pos[half * cp_rank : half * (cp_rank + 1)], pos[p - half * (cp_rank + 1) : p - half * cp_rank]]
            )
        parts.append(np.where(pos < n, s + pos, -1 - (pos - n)))
    take = np.concatenate(parts)
    share = take.size // tp  # divisible: every sample is a multiple of tp
    return take[share * tp_rank : share * (tp_rank + 1)]


def slime_take(
    lengths: Any,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    data_pad_size_multiplier: int = 1,
    sequence_parallel: bool = False,
    allgather_cp: bool = False,
) -> np.ndarray:
    """slime's split (module docstring) of samples of ``lengths`` tokens (``T_i``; each
    recorded ``T_i - 1`` rows, the index map's rows): the rank's index map."""
    lens = _sizes(lengths, "lengths")
    tp, cp = positive_int(tp_size, "tp_size"), positive_int(cp_size, "cp_size")
    tp_rank, cp_rank = _rank(tp_rank, tp, "tp_rank"), _rank(cp_rank, cp, "cp_rank")
    pad_size = tp * positive_int(data_pad_size_multiplier, "data_pad_size_multiplier")
    starts = np.concatenate([[0], np.cumsum(lens - 1)[:-1]])
    # each sample: its recorded rows, then _pad_routed_experts(experts, 1, E): pad block row 0
    samples = [np.concatenate([s + np.arange(n - 1), [-1]]) for n, s in zip(lens.tolist(), starts.tolist())]

    def pad(x: np.ndarray, count: int) -> np.ndarray:
        return np.concatenate([x, -1 - np.arange(count)])

    if boolean(allgather_cp, "allgather_cp"):
        whole = np.concatenate(samples)
        whole = pad(whole, (cp * pad_size - whole.size % (cp * pad_size)) % (cp * pad_size))
        take = np.array_split(whole, cp)[cp_rank]
    else:
        if cp > 1:
            cut = []
            for x in samples:
                chunk = (x.size + 2 * cp - 1) // (2 * cp)
                x = pad(x, 2 * cp * chunk - x.size)
                a, b = chunk * (2 * cp - cp_rank - 1), chunk * (2 * cp - cp_rank)
                cut.append(np.concatenate([x[chunk * cp_rank : chunk * (cp_rank + 1)], x[a:b]]))
            samples = cut
        take = np.concatenate(samples)
        take = pad(take, (pad_size - take.size % pad_size) % pad_size)
    if boolean(sequence_parallel, "sequence_parallel"):
        share = take.size // tp
        take = take[share * tp_rank : share * (tp_rank + 1)]
    return take


def gather(take: np.ndarray, rows: np.ndarray, fill: str = "zeros", num_experts: int = 0) -> np.ndarray:
    """The rank's routes ``[len(take), L, k]`` from the samples' rows ``rows [N, L, k]`` (one
    after another) and an index map; padding rows ``"zeros"`` (verl) or ``"slime"`` (row j of
    a pad block: ``(j·L·k + l·k + i) % num_experts``)."""
    if fill not in ("zeros", "slime"):
        raise RoutepackError(f"fill: expected 'zeros' or 'slime', got {fill!r}")
    if take.size and int(take.max(initial=-1)) >= rows.shape[0]:
        raise RoutepackError(f"take: names row {int(take.max())}, but rows has {rows.shape[0]}")
    _, layers, k = rows.shape
    with allocating("take", "the rank's routes", take.size * layers * k * rows.itemsize):
        out = np.zeros((take.size, layers, k), dtype=rows.dtype)
        real = take >= 0
        out[real] = rows[take[real]]
        if fill == "slime":
            e = positive_int(num_experts, "num_experts")
            j = -1 - take[~real]
            grid = np.arange(layers * k).reshape(1, layers, k)
            out[~real] = ((j[:, None, None] * layers * k + grid) % e).astype(rows.dtype)
    return out


__all__ = ["chunk_rows", "gather", "megatron_chunk", "replay_list", "slime_take", "verl_take"]
