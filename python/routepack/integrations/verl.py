"""routepack inside verl: a `Window` from verl's batch, and from a plan exactly what verl's
``RayPPOTrainer._balance_batch`` and ``verl.utils.seqlen_balancing.rearrange_micro_batches``
produce, so a verl user swaps two calls.

verl's layout (``verl/experimental/agent_loop/agent_loop.py``, ``utils/megatron/
router_replay_utils.py``, verl 0.9):

* ``batch["routed_experts"]`` ``[B, T, L, k]``: top-k logical expert ids per position, int16
  (uint8 ids where a recorder stores them so, E <= 256), zero where nothing was recorded;
  ``T`` = prompt + response length, prompts left-padded, responses right-padded.
* ``batch["attention_mask"]`` ``[B, T]``: 1 for real tokens; a sample's length is its sum.
* R3 (rollout routing replay): the rollout engine records no route for the final generated
  token, and verl's replay mask (``build_r3_replay_mask``) leaves that final response row to
  the trainer's own router; its ``routed_experts`` row is a zero placeholder.
* R2 (routes recorded by the trainer's own forward): every real position has a route.

The DP split: ``_balance_batch`` reorders the batch so that ``DataProto.chunk(dp)`` hands
rank r the r-th equal slice; here the slice is rank r's samples in plan step order. The
microbatches: ``rearrange_micro_batches(batch, max_token_len)`` returns the microbatches and
their index lists into the rank's batch, in execution order; here step m of the plan is
microbatch m. verl requires equal sample counts per rank: `equal_count_plan` makes a plan's
counts equal (routepack's own packing balances cost, not counts).

torch, tensordict and verl are imported only by the functions that build verl objects
(`balance_batch`, `rearrange_micro_batches`, `prepare_dynamic_batch`); the index functions
need numpy only. Install with ``pip install 'routepack[verl]'``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from routepack import _core
from routepack._checks import instance_of, positive_int
from routepack._routed import check_ids, native_order, renamed
from routepack.errors import InfeasibleError, RoutepackError, RoutepackTypeError
from routepack.integrations._common import as_numpy, local_micro_indices, num_ranks, plans_list, rank_order, require
from routepack.integrations._equal_counts import equal_count_plan
from routepack.plan import Plan
from routepack.window import Window

#: verl's replay modes (``actor_rollout_ref.actor.router_replay.mode``) this reads.
MODES = ("R3", "R2")


def window_from_verl(
    batch: Any = None,
    *,
    num_experts: int,
    routed_experts: Any = None,
    attention_mask: Any = None,
    response_mask: Any = None,
    mode: str = "R3",
) -> Window:
    """A `Window` from verl's routing replay.

    Args:
        batch:          a verl ``DataProto`` (its ``.batch``), a ``TensorDict`` or a dict
                        holding ``routed_experts``, ``attention_mask`` and (optionally)
                        ``response_mask``; or None, passing the arrays by name.
        num_experts:    E, logical experts per MoE layer; every counted id lies in [0, E).
        routed_experts: uint8 | int16 | int32 | int64 ``[B, T, L, k]`` (numpy or torch).
        attention_mask: bool or 0/1 integers ``[B, T]``; sample b's length (int64) is its sum.
        response_mask:  0/1 ``[B, R]`` (verl's, R = response length): in R3 mode, a sample
                        with no response token keeps its final row. Without it every sample
                        is taken to have a response.
        mode:           ``"R3"`` (default): the final real row of each sample with a response
                        is not counted (verl replays it with the trainer's own router, so its
                        experts are unknown); ``"R2"``: every real row is counted.

    Rows at real positions that are all zero with k >= 2 (a token cannot pick expert 0 k
    times: verl's placeholder for a position the recorder did not reach) are not counted
    either; lengths still include them, as the trainer runs them. Padding is ignored.
    Expert demand is int32 ``[B, L, E]``, ``top_k`` = k.
    """
    num_experts = positive_int(num_experts, "num_experts")
    if mode not in MODES:
        raise RoutepackError(f"mode: expected one of {MODES}, got {mode!r}")
    if batch is not None:
        if routed_experts is not None or attention_mask is not None:
            raise RoutepackError("batch: pass either batch or routed_experts/attention_mask, not both")
        fields = getattr(batch, "batch", batch)
        routed_experts = _field(fields, "routed_experts", True)
        attention_mask = _field(fields, "attention_mask", True)
        response_mask = _field(fields, "response_mask", False)
    if routed_experts is None or attention_mask is None:
        raise RoutepackError("routed_experts: both routed_experts and attention_mask are needed")
    routed = check_ids(as_numpy(routed_experts, "routed_experts"), "routed_experts", 4)
    keep = _real_positions(as_numpy(attention_mask, "attention_mask"), routed.shape[:2])
    lens = keep.sum(axis=1).astype(np.int64)
    counted = keep.copy()
    if mode == "R3":
        has_response = np.ones(len(lens), dtype=bool)
        if response_mask is not None:
            has_response = _response_rows(as_numpy(response_mask, "response_mask"), len(lens))
        last = routed.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=1)
        rows = np.flatnonzero(has_response)
        counted[rows, last[rows]] = False
    if routed.shape[3] >= 2:
        counted &= (routed != 0).any(axis=(2, 3))
    return _window(routed, counted, lens, num_experts)


def _field(fields: Any, key: str, required: bool) -> Any:
    try:
        return fields[key]
    except (KeyError, TypeError):
        if required:
            raise RoutepackError(f"batch: has no {key!r} field") from None
        return None


def _real_positions(mask: np.ndarray, shape: tuple) -> np.ndarray:
    """bool ``[B, T]`` of verl's attention mask, checked against ``routed_experts``' [B, T]."""
    if mask.shape != tuple(shape):
        raise RoutepackError(f"attention_mask: shape {mask.shape} does not match routed_experts' [B, T] = {shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"attention_mask: expected bool or integer, got dtype {mask.dtype}")
    if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
        raise RoutepackError("attention_mask: entries must be 0 or 1")
    keep = mask.astype(bool)
    empty = np.flatnonzero(~keep.any(axis=1))
    if empty.size:
        raise RoutepackError(f"attention_mask: sample {empty[0]} has no real tokens")
    return keep


def _response_rows(mask: np.ndarray, batch: int) -> np.ndarray:
    if mask.ndim != 2 or mask.shape[0] != batch:
        raise RoutepackError(f"response_mask: expected [B={batch}, R], got shape {mask.shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"response_mask: expected bool or integer, got dtype {mask.dtype}")
    return mask.astype(bool).any(axis=1)


def _window(routed: np.ndarray, counted: np.ndarray, lens: np.ndarray, num_experts: int) -> Window:
    """Counts the ``counted`` positions in the core (samples without one count nothing) and
    sets the lengths; a bad id is named by its position in ``routed_experts``."""
    b_idx, t_idx = np.nonzero(counted)
    per = np.bincount(b_idx, minlength=len(lens))
    shape = (len(lens), routed.shape[2], num_experts)
    counts = np.zeros(shape, dtype=np.uint8)
    some = np.flatnonzero(per)
    if some.size:
        flat = np.ascontiguousarray(native_order(routed[b_idx, t_idx]))
        cu = np.concatenate([[0], np.cumsum(per[some])]).astype(np.int64)
        try:
            _, sub = _core.expert_tokens_from_routed(flat, cu, num_experts)
        except RoutepackError as e:

            def locate(t: int, s: int) -> Tuple[str, str]:
                b, pos = int(b_idx[t]), int(t_idx[t])
                return f"routed_experts[{b}, {pos}]", f"position {pos} (sample {b})"

            raise renamed(e, "routed_experts", locate) from None
        # the counted samples' narrow dtype holds the whole window's (the rest count nothing)
        counts = np.zeros(shape, dtype=sub.dtype)
        counts[some] = sub
    return Window(lens, counts, top_k=int(routed.shape[3]))


def plan_batch(window: Any, topo: Any, cost: Any, token_cap: int, policy: Any = "routepack", **kwargs: Any) -> Plan:
    """`routepack.plan_window` for a verl batch: the plan with equal sample counts per DP
    rank (`equal_count_plan`). Where the counts cannot be equalised under the cap, the
    window is planned again with the same placement and replication choices and verl's own
    Karmarkar–Karp packing (equal counts by construction); ``report["equal_counts"]`` then
    says ``{"fallback": "kk"}``. Arguments as `routepack.plan_window` (``kwargs``: its
    keyword arguments and stage options). Returns a `Plan` that passed `Plan.validate`."""
    from routepack.planner import plan_window
    from routepack.policies import resolve
    from routepack.stages.policy import Policy

    plan = plan_window(window, topo, cost, token_cap=token_cap, policy=policy, **kwargs)
    try:
        return equal_count_plan(plan, window, topo, token_cap, cost)
    except InfeasibleError:
        name, pol = resolve(policy)
        if pol.packing == "kk":
            raise
    kk = Policy(pol.placement, "kk", pol.replication, loads=pol.loads)
    plan = plan_window(window, topo, cost, token_cap=token_cap, policy=kk, **kwargs)
    plan.report["equal_counts"] = {"fallback": "kk", "policy": name}
    return equal_count_plan(plan, window, topo, token_cap, cost)


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
    lens = [int(x) for x in as_numpy(seqlen_list, "seqlen_list").reshape(-1)]
    size = len(lens) // len(partitions)
    sums = [sum(lens[o : o + size]) for o in range(0, len(lens), size)]
    balanced = [sum(lens[i] for i in p) for p in partitions]
    return {
        f"{prefix}/min": min(sums),
        f"{prefix}/max": max(sums),
        f"{prefix}/minmax_diff": max(sums) - min(sums),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(sums) / len(partitions),
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
    "MODES",
    "balance_batch",
    "balance_order",
    "balance_partitions",
    "balance_stats",
    "equal_count_plan",
    "micro_batch_indices",
    "plan_batch",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
    "window_from_verl",
]
