"""Compact route summaries: per-sample expert counts a rollout worker computes from a sample's
routes as soon as they arrive, so the driver plans from kilobytes instead of gathering every
token's routes.

A sample of n tokens with L route rows of k int16 ids takes ``2·n·L·k`` bytes (8,192 tokens
of a 58-MoE-layer, top-8 model: 7.6 MB); its summary takes ``L'·E`` counts in the narrowest
type that holds them (uint8 up to 255 tokens, uint16 up to 65,535: 58 × 256 × 2 = 29.7 KB), a
window's counts exactly (`Window.from_summary` builds the window without a copy of them).

    # rollout side, per finished sample (numpy only):
    s = routepack.routes.summarize([rows], num_experts=E, seq_lens=[n], moe_layers=rows_to_count)
    # driver, per step:
    window = routepack.Window.from_summary(routepack.routes.merge(summaries))

Counting runs in the Rust core (`Window.from_routed_experts`' counter), reading the MoE rows
only (``moe_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Tuple

import numpy as np

from routepack import _core
from routepack._checks import allocating, as_int_array, positive_int, sequence
from routepack.routes.ids import check_ids, check_same_layout, host_array, native_order, renamed
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.routes.ids import Locate
from routepack.routes.layers import check_moe_layers, dense_hint

#: The count types of a summary, narrowest first (a window's `COUNT_DTYPES`).
SUMMARY_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


@dataclass(frozen=True)
class RouteSummary:
    """Expert counts of some samples.

    Attributes:
        seq_lens:    int64 ``[S]``: tokens the trainer runs per sample (>= its counted rows).
        counts:      uint8 | uint16 | int32 ``[S, L', E]``: tokens of sample s routed to expert
                     e in counted layer l (a top-k token counts once for each of its k experts).
        top_k:       k.
        moe_layers:  the rows of the route tensors' layer axis that were counted (L' of them),
                     or None: every row (L' = L).
        num_rows:    L, the route tensors' rows on the layer axis.
    """

    seq_lens: np.ndarray
    counts: np.ndarray
    top_k: int
    moe_layers: Optional[Tuple[int, ...]]
    num_rows: int

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (what crosses a process boundary, beside a few ints)."""
        return int(self.seq_lens.nbytes + self.counts.nbytes)


def summarize(
    samples: Iterable[Any],
    num_experts: int,
    seq_lens: Any = None,
    moe_layers: Any = None,
) -> RouteSummary:
    """Counts each sample's route rows.

    Args:
        samples:     per sample its recorded rows ``[r_i, L, k]`` (numpy, or torch read without
                     importing torch; uint8 | int16 | int32 | int64, one dtype), the routes of
                     its first ``r_i`` tokens, every row counted: the engines' per-sample
                     tensors (`routepack.routes.vllm`, `sglang`, `slime`, `verl`) after their
                     own checks; ``r_i`` may be 0 (a sample nothing was recorded for).
        num_experts: E; every counted id lies in [0, E).
        seq_lens:    ints ``[S]``, tokens the trainer runs per sample, each >= ``r_i`` and >= 1;
                     None: ``r_i + 1`` (an engine records every token but the last).
        moe_layers:  rows of the layer axis to count, strictly increasing (a model with dense
                     layers: `MoELayers.moe_layers`); None: every row.

    A bad id or a token listing one expert twice in a counted layer is refused, naming the
    sample (``samples[i]``), its token and the layer's row.
    """
    num_experts = positive_int(num_experts, "num_experts")
    if isinstance(samples, np.ndarray):
        raise RoutepackTypeError(
            f"samples: expected a list of [r_i, L, k] arrays, got one array of shape {samples.shape}"
        )
    items = sequence(samples, "samples", "[r_i, L, k] arrays")
    if not items:
        raise RoutepackError("samples: expected at least one sample, got none")
    arrays = [check_ids(host_array(a, f"samples[{i}]"), f"samples[{i}]", 3) for i, a in enumerate(items)]
    check_same_layout(arrays, "samples")
    num_rows, top_k = int(arrays[0].shape[1]), int(arrays[0].shape[2])
    if num_rows == 0 or top_k == 0:
        raise RoutepackError(f"samples[0]: needs L >= 1 and k >= 1, got shape {arrays[0].shape}")
    if top_k > num_experts:
        raise RoutepackError(f"num_experts: {num_experts} is fewer than the {top_k} experts each token picks (k)")
    rows = check_moe_layers(moe_layers, num_rows)
    recorded = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    lens = recorded + 1 if seq_lens is None else _lengths(seq_lens, recorded)
    some = [a for a in arrays if a.shape[0]]
    with allocating("samples", "the samples' ids in one array", int(sum(a.nbytes for a in some))):
        flat = np.ascontiguousarray(native_order(np.concatenate(some or [arrays[0]])))
    cu = np.concatenate([[0], np.cumsum(recorded)])

    def locate(t: int, i: int) -> Tuple[str, str]:
        return f"samples[{i}]", f"token {t - int(cu[i])} (sample {i})"

    return summarize_flat(flat, recorded, lens, num_experts, rows, locate, "samples")


def merge(summaries: Iterable[RouteSummary]) -> RouteSummary:
    """The samples of ``summaries`` in order, as one summary (the widest count type among
    them). All must agree on k, E, the route rows L and the counted rows."""
    items = sequence(summaries, "summaries", "RouteSummary objects")
    if not items:
        raise RoutepackError("summaries: expected at least one RouteSummary, got none")
    for i, s in enumerate(items):
        if not isinstance(s, RouteSummary):
            raise RoutepackTypeError(f"summaries[{i}]: expected a RouteSummary, got {type(s).__name__}")
        first = items[0]
        if (s.top_k, s.counts.shape[1:], s.moe_layers, s.num_rows) != (
            first.top_k,
            first.counts.shape[1:],
            first.moe_layers,
            first.num_rows,
        ):
            raise RoutepackError(
                f"summaries[{i}]: top_k {s.top_k}, [L', E] {s.counts.shape[1:]}, {s.num_rows} route rows, moe_layers "
                f"{s.moe_layers} differ from summaries[0]'s ({first.top_k}, {first.counts.shape[1:]}, {first.num_rows}, "
                f"{first.moe_layers})"
            )
    wide = max((s.counts.dtype for s in items), key=SUMMARY_DTYPES.index)
    total = sum(s.counts.size for s in items)
    with allocating("summaries", "the merged counts", total * wide.itemsize):
        counts = np.concatenate([s.counts.astype(wide, copy=False) for s in items])
        lens = np.concatenate([s.seq_lens for s in items])
    return RouteSummary(lens, counts, items[0].top_k, items[0].moe_layers, items[0].num_rows)


def _lengths(seq_lens: Any, recorded: np.ndarray) -> np.ndarray:
    lens = as_int_array(host_array(seq_lens, "seq_lens"), "seq_lens", 1, np.int64)
    if lens.shape[0] != recorded.shape[0]:
        raise RoutepackError(f"seq_lens: {lens.shape[0]} lengths for {recorded.shape[0]} samples")
    bad = np.flatnonzero((lens < recorded) | (lens < 1))
    if bad.size:
        i = int(bad[0])
        raise RoutepackError(
            f"seq_lens: sample {i} has length {lens[i]} but samples[{i}] records {recorded[i]} tokens; a length is "
            "at least 1 and at least the recorded tokens"
        )
    return lens


def summarize_flat(
    ids: np.ndarray,
    recorded: np.ndarray,
    seq_lens: np.ndarray,
    num_experts: int,
    moe_layers: Optional[np.ndarray],
    locate: Locate,
    name: str = "routed_experts",
) -> RouteSummary:
    """The summary of checked rows: ``ids [N, L, k]`` (one of the id types, native order,
    C-contiguous) holding ``recorded [S]`` rows per sample one after another, int64 lengths
    ``seq_lens [S]`` (each >= its rows, >= 1), ``moe_layers`` checked (or None). A counting
    error names the token by ``locate(flat index, sample)`` in the caller's argument ``name``."""
    num_rows, top_k = int(ids.shape[1]), int(ids.shape[2])
    counted = num_rows if moe_layers is None else int(moe_layers.shape[0])
    shape = (int(recorded.shape[0]), counted, num_experts)
    some = np.flatnonzero(recorded)
    layers = None if moe_layers is None else [int(r) for r in moe_layers]
    counts: np.ndarray
    if some.size == 0:
        counts = np.zeros(shape, dtype=np.uint8)
    else:
        cu = np.concatenate([[0], np.cumsum(recorded[some])]).astype(np.int64)
        try:
            _, sub = _core.expert_tokens_from_routed(ids, cu, num_experts, layers)
        except RoutepackError as e:
            raise dense_hint(renamed(e, name, lambda t, s: locate(t, int(some[s]))), moe_layers) from None
        if some.size == recorded.shape[0]:
            counts = sub
        else:  # the counted samples' narrow type holds everyone's
            counts = np.zeros(shape, dtype=sub.dtype)
            counts[some] = sub
    return RouteSummary(seq_lens, counts, top_k, None if layers is None else tuple(layers), num_rows)


def as_argument(error: RoutepackError, name: str) -> RoutepackError:
    """A `summarize` error about ``samples`` / ``samples[i]`` restated for the caller's
    argument ``name`` (``rollout_routed_experts[i]: token 3 (sample i) ...``); others unchanged."""
    text = str(error)
    if not text.startswith("samples"):
        return error
    return type(error)(name + text[len("samples") :].replace("samples[", f"{name}["))


__all__ = ["SUMMARY_DTYPES", "RouteSummary", "as_argument", "merge", "summarize", "summarize_flat"]
