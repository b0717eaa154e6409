"""Routing replay per DP rank, in execution order.

slime and verl consume the recorded routing of a rank's microbatches in the order the rank
runs them. Under a plan, DP rank d runs at step m the samples ``plan.cell_samples(d, m)``
(ascending sample index); `rank_microbatches` cuts the window's recorded top-k ids
accordingly, so the trainer can feed each microbatch's ids to the layers as they execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Union

import numpy as np
import torch

from routepack.errors import RoutepackError


@dataclass(frozen=True)
class Microbatch:
    """One microbatch of one DP rank.

    * ``micro``: step index (execution order); ``samples`` int64 ``[n]``: window sample indices.
    * ``cu_seqlens`` int64 ``[n+1]``: token offsets of the samples inside this microbatch.
    * ``routed``: ``[T_m, L, k]`` top-k logical expert ids (dtype of the input), samples
      concatenated in ``samples`` order.
    """

    micro: int
    samples: np.ndarray
    cu_seqlens: np.ndarray
    routed: torch.Tensor


def rank_microbatches(plan: Any, routed: Union[np.ndarray, torch.Tensor, Sequence[Any]], rank: int,
                      cu_seqlens: Any = None) -> List[Microbatch]:
    """The routed-expert tensors of DP rank ``rank``'s microbatches, in execution order.

    Args:
        plan:       a `routepack.Plan`.
        routed:     either ``[T, L, k]`` ids of all samples concatenated (with ``cu_seqlens``
                    int ``[S+1]``, the verl/vLLM layout flattened), or a sequence of S arrays
                    ``[T_s, L, k]`` (slime's per-sample layout).
        rank:       the DP rank.
    """
    s_n = plan.num_samples
    if not 0 <= rank < int(plan.sample_rank.max()) + 1:
        raise RoutepackError(f"rank: {rank} runs no samples in this plan (ranks 0..{int(plan.sample_rank.max())})")
    if cu_seqlens is None:
        if isinstance(routed, (np.ndarray, torch.Tensor)):
            raise RoutepackError("cu_seqlens: required when routed is one [T, L, k] array")
        per_sample = [torch.as_tensor(np.asarray(r)) if not isinstance(r, torch.Tensor) else r for r in routed]
        if len(per_sample) != s_n:
            raise RoutepackError(f"routed: has {len(per_sample)} samples, the plan has {s_n}")
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if cu.shape != (s_n + 1,) or cu[0] != 0 or np.any(np.diff(cu) < 0):
            raise RoutepackError(f"cu_seqlens: expected non-decreasing [S+1={s_n + 1}] from 0, got shape {cu.shape}")
        all_ids = routed if isinstance(routed, torch.Tensor) else torch.as_tensor(np.asarray(routed))
        if all_ids.dim() != 3 or all_ids.shape[0] != cu[-1]:
            raise RoutepackError(f"routed: expected [T={cu[-1]}, L, k], got {tuple(all_ids.shape)}")
        per_sample = [all_ids[cu[s]:cu[s + 1]] for s in range(s_n)]
    out = []
    for m in range(plan.num_micro):
        samples = plan.cell_samples(rank, m).astype(np.int64)
        lens = np.array([per_sample[s].shape[0] for s in samples], dtype=np.int64)
        cu_m = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        out.append(Microbatch(m, samples, cu_m, torch.cat([per_sample[s] for s in samples])))
    return out
