"""Layouts a trainer dictates, applied to a plan: what the trainer adapters (`verl`, `slime`)
need beyond `plan_window`'s own layout.

* `relayout`: a plan's placement, replicas and migration with another (DP rank, step) layout,
  validated and priced again;
* `align_steps`: a microbatch count made a multiple of a pipeline's group (Megatron's virtual
  pipeline runs ``microbatch_group_size_per_vp_stage`` microbatches at a time) by splitting
  steps in two on every DP rank;
* `fixed_size_layout`: a layout of microbatches of at most ``micro_batch_size`` samples
  (a trainer's static batch mode), balanced by the cost model's work per sample;
* `clamp_oversize`: a window in which every sample over the cap is cut to the cap (its
  counts scaled), so the planner gives it a microbatch of its own (no other sample fits
  beside a full one); the plan is then priced on the real window.

numpy and the plan types only; no framework is imported here.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Tuple

import numpy as np

from routepack._checks import positive_int
from routepack.errors import InfeasibleError, RoutepackError
from routepack.plan import Plan
from routepack.simulate import simulate
from routepack.window import Window


def relayout(
    plan: Plan,
    window: Window,
    topo: Any,
    token_cap: int,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    cost: Optional[Any] = None,
    note: Optional[dict] = None,
) -> Plan:
    """``plan``'s placement, replicas and migration with the layout ``(sample_rank,
    sample_micro, num_micro)``: a new `Plan` that passed `Plan.validate` under ``token_cap``;
    ``report`` copied without ``predicted`` (stale), which is simulated again when ``cost``
    is given; ``note`` merged into the report. Replicas keep their steps (a step the layout
    adds has none)."""
    report = {k: copy.deepcopy(v) for k, v in plan.report.items() if k != "predicted"}
    report.update(note or {})
    out = Plan(
        plan.placement,
        np.asarray(sample_rank, dtype=np.int32),
        np.asarray(sample_micro, dtype=np.int32),
        int(num_micro),
        plan.replicas,
        plan.migration,
        report=report,
        policy=plan.policy,
        replica_timing=plan.replica_timing,
    )
    out.validate(window, topo, token_cap)
    if cost is not None:
        out.report["predicted"] = simulate(out, window, topo, cost, token_cap).summary()
    return out


def align_steps(
    plan: Plan,
    window: Window,
    topo: Any,
    token_cap: int,
    multiple: int,
    option: str,
    cost: Optional[Any] = None,
    across_ranks: bool = False,
) -> Plan:
    """``plan`` with a microbatch count per DP rank that is a multiple of ``multiple``.

    Each added step takes, on every DP rank, part of that rank's cell with the most tokens
    among its cells of two or more samples (greedy by tokens: longest first, into the lighter
    half). With ``across_ranks`` (a trainer whose ranks need not hold as many samples, like
    slime), a rank without such a cell takes the shortest sample of the fullest splittable
    cell of any rank instead; without it (verl's equal counts) samples stay on their rank. No
    cell grows, so the cap holds. Returns ``plan`` itself when its count is a multiple
    already; raises `InfeasibleError` naming ``option`` (the trainer's setting that asks for
    the multiple) when a step cannot be filled.
    """
    multiple = positive_int(multiple, option)
    if plan.num_micro % multiple == 0:
        return plan
    dp, lens = topo.dp, window.seq_lens
    rank = plan.sample_rank.astype(np.int64)
    micro = plan.sample_micro.astype(np.int64)
    steps, splits = plan.num_micro, 0
    while steps % multiple:
        for r in range(dp):
            members = np.zeros((dp, steps + 1), dtype=np.int64)  # the last column: the step being added
            tokens = np.zeros((dp, steps + 1), dtype=np.int64)
            np.add.at(members, (rank, micro), 1)
            np.add.at(tokens, (rank, micro), lens)
            members[:, steps] = 0  # its cells are not split again
            if (members[r] >= 2).any():
                step = int(np.argmax(np.where(members[r] >= 2, tokens[r], -1)))
                cell = np.flatnonzero((rank == r) & (micro == step))
                order = cell[np.lexsort((cell, -lens[cell]))]
                load = [0, 0]
                for s in order:
                    half = 0 if load[0] <= load[1] else 1
                    load[half] += int(lens[s])
                    if half:
                        micro[s] = steps
            elif across_ranks and (members >= 2).any():
                src, at = (
                    int(i) for i in np.unravel_index(int(np.argmax(np.where(members >= 2, tokens, -1))), members.shape)
                )
                cell = np.flatnonzero((rank == src) & (micro == at))
                s = int(cell[np.lexsort((cell, lens[cell]))[0]])
                rank[s], micro[s] = r, steps
            else:
                raise InfeasibleError(
                    f"{option}: {steps} microbatches per DP rank is not a multiple of {multiple}, and DP rank {r} has no "
                    f"microbatch of two samples to split for another step (more samples per rank, or a smaller {option})"
                )
        steps += 1
        splits += 1
    return relayout(plan, window, topo, token_cap, rank, micro, steps, cost, {"aligned_steps": {"splits": splits}})


def sample_work(window: Window, cost: Optional[Any]) -> np.ndarray:
    """float64 ``[S]``: each sample's dense work under ``cost`` (``a_lin·n + Σ a_quad·n²``),
    or its tokens without a cost model; what a count-limited layout balances."""
    n = window.seq_lens.astype(np.float64)
    if cost is None:
        return n
    return cost.a_lin * n + float(np.sum(cost.a_quad)) * n * n + cost.c_tok * n * float(window.top_k or 1)


def fixed_size_layout(
    window: Window, dp: int, micro_batch_size: int, multiple: int, cost: Optional[Any] = None
) -> Tuple[np.ndarray, np.ndarray, int]:
    """(sample_rank, sample_micro, steps): ``K = ceil(S / micro_batch_size)`` microbatches
    of at most ``micro_batch_size`` samples (a trainer's static batch mode), ``K / dp`` per
    DP rank. Samples in decreasing `sample_work` go each to the open microbatch with the
    least work (ties: the DP rank with the least, then the lowest rank and step), so no
    microbatch is empty and every rank's work is balanced. ``K`` must be a multiple of
    ``dp * multiple``, as the trainer needs equal counts per rank (and VPP groups): else
    `RoutepackError` naming ``micro_batch_size``."""
    s_n = window.num_samples
    k = -(-s_n // micro_batch_size)
    if k % (dp * multiple):
        raise RoutepackError(
            f"micro_batch_size: {s_n} samples in microbatches of {micro_batch_size} make {k}, not a multiple of "
            f"dp_size * microbatch_group_size_per_vp_stage = {dp * multiple} (adjust the config so the step's samples "
            f"are a multiple of dp_size * micro_batch_size * microbatch_group_size_per_vp_stage)"
        )
    steps = k // dp
    work = sample_work(window, cost)
    load = np.zeros((dp, steps))
    count = np.zeros((dp, steps), dtype=np.int64)
    rank = np.zeros(s_n, dtype=np.int64)
    micro = np.zeros(s_n, dtype=np.int64)
    for s in np.lexsort((np.arange(s_n), -work)):
        open_cells = np.argwhere(count < micro_batch_size)
        keys = np.lexsort(
            (open_cells[:, 1], open_cells[:, 0], load.sum(axis=1)[open_cells[:, 0]], load[tuple(open_cells.T)])
        )
        r, m = open_cells[keys[0]]
        rank[s], micro[s] = r, m
        load[r, m] += work[s]
        count[r, m] += 1
    return rank, micro, steps


def clamp_oversize(window: Window, token_cap: int) -> Tuple[Window, np.ndarray]:
    """(window to plan, int64 indices of the samples over ``token_cap``). Each such sample
    is cut to ``token_cap`` tokens, its counts scaled by ``token_cap / n`` (rounded down:
    still possible for the shorter length), so a plan of the cut window gives it a
    microbatch of its own: every other sample has a token, and the cell holds at most the
    cap. ``window`` itself when no sample is over the cap."""
    over = np.flatnonzero(window.seq_lens > token_cap)
    if over.size == 0:
        return window, over
    lens = window.seq_lens.copy()
    counts = window.counts.astype(np.int64)
    counts[over] = counts[over] * token_cap // lens[over][:, None, None]
    lens[over] = token_cap
    return Window(lens, counts, top_k=window.top_k), over


__all__ = ["align_steps", "clamp_oversize", "fixed_size_layout", "relayout", "sample_work"]
