"""Routing replay per DP rank, in execution order.

slime and verl consume the recorded routing of a rank's microbatches in the order the rank
runs them. Under a plan, DP rank d runs at step m the samples ``plan.cell_samples(d, m)``
(ascending sample index); `rank_microbatches` cuts the window's recorded top-k ids
accordingly, so the trainer can feed each microbatch's ids to the layers as they execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch

from routepack._checks import as_int_array, positive_int, sequence
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.plan import Plan


@dataclass(frozen=True)
class Microbatch:
    """One microbatch of one DP rank.

    * ``micro``: step index (execution order); ``samples`` int64 ``[n]``: window sample indices.
    * ``cu_seqlens`` int64 ``[n+1]``: token offsets of the samples inside this microbatch.
    * ``routed``: ``[T_m, L, k]`` top-k logical expert ids (dtype of the input), samples
      concatenated in ``samples`` order. T_m is 0 when the rank runs no sample at this step.
    """

    micro: int
    samples: np.ndarray
    cu_seqlens: np.ndarray
    routed: torch.Tensor


def rank_microbatches(
    plan: Any,
    routed: Union[np.ndarray, torch.Tensor, Sequence[Any]],
    rank: int,
    cu_seqlens: Any = None,
    *,
    dp: Optional[int] = None,
) -> List[Microbatch]:
    """The routed-expert tensors of DP rank ``rank``'s microbatches, in execution order.

    Args:
        plan:       a `routepack.Plan`.
        routed:     either ``[T, L, k]`` integer ids of all samples concatenated (with
                    ``cu_seqlens`` int ``[S+1]``, the verl/vLLM layout flattened), or a sequence
                    of S arrays ``[T_s, L, k]`` (slime's per-sample layout). L must be the plan's
                    layer count and every id in ``[0, E)``.
        rank:       the DP rank, in ``[0, dp)``; without ``dp``, a rank the plan gives a sample.
        dp:         the number of DP ranks (then a rank the plan gives no sample at all is
                    valid: its microbatches are empty).

    A step at which the rank runs no sample gives a `Microbatch` with ``routed`` of shape
    ``[0, L, k]``: the rank still takes part in that step's collectives (see `EPMoE`).
    """
    if not isinstance(plan, Plan):
        raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
    plan._check_fields()
    s_n = plan.num_samples
    rank = positive_int(rank, "rank", minimum=0)
    if dp is not None:
        dp = positive_int(dp, "dp")
        if rank >= dp or (s_n and int(plan.sample_rank.max()) >= dp):
            raise RoutepackError(
                f"rank: {rank} outside [0, dp={dp})"
                if rank >= dp
                else f"dp: {dp}, but the plan puts samples on rank {int(plan.sample_rank.max())}"
            )
    elif not s_n or rank > int(plan.sample_rank.max()):
        top = int(plan.sample_rank.max()) if s_n else -1
        raise RoutepackError(
            f"rank: {rank} runs no samples in this plan (ranks 0..{top}; pass dp= for a rank without samples)"
        )
    num_layers, num_experts = plan.placement.num_layers, plan.placement.num_experts
    if cu_seqlens is None:
        if isinstance(routed, (np.ndarray, torch.Tensor)):
            raise RoutepackError("cu_seqlens: required when routed is one [T, L, k] array")
        items = sequence(routed, "routed", "per-sample [T_s, L, k] arrays")
        if len(items) != s_n:
            raise RoutepackError(f"routed: has {len(items)} samples, the plan has {s_n}")
        per_sample = [_ids(r, f"routed[{s}]", num_layers) for s, r in enumerate(items)]
        for s, r in enumerate(per_sample[1:], 1):
            if r.shape[1:] != per_sample[0].shape[1:] or r.dtype != per_sample[0].dtype:
                raise RoutepackError(
                    f"routed[{s}]: shape {tuple(r.shape)} {r.dtype}, but routed[0] is "
                    f"{tuple(per_sample[0].shape)} {per_sample[0].dtype} (same L, k, dtype)"
                )
        if not per_sample:
            raise RoutepackError(
                "routed: an empty per-sample list has no [L, k] shape; pass one [0, L, k] array with cu_seqlens=[0]"
            )
        empty = per_sample[0][:0]
    else:
        cu = as_int_array(cu_seqlens, "cu_seqlens", 1)
        if cu.shape != (s_n + 1,) or cu[0] != 0 or np.any(np.diff(cu) < 0):
            raise RoutepackError(f"cu_seqlens: expected non-decreasing [S+1={s_n + 1}] from 0, got {_head(cu)}")
        all_ids = _ids(routed, "routed", num_layers)
        if all_ids.shape[0] != cu[-1]:
            raise RoutepackError(
                f"routed: expected [T={cu[-1]}, L, k] (cu_seqlens[-1] tokens), got {tuple(all_ids.shape)}"
            )
        per_sample = [all_ids[cu[s] : cu[s + 1]] for s in range(s_n)]
        empty = all_ids[:0]
    out = []
    for m in range(plan.num_micro):
        samples = plan.cell_samples(rank, m).astype(np.int64)
        lens = np.array([per_sample[s].shape[0] for s in samples], dtype=np.int64)
        cu_m = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids = torch.cat([per_sample[s] for s in samples]) if samples.size else empty
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_experts:
                raise RoutepackError(
                    f"routed: expert id {lo if lo < 0 else hi} outside [0, {num_experts}) (in step {m} of rank {rank})"
                )
        out.append(Microbatch(m, samples, cu_m, ids))
    return out


def _ids(value: Any, name: str, num_layers: int) -> torch.Tensor:
    """``[T, L, k]`` integer ids as a tensor (a numpy array is shared, not copied, when torch
    can read it as it is)."""
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise RoutepackTypeError(
                f"{name}: expected a [T, L, k] integer array, got {type(value).__name__} ({e})"
            ) from None
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise RoutepackTypeError(f"{name}: expected integer expert ids, got dtype {arr.dtype}")
        if np.issubdtype(arr.dtype, np.unsignedinteger) and arr.dtype != np.uint8:
            # torch has no general uint16/32/64 arithmetic: widen (ids are checked below)
            if arr.size and int(arr.max()) > np.iinfo(np.int64).max:
                raise RoutepackError(f"{name}: id {int(arr.max())} does not fit int64")
            arr = arr.astype(np.int64)
        # torch reads native byte order and non-negative strides only
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("=")))
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise RoutepackTypeError(f"{name}: expected integer expert ids, got dtype {t.dtype}")
    if t.dim() != 3 or t.shape[1] != num_layers or t.shape[2] == 0:
        raise RoutepackError(f"{name}: expected [T, L={num_layers}, k >= 1], got {tuple(t.shape)}")
    return t


def _head(cu: np.ndarray) -> str:
    with np.printoptions(threshold=8, edgeitems=3):
        return f"shape {cu.shape}: {cu}"
