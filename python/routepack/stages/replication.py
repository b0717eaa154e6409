"""Replication stage (docs/design.md stage 4): intra-batch copies of hot experts per exchange.

Every choice has the signature ``f(ctx, options, placement, sample_rank, sample_micro,
num_micro) -> replicas`` and returns a structured array of `REPLICA_DTYPE` entries: in step
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
from typing import Any, Tuple

import numpy as np

from routepack import _core
from routepack.plan import REPLICA_DTYPE, Placement, empty_replicas
from routepack.stages.context import PlanContext
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

    #: Copies a rank may hold per (step, layer), >= 0.
    replication_slots: int = option("replication", "replication_slots", count(0))


@dataclass(frozen=True)
class RoutepackReplicationOptions(StageOptions):
    """Options of the ``routepack`` replication (defaults: the Rust core's)."""

    #: Copies a rank may hold per (step, layer), >= 0.
    replication_slots: int = option("replication", "replication_slots", count(0))
    #: Experts and destinations tried per bottleneck list and step, >= 1 (quality vs time:
    #: the default keeps a `flash` plan near 1 s; 2 finds a little more on static placements
    #: at about twice the time).
    replication_candidates: int = option("replication", "replication_candidates", count(1))


def replica_table(columns: tuple) -> np.ndarray:
    """Columns ``(micro, group, layer, expert, src_rank, dst_rank: int32 [N], share: float32
    [N])`` → structured array of `REPLICA_DTYPE` [N]."""
    table = np.zeros(len(columns[0]), dtype=REPLICA_DTYPE)
    for name, col in zip(REPLICA_DTYPE.names, columns):
        table[name] = col
    return table


def _common(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray, sample_micro: np.ndarray,
            num_micro: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, Any, Any]:
    w = ctx.window
    return (w.seq_lens, w.expert_tokens, placement.phy2log,
            np.ascontiguousarray(sample_rank, dtype=np.int32),
            np.ascontiguousarray(sample_micro, dtype=np.int32), int(num_micro), ctx.topo, ctx.cost)


def no_replication(ctx: PlanContext, options: NoOptions, placement: Placement, sample_rank: np.ndarray,
                   sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """No copies."""
    return empty_replicas()


def hot_n_replication(ctx: PlanContext, options: HotNOptions, placement: Placement, sample_rank: np.ndarray,
                      sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """MindSpeed's hot-expert broadcast."""
    cols = _core.replicate_hot_n(*_common(ctx, placement, sample_rank, sample_micro, num_micro),
                                 options.replication_hot_experts)
    return replica_table(cols)


def relibra_replication(ctx: PlanContext, options: RelibraReplicationOptions, placement: Placement,
                        sample_rank: np.ndarray, sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """ReLibra's intra-node replication."""
    cols = _core.replicate_relibra(*_common(ctx, placement, sample_rank, sample_micro, num_micro),
                                   options.replication_slots)
    return replica_table(cols)


def routepack_replication(ctx: PlanContext, options: RoutepackReplicationOptions, placement: Placement,
                          sample_rank: np.ndarray, sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    """routepack's replication. Exchanges not begun when ``ctx.time_budget_s`` (seconds from
    the call, None: no cap) is spent get no replicas."""
    k = options.replication_candidates
    cols = _core.replicate_routepack(*_common(ctx, placement, sample_rank, sample_micro, num_micro),
                                     replica_slots=options.replication_slots, candidate_experts=k,
                                     candidate_dsts=k, time_budget_s=ctx.time_budget_s)
    return replica_table(cols)


__all__ = ["HotNOptions", "RelibraReplicationOptions", "RoutepackReplicationOptions", "hot_n_replication",
           "no_replication", "relibra_replication", "replica_table", "routepack_replication"]
