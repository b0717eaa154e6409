"""One verl training step's plans, as they travel from the driver to the workers: numpy
only, so the driver's split and the workers' lookup are tested without verl.

The driver (`step_plans`) plans each PPO mini-batch (consecutive slices of
``ppo_mini_batch_size * rollout.n`` samples of the batch, as verl's ``keep_minibatch``
keeps them) with equal sample counts per DP rank, and orders the batch so that DP rank r's
chunk is mini-batch 0's rank-r samples, then mini-batch 1's, and so on: verl's worker cuts
its chunk into mini-batches of ``mini_batch_size / dp`` consecutive samples (``make_iterator``
without shuffling), so each mini-batch it trains on is exactly one planned one, in every
epoch. Each sample carries ``routepack_sample`` = (step, position in the ordered batch), a
tensor field that moves with it; each mini-batch's plan rides in the batch's non-tensor
fields under ``routepack_plan_step{step}_minibatch{j}`` (`plan_key`): its DP ranks'
microbatches as lists of positions.

A worker (`micro_indices`) reads its batch's sample ids and the plans of that step, and
returns the microbatches as index lists into its batch, or raises `NoPlan` saying why it
cannot (no plan, a stale one, a batch cut differently from the plan, a microbatch over the
cap, a count VPP cannot take, another ``force_group_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from routepack.integrations.shared.arrays import rank_cells
from routepack.integrations.shared.layout import relayout
from routepack.integrations.megatron.handoff import pack_plan
from routepack.integrations.verl.split import balance_partitions
from routepack.plan import Plan
from routepack.window import Window

#: The tensor field [B, 2] int64 (step, position in the ordered batch) every planned sample carries.
SAMPLE_KEY = "routepack_sample"
#: Prefix of the non-tensor fields that hold a step's mini-batch plans.
PLAN_PREFIX = "routepack_plan_"


def plan_key(step: int, minibatch: int) -> str:
    """The non-tensor field of step ``step``'s mini-batch ``minibatch`` plan."""
    return f"{PLAN_PREFIX}step{step}_minibatch{minibatch}"


