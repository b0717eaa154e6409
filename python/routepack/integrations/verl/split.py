"""The DP split and the microbatches of verl from plans: what ``RayPPOTrainer._balance_batch``
computes (`balance_partitions`, `balance_batch`) and what ``rearrange_micro_batches`` returns
(`micro_batch_indices`, `rearrange_micro_batches`, `prepare_dynamic_batch`). The index
functions need numpy only; the ones that build verl objects import verl (and torch)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from routepack._checks import as_int_array, index, instance_of, positive_int, sequence
from routepack.errors import RoutepackError
from routepack.integrations.shared.arrays import (
    as_numpy,
    local_micro_indices,
    num_ranks,
    plans_list,
    rank_order,
    require,
)
from routepack.integrations.shared.equal_counts import plan_equal_counts
from routepack.plan import Plan


def plan_batch(window: Any, topo: Any, cost: Any, token_cap: int, policy: Any = "routepack", **kwargs: Any) -> Plan:
    """`routepack.plan_window` for a verl batch: the plan with equal sample counts per DP
    rank (`equal_count_plan`). Where the counts cannot be equalised under the cap, the
    window is planned again with the same placement and replication choices and verl's own
    Karmarkar–Karp packing (equal counts by construction); ``report["equal_counts"]`` then
    says ``{"fallback": "kk"}``. Arguments as `routepack.plan_window` (``kwargs``: its
    keyword arguments and stage options). Returns a `Plan` that passed `Plan.validate`."""
    return plan_equal_counts(window, topo, cost, token_cap, policy, **kwargs)


# ---------------------------------------------------------------- the DP split
def balance_partitions(plans: Any) -> List[List[int]]:
    """What ``_balance_batch`` computes as ``global_partition_lst``: per DP rank, the batch
    indices it gets, in the order it gets them.

    Args:
        plans: a `Plan` for the whole batch, or a list of plans, one per consecutive slice
               of the batch (verl's ``keep_minibatch``: plan i covers the i-th PPO
               mini-batch; each plan's indices are offset by the samples before it).
               Every plan needs equal sample counts per rank (`equal_count_plan`) and the
               same DP ranks.

    Returns:
        ``list`` of ``dp`` ``list[int]``, equal lengths; rank r's list is plan i's rank-r
        samples in step order (ascending inside a step), for i in order. Concatenated, they
        are ``global_idx``: ``batch.reorder(torch.tensor(global_idx))`` is verl's reorder.
    """
    plans = plans_list(plans)
    dp = num_ranks(plans[0], "plans[0]")
    out: List[List[int]] = [[] for _ in range(dp)]
    offset = 0
    for i, plan in enumerate(plans):
        name = f"plans[{i}]"
        if num_ranks(plan, name) != dp:
            raise RoutepackError(f"{name}: has {num_ranks(plan, name)} DP ranks, plans[0] has {dp}")
        counts = np.bincount(plan.sample_rank, minlength=dp)
        if counts.min() != counts.max():
            raise RoutepackError(
                f"{name}: DP ranks hold {counts.tolist()} samples; verl's DataProto.chunk needs equal counts "
                "(make them equal with routepack.integrations.verl.equal_count_plan)"
            )
        for r in range(dp):
            out[r].extend(int(s) + offset for s in rank_order(plan, r, name))
        offset += plan.num_samples
    return out


def balance_order(plans: Any) -> np.ndarray:
    """int64 ``[B]``: `balance_partitions` concatenated, verl's ``global_idx``."""
    return np.array([s for part in balance_partitions(plans) for s in part], dtype=np.int64)


def balance_stats(seqlen_list: Any, partitions: List[List[int]], prefix: str = "global_seqlen") -> Dict[str, Any]:
    """verl's ``log_seqlen_unbalance`` metrics for ``partitions`` (``seqlen_list``: int
    ``[B]``, the batch's lengths before the reorder): keys ``{prefix}/min``, ``/max``,
    ``/minmax_diff`` (of equal consecutive slices), ``/balanced_min``, ``/balanced_max`` (of
    the partitions) and ``/mean``."""
    lens = as_int_array(as_numpy(seqlen_list, "seqlen_list").reshape(-1), "seqlen_list", 1).tolist()
    parts = [
        [
            index(i, f"partitions[{r}][{j}]", len(lens), "samples in seqlen_list")
            for j, i in enumerate(sequence(p, f"partitions[{r}]", "sample indices"))
        ]
        for r, p in enumerate(sequence(partitions, "partitions", "lists of sample indices"))
    ]
    if not 1 <= len(parts) <= len(lens):
        raise RoutepackError(f"partitions: {len(parts)} partitions of {len(lens)} samples; expected 1 to {len(lens)}")
    size = len(lens) // len(parts)
    sums = [sum(lens[o : o + size]) for o in range(0, len(lens), size)]
    balanced = [sum(lens[i] for i in p) for p in parts]
    return {
        f"{prefix}/min": min(sums),
        f"{prefix}/max": max(sums),
        f"{prefix}/minmax_diff": max(sums) - min(sums),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(sums) / len(parts),
    }


def balance_batch(
    batch: Any, plans: Any, metrics: Optional[Dict[str, Any]] = None, logging_prefix: str = "global_seqlen"
) -> None:
    """In place of ``self._balance_batch(batch, metrics=metrics)``: reorders the verl
    ``DataProto`` ``batch`` (in place, with ``batch.reorder``) so that its ``dp`` equal
    chunks are the plans' DP ranks (`balance_partitions`), and adds verl's balance metrics to
    ``metrics``. The batch must hold as many samples as the plans, with the plans' lengths."""
    torch = require("torch", "routepack.integrations.verl.balance_batch", "verl")

    partitions = balance_partitions(plans)
    mask = as_numpy(batch.batch["attention_mask"], "batch['attention_mask']")
    total = sum(len(p) for p in partitions)
    if mask.shape[0] != total:
        raise RoutepackError(f"batch: holds {mask.shape[0]} samples, the plans {total}")
    batch.reorder(torch.tensor([s for part in partitions for s in part], dtype=torch.long))
    if metrics is not None:
        metrics.update(balance_stats(mask.reshape(total, -1).sum(-1), partitions, logging_prefix))


# -------------------------------------------------------------- microbatches
def micro_batch_indices(plan: Any, dp_rank: int) -> List[List[int]]:
    """What ``rearrange_micro_batches`` returns second, for DP rank ``dp_rank`` of ``plan``:
    per microbatch (execution order = the plan's steps), the indices into the rank's batch
    after `balance_batch` (ints; the lists tile ``range(S_r)`` in order, none empty, every
    rank the same number)."""
    instance_of(plan, Plan, "plan")
    return local_micro_indices(plan, dp_rank)


def rearrange_micro_batches(
    batch: Any, max_token_len: int, plan: Any, dp_rank: int
) -> Tuple[List[Any], List[List[int]]]:
    """In place of ``rearrange_micro_batches(batch, max_token_len, ...)`` on DP rank
    ``dp_rank``: ``(micro_batches, micro_bsz_idx)`` as verl returns them, a list of
    ``TensorDict`` (``tu.index_select_tensor_dict(batch, idx)``) and their index lists
    (`micro_batch_indices`). ``batch``: the rank's ``TensorDict`` after `balance_batch`
    (``attention_mask [S_r, T]``). Every microbatch's ``attention_mask`` sum is checked to be
    at most ``max_token_len`` (a plan made with ``token_cap <= max_token_len`` on the
    batch's own lengths always is); a batch that does not match the plan is refused."""
    tu = require("verl.utils.tensordict_utils", "routepack.integrations.verl.rearrange_micro_batches", "verl")

    max_token_len = positive_int(max_token_len, "max_token_len")
    idx = micro_batch_indices(plan, dp_rank)
    mask = as_numpy(batch["attention_mask"], "batch['attention_mask']")
    n = sum(len(i) for i in idx)
    if mask.shape[0] != n:
        raise RoutepackError(f"batch: holds {mask.shape[0]} samples, DP rank {dp_rank} of the plan {n}")
    lens = mask.reshape(n, -1).sum(-1)
    for m, part in enumerate(idx):
        tokens = int(lens[part].sum())
        if tokens > max_token_len:
            raise RoutepackError(
                f"max_token_len: microbatch {m} of DP rank {dp_rank} holds {tokens} tokens, more than {max_token_len} "
                "(plan with token_cap <= max_token_len on this batch's lengths)"
            )
    return [tu.index_select_tensor_dict(batch, part) for part in idx], idx


def prepare_dynamic_batch(data: Any, max_token_len: int, plan: Any, dp_rank: int) -> Tuple[List[Any], List[List[int]]]:
    """In place of ``verl.utils.seqlen_balancing.prepare_dynamic_batch(data, max_token_len)``
    (what verl's actors call): ``(list of DataProto, index lists)``, the microbatches of
    `rearrange_micro_batches` with their non-tensor fields and ``meta_info``."""
    import copy

    DataProto = require("verl.protocol", "routepack.integrations.verl.prepare_dynamic_batch", "verl").DataProto

    batches, idx = rearrange_micro_batches(data.batch, max_token_len, plan, dp_rank)
    out = []
    for td, part in zip(batches, idx):
        non_tensors = {key: value[part] for key, value in data.non_tensor_batch.items()}
        out.append(DataProto.from_dict(dict(td), non_tensors, meta_info=copy.deepcopy(data.meta_info)))
    return out, idx


__all__ = [
    "balance_batch",
    "balance_order",
    "balance_partitions",
    "balance_stats",
    "micro_batch_indices",
    "plan_batch",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
]
