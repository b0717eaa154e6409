"""Replication stage (docs/design.md stage 4): intra-batch copies of hot experts per exchange.

Every choice has the signature ``f(ctx, options, placement, sample_rank, sample_micro,
num_micro) -> replicas`` and returns a structured array of `REPLICA_DTYPE` entries: in microbatch
``micro`` of EP group ``group``, layer ``layer``, the weights of ``expert`` go from EP-local
rank ``src_rank`` (which hosts it) to ``dst_rank``, which computes ``share`` of that expert's
tokens in that exchange (routing rule: routepack-core's flow module).

* ``none`` (`no_replication`, no options).
* ``hot_n`` (`hot_n_replication`, `HotNOptions`): MindSpeed's balanced MoE. Per exchange,
  N hot experts chosen by repeatedly taking the most loaded EP rank and its largest expert;
  their weights go to every EP rank, each computing its own tokens for them.
* ``relibra`` (`relibra_replication`, `RelibraReplicationOptions`): ReLibra's intra-node
  replication: per exchange and node, the hottest expert of the most loaded rank is copied to
  the least loaded rank of the node with the share that levels them.
* ``routepack`` (`routepack_replication`, `RoutepackReplicationOptions`): per exchange, the
  copies and shares that minimise that layer's simulated time (expert max, all-to-all,
  replication traffic not hidden by attention), never slower than no replication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from routepack import _core
from routepack._checks import as_int_array, positive_int, sequence
from routepack.errors import RoutepackError
from routepack.plan import REPLICA_DTYPE, REPLICA_FIELDS, Placement, Plan, empty_replicas
from routepack.stages.context import PlanContext, check_placement_fits, stage_context
from routepack.stages.options import NoOptions, StageOptions, count, option


@dataclass(frozen=True)
class HotNOptions(StageOptions):
    """Options of the ``hot_n`` replication."""

    #: N, the hot experts broadcast per exchange (MindSpeed's
    #: ``--balanced-moe-hot-expert-num``), >= 1.
    replication_hot_experts: int = option("replication", "replication_hot_experts", count(1))


@dataclass(frozen=True)
class RelibraReplicationOptions(StageOptions):
    """Options of the ``relibra`` replication."""

    #: Copies a rank may hold per (microbatch, layer), >= 0.
    replication_slots: int = option("replication", "replication_slots", count(0))


@dataclass(frozen=True)
class RoutepackReplicationOptions(StageOptions):
    """Options of the ``routepack`` replication (defaults: the Rust core's)."""

    #: Copies a rank may hold per (microbatch, layer), >= 0.
    replication_slots: int = option("replication", "replication_slots", count(0))
    #: Experts and destinations tried per bottleneck list and microbatch, >= 1 (quality vs time:
    #: the default keeps a `flash` plan near 1 s; 2 finds a little more on static placements
    #: at about twice the time).
    replication_candidates: int = option("replication", "replication_candidates", count(1))


def replica_table(columns: tuple) -> np.ndarray:
    """Columns ``(micro, group, layer, expert, src_rank, dst_rank: int32 [N], share: float32
    [N])`` → structured array of `REPLICA_DTYPE` [N]. Each id column must hold integers
    that fit int32 and ``share`` finite numbers (as float32), all seven of one length N;
    anything else raises naming the column (``columns[i]`` / its name)."""
    cols = sequence(columns, "columns", "7 replica columns")
    if len(cols) != len(REPLICA_FIELDS):
        raise RoutepackError(f"columns: expected {len(REPLICA_FIELDS)} columns {REPLICA_FIELDS}, got {len(cols)}")
    checked = [
        as_int_array(c, f"columns[{i}] ({name})", 1, np.int32)
        for i, (name, c) in enumerate(zip(REPLICA_FIELDS[:-1], cols))
    ]
    share = np.asarray(cols[-1])
    if (
        share.ndim != 1
        or share.dtype == np.bool_
        or not (np.issubdtype(share.dtype, np.floating) or np.issubdtype(share.dtype, np.integer))
    ):
        raise RoutepackError(
            f"columns[6] (share): expected a 1-D numeric array, got dtype {share.dtype} shape {share.shape}"
        )
    share32 = share.astype(np.float32)
    if not np.isfinite(share32).all():
        bad = int(np.flatnonzero(~np.isfinite(share32))[0])
        raise RoutepackError(f"columns[6] (share): entry {bad} is {share[bad]}, not a finite float32")
    checked.append(share32)
    n = len(checked[0])
    for i, (name, c) in enumerate(zip(REPLICA_FIELDS, checked)):
        if len(c) != n:
            raise RoutepackError(f"columns[{i}] ({name}): has {len(c)} entries, columns[0] (micro) has {n}")
    table = np.zeros(n, dtype=REPLICA_DTYPE)
    for name, col in zip(REPLICA_FIELDS, checked):
        table[name] = col
    return table


#: ``block`` of the per-exchange choices: ``(index, count)`` plans only block ``index`` of
#: ``count`` contiguous blocks of the flattened exchange index ``(group · M + micro) · L +
#: layer``, giving exactly the rows the full run gives those exchanges, in order (None: every
#: exchange). `routepack.torch.plan_window_distributed` has rank i of n plan block i.
Block = Optional[Tuple[int, int]]


def _block(block: Any) -> Block:
    """``block`` checked: None or a pair ``(index, count)`` with ``0 <= index < count``."""
    if block is None:
        return None
    pair = sequence(block, "block", "(index, count)")
    if len(pair) != 2:
        raise RoutepackError(f"block: expected (index, count), got {block!r}")
    count = positive_int(pair[1], "block[1] (count)")
    index = positive_int(pair[0], "block[0] (index)", minimum=0, maximum=count - 1)
    return index, count


def _common(
    ctx: Any, options: Any, options_class: type, placement: Any, sample_rank: Any, sample_micro: Any, num_micro: Any
) -> Tuple[Plan, np.ndarray, np.ndarray, Any, Any]:
    """What every replication checks first (`stage_context`, the placement, the layout's
    arrays and count) → the core's leading arguments ``(plan, seq_lens, counts, topo, cost)``,
    the plan without replicas or migration. Values in the layout are checked by the core
    against the window and topology, naming the sample."""
    ctx = stage_context(ctx, options, options_class)
    w = ctx.window
    placement = check_placement_fits(placement, "placement", w, ctx.topo)
    rank = as_int_array(sample_rank, "sample_rank", 1, np.int32)
    micro = as_int_array(sample_micro, "sample_micro", 1, np.int32)
    for name, arr in (("sample_rank", rank), ("sample_micro", micro)):
        if arr.shape[0] != w.num_samples:
            raise RoutepackError(f"{name}: has {arr.shape[0]} entries but the window has {w.num_samples} samples")
    m = positive_int(num_micro, "num_micro", maximum=w.num_samples)
    return (Plan(placement, rank, micro, m), w.seq_lens, w.counts, ctx.topo, ctx.cost)


def no_replication(
    ctx: PlanContext,
    options: NoOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
) -> np.ndarray:
    """No copies."""
    _common(ctx, options, NoOptions, placement, sample_rank, sample_micro, num_micro)
    return empty_replicas()


def hot_n_replication(
    ctx: PlanContext,
    options: HotNOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    block: Block = None,
) -> np.ndarray:
    """MindSpeed's hot-expert broadcast (``block``: see `Block`)."""
    cols = _core.replicate_hot_n(
        *_common(ctx, options, HotNOptions, placement, sample_rank, sample_micro, num_micro),
        options.replication_hot_experts,
        block=_block(block),
    )
    return replica_table(cols)


def relibra_replication(
    ctx: PlanContext,
    options: RelibraReplicationOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    block: Block = None,
) -> np.ndarray:
    """ReLibra's intra-node replication (``block``: see `Block`)."""
    cols = _core.replicate_relibra(
        *_common(ctx, options, RelibraReplicationOptions, placement, sample_rank, sample_micro, num_micro),
        options.replication_slots,
        block=_block(block),
    )
    return replica_table(cols)


def routepack_replication(
    ctx: PlanContext,
    options: RoutepackReplicationOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    block: Block = None,
) -> np.ndarray:
    """routepack's replication. Exchanges not begun when ``ctx.time_budget_s`` (seconds from
    the call, None: no cap) is spent get no replicas. ``block``: see `Block`."""
    args = _common(ctx, options, RoutepackReplicationOptions, placement, sample_rank, sample_micro, num_micro)
    k = options.replication_candidates
    cols = _core.replicate_routepack(
        *args,
        replication_slots=options.replication_slots,
        candidate_experts=k,
        candidate_dsts=k,
        time_budget_s=ctx.time_budget_s,
        block=_block(block),
    )
    return replica_table(cols)


__all__ = [
    "Block",
    "HotNOptions",
    "RelibraReplicationOptions",
    "RoutepackReplicationOptions",
    "hot_n_replication",
    "no_replication",
    "relibra_replication",
    "replica_table",
    "routepack_replication",
]