class NoPlan(Exception):
    """Why a step or a worker's batch runs verl's own path: ``kind`` (one word, the key the
    log-once and the fallback counts use) and ``message`` (names the option or cause)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass
class StepPlans:
    """One step's plans: ``plans[j]`` for mini-batch j (over its samples, in batch order;
    ``windows[j]`` the window it was planned for, ``topo`` the topology),
    ``order`` int64 [B] (the batch indices in their new order: ``batch.reorder``'s argument),
    ``sample_ids`` int64 [B, 2] (step, position; for the ordered batch), ``payload`` (the
    non-tensor fields, `plan_key` → dict), ``partitions`` (per DP rank, its batch indices)."""

    step: int
    plans: List[Plan]
    windows: List[Window]
    topo: Any
    token_cap: int
    order: np.ndarray
    sample_ids: np.ndarray
    payload: Dict[str, Dict[str, Any]]
    partitions: List[List[int]]


def slice_window(window: Window, start: int, stop: int, group: int = 1) -> Window:
    """Samples ``start:stop`` of ``window``; with ``group > 1``, every ``group`` consecutive
    samples summed into one (verl's ``force_group_size``: they run in one microbatch)."""
    lens, counts = window.seq_lens[start:stop], window.counts[start:stop].astype(np.int64)
    if group > 1:
        lens = lens.reshape(-1, group).sum(axis=1)
        counts = counts.reshape(-1, group, *counts.shape[1:]).sum(axis=1)
    return Window(lens, counts, top_k=window.top_k)


def step_plans(
    planner: Any,
    window: Window,
    dp: int,
    minibatch_size: int,
    token_cap: int,
    step: int,
    group: int = 1,
    multiple: int = 1,
    pack: bool = False,
) -> StepPlans:
    """Plans step ``step`` of a batch whose samples ``window`` describes (in batch order).

    ``planner``: a `routepack.integrations.shared.trainer.TrainerPlanner`; ``minibatch_size``: PPO
    mini-batch samples (``ppo_mini_batch_size * rollout.n``); ``token_cap``: the worker's
    ``ppo_max_token_len_per_gpu`` times the sequence-parallel size; ``group``: verl's
    ``force_group_size``; ``multiple``: microbatches per rank a multiple of it (VPP's
    ``microbatch_group_size_per_vp_stage``). Raises `NoPlan` where verl's own path must run.
    """
    b = window.num_samples
    if b % minibatch_size:
        raise NoPlan(
            "minibatch", f"ppo_mini_batch_size: the batch's {b} samples are not a multiple of {minibatch_size}"
        )
    if minibatch_size % (dp * group):
        raise NoPlan(
            "minibatch",
            f"force_group_size: a mini-batch of {minibatch_size} samples does not split into {dp} DP ranks of whole "
            f"groups of {group}",
        )
    plans, windows = [], []
    for j in range(b // minibatch_size):
        lo = j * minibatch_size
        sub = slice_window(window, lo, lo + minibatch_size)
        part = slice_window(window, lo, lo + minibatch_size, group)
        plan = planner.plan(part, dp, token_cap, equal_counts=True, multiple=multiple)
        if group > 1:
            rank = np.repeat(plan.sample_rank, group)
            micro = np.repeat(plan.sample_micro, group)
            trainer = plan.report["trainer"]
            plan = relayout(plan, sub, planner.topology(dp), token_cap, rank, micro, plan.num_micro, planner.cost)
            plan.report["trainer"] = trainer
        plans.append(plan)
        windows.append(sub)
    partitions = balance_partitions(plans)
    order = np.array([s for part in partitions for s in part], dtype=np.int64)
    position = np.empty(b, dtype=np.int64)
    position[order] = np.arange(b)
    payload = {}
    for j, plan in enumerate(plans):
        lo = j * minibatch_size
        ranks = [[[int(position[lo + s]) for s in cell] for cell in rank_cells(plan, r)] for r in range(dp)]
        payload[plan_key(step, j)] = {
            "step": int(step),
            "minibatch": j,
            "ranks": ranks,
            "num_micro": int(plan.num_micro),
            "token_cap": int(token_cap),
            "force_group_size": int(group),
            "digest": plan.digest(),
        }
        if pack:
            payload[plan_key(step, j)]["megatron"] = pack_plan(plan, windows[j], planner.topology(dp))
    ids = np.stack([np.full(b, step, dtype=np.int64), np.arange(b, dtype=np.int64)], axis=1)
    return StepPlans(int(step), plans, windows, planner.topology(dp), int(token_cap), order, ids, payload, partitions)


def micro_indices(
    sample_ids: Optional[np.ndarray],
    payloads: Mapping[str, Mapping[str, Any]],
    lengths: np.ndarray,
    max_token_len: Optional[int] = None,
    divisible_by: Optional[int] = None,
    force_group_size: int = 1,
) -> List[List[int]]:
    """A worker's microbatches from the plans: index lists into its batch (whose samples
    carry ``sample_ids`` [n, 2] and ``lengths`` [n] tokens), mini-batch by mini-batch, step
    by step, ascending positions inside one. The batch must hold whole planned shares (one
    mini-batch of one DP rank, or several: a forward pass over the rank's whole batch).
    Raises `NoPlan` naming why verl's own path must run instead."""
    if not payloads:
        raise NoPlan("missing", "the batch carries no routepack plan (the driver did not plan this step)")
    if sample_ids is None:
        raise NoPlan("missing", f"the batch has plans but no {SAMPLE_KEY!r} field (it was rebuilt after planning)")
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1, 2)
    steps = np.unique(ids[:, 0])
    planned = sorted({int(p["step"]) for p in payloads.values()})
    if steps.size != 1 or int(steps[0]) not in planned:
        raise NoPlan("stale", f"the plans are for step(s) {planned}, the batch's samples for step(s) {steps.tolist()}")
    step = int(steps[0])
    mine = sorted((p for p in payloads.values() if int(p["step"]) == step), key=lambda p: int(p["minibatch"]))
    where: Dict[int, tuple] = {}
    share: Dict[tuple, int] = {}
    for p in mine:
        for r, cells in enumerate(p["ranks"]):
            share[(p["minibatch"], r)] = sum(len(c) for c in cells)
            for m, cell in enumerate(cells):
                for pos in cell:
                    where[int(pos)] = (int(p["minibatch"]), r, m)
    unknown = [int(q) for q in ids[:, 1] if int(q) not in where]
    if unknown:
        raise NoPlan("stale", f"position {unknown[0]} of step {step} is in no plan of that step")
    keys = [where[int(q)] for q in ids[:, 1]]
    held: Dict[tuple, int] = {}
    for j, r, _ in keys:
        held[(j, r)] = held.get((j, r), 0) + 1
    for (j, r), n in sorted(held.items()):
        if n != share[(j, r)]:
            raise NoPlan(
                "partial",
                f"the batch holds {n} of the {share[(j, r)]} samples DP rank {r} has in mini-batch {j} of step {step}: "
                "its mini-batches were cut differently from the plan (ppo_mini_batch_size, shuffle, or a critic with "
                "its own mini-batch size)",
            )
    group = {int(p["force_group_size"]) for p in mine}
    if group != {int(force_group_size)}:
        raise NoPlan(
            "group", f"force_group_size: the batch asks for {force_group_size}, the plans were made for {sorted(group)}"
        )
    order = np.lexsort((ids[:, 1], [m for _, _, m in keys], [r for _, r, _ in keys], [j for j, _, _ in keys]))
    out: List[List[int]] = []
    last = None
    for i in order:
        cell = keys[i]
        if cell != last:
            out.append([])
            last = cell
        out[-1].append(int(i))
    if max_token_len is not None:
        lens = np.asarray(lengths, dtype=np.int64)
        for m, idx in enumerate(out):
            tokens = int(lens[idx].sum())
            if tokens > max_token_len:
                raise NoPlan(
                    "cap",
                    f"max_token_len_per_gpu: microbatch {m} holds {tokens} tokens, more than this pass's "
                    f"{max_token_len} (the plan's cap is {mine[0]['token_cap']})",
                )
    if divisible_by and len(out) % divisible_by:
        raise NoPlan(
            "vpp",
            f"microbatch_group_size_per_vp_stage: {len(out)} microbatches are not a multiple of {divisible_by} "
            "(install routepack with the same virtual pipeline settings as the workers)",
        )
    return out


__all__ = [
    "NoPlan",
    "PLAN_PREFIX",
    "SAMPLE_KEY",
    "StepPlans",
    "micro_indices",
    "plan_key",
    "slice_window",
    "step_plans",
]
