"""slime's routing replay: ``Sample.rollout_routed_experts``.

How slime builds it (THUDM/slime 624b824):

* ``slime/utils/types.py``, ``Sample``'s meta-info update: SGLang's base64 routes decoded as
  int32 (``slime/utils/misc.py``, ``decode_int32_meta_array``; older releases kept the
  read-only ``np.frombuffer`` array), reshaped to ``[len(tokens) - 1 - start, num_layers,
  moe_router_topk]`` and joined with the rows before ``routed_experts_start_len``:
  ``[T - 1, L, k]`` per sample, ``L = args.num_layers`` (a dense layer's row zero, as SGLang
  records it; ``slime/observability/rollout_data_utils.py`` refuses an all-zero MoE layer);
* ``slime/backends/megatron_utils/cp_utils.py``, ``prepare_routed_experts_for_routing_replay``:
  for training, one row per sample for the last token, ``_pad_routed_experts(experts, 1,
  num_experts)`` = ``arange(L·k).reshape(1, L, k) % E`` (`slime_pad_row`), which the replay
  then routes that token with;
* ``slime/backends/megatron_utils/actor.py``, ``fill_routing_replay``: the MoE layers' rows
  (``moe_layer_freq``) go to the routers, ``rollout_routed_experts[:, layer_id]``.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from routepack._checks import allocating, as_int_array, positive_int, sequence
from routepack.routes.ids import check_ids, check_same_layout, host_array
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.routes.summary import SUMMARY_DTYPES, RouteSummary, as_argument, summarize

#: What a sample's last token is counted as: slime's replayed pad row, or not at all.
LAST_TOKEN = ("pad", "skip")
#: `slime_summary`'s default: the route slime's replay gives the last token.
DEFAULT_LAST_TOKEN = "pad"


def slime_pad_row(num_layers: int, top_k: int, num_experts: int, dtype: Any = np.int32) -> np.ndarray:
    """``[1, L, k]``: the route slime replays for a sample's last token
    (``_pad_routed_experts(experts, 1, num_experts)``: ``arange(L*k) % E``)."""
    return (np.arange(num_layers * top_k, dtype=np.int64).reshape(1, num_layers, top_k) % num_experts).astype(dtype)


def slime_samples(rollout_routed_experts: Any, total_lengths: Any = None) -> Tuple[List[np.ndarray], np.ndarray]:
    """slime's per-sample routes, checked, as ``(rows, seq_lens)``: the ``[T_i - 1, L, k]``
    arrays as given (numpy, read-only ones too, or torch; int32 as slime keeps them, or another
    id type; same L, k and dtype), and int64 ``[S]`` lengths ``T_i`` (what the trainer runs).
    ``total_lengths`` (optional ints ``[S]``, ``len(tokens)``): each must be ``rows + 1``, as
    slime asserts."""
    name = "rollout_routed_experts"
    if isinstance(rollout_routed_experts, np.ndarray):
        raise RoutepackTypeError(
            f"{name}: expected a list of [T_i, L, k] arrays, got one array of shape {rollout_routed_experts.shape}"
        )
    items = sequence(rollout_routed_experts, name, "[T_i, L, k] arrays")
    if not items:
        raise RoutepackError(f"{name}: expected at least one sample, got none")
    arrays = [check_ids(host_array(a, f"{name}[{i}]"), f"{name}[{i}]", 3) for i, a in enumerate(items)]
    check_same_layout(arrays, name)
    rows = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    if total_lengths is not None:
        lens = as_int_array(host_array(total_lengths, "total_lengths"), "total_lengths", 1, np.int64)
        if lens.shape[0] != len(arrays):
            raise RoutepackError(f"total_lengths: {lens.shape[0]} lengths for {len(arrays)} samples")
        bad = np.flatnonzero(lens != rows + 1)
        if bad.size:
            i = int(bad[0])
            raise RoutepackError(
                f"{name}[{i}]: has {rows[i]} rows but total_lengths[{i}] = {lens[i]}; slime records len(tokens) - 1"
            )
    return arrays, rows + 1


def slime_summary(
    rollout_routed_experts: Any,
    num_experts: int,
    total_lengths: Any = None,
    last_token: str = DEFAULT_LAST_TOKEN,
    moe_layers: Any = None,
) -> RouteSummary:
    """The `RouteSummary` of slime's routes (`slime_samples`): sample i of length ``T_i``,
    its recorded rows counted, and with ``last_token="pad"`` (default) its last token counted
    with the route slime replays for it (`slime_pad_row`: row l's experts ``(l·k + j) % E``,
    added to the counts, never appended to the routes); ``"skip"``: not counted.
    ``moe_layers``: the rows to count (`MoELayers.moe_layers`), None: every row."""
    num_experts = positive_int(num_experts, "num_experts")
    if last_token not in LAST_TOKEN:
        raise RoutepackError(f"last_token: expected one of {LAST_TOKEN}, got {last_token!r}")
    arrays, lens = slime_samples(rollout_routed_experts, total_lengths)
    layers, k = int(arrays[0].shape[1]), int(arrays[0].shape[2])
    if k > num_experts:
        raise RoutepackError(f"num_experts: {num_experts} is fewer than the routed k = {k}")
    try:
        summary = summarize(arrays, num_experts, lens, moe_layers)
    except RoutepackError as e:
        raise as_argument(e, "rollout_routed_experts") from None
    if last_token == "skip":
        return summary
    pad = slime_pad_row(layers, k, num_experts, np.int64)[0]  # [L, k]
    counted = np.arange(layers) if summary.moe_layers is None else np.array(summary.moe_layers)
    extra = np.zeros(summary.counts.shape[1:], dtype=np.int64)  # [L', E]: k distinct ids a row (k <= E)
    np.add.at(extra, (np.repeat(np.arange(counted.size), k), pad[counted].reshape(-1)), 1)
    top = int(summary.counts.max(initial=0)) + 1
    counts = summary.counts
    if top > np.iinfo(counts.dtype).max:
        with allocating("rollout_routed_experts", "the counts in a wider type", counts.size * 4):
            counts = counts.astype(SUMMARY_DTYPES[SUMMARY_DTYPES.index(counts.dtype) + 1])
    counts = counts + extra.astype(counts.dtype)[None]
    return RouteSummary(summary.seq_lens, counts, summary.top_k, summary.moe_layers, summary.num_rows)


__all__ = ["DEFAULT_LAST_TOKEN", "LAST_TOKEN", "slime_pad_row", "slime_samples", "slime_summary"]
