"""The per-microbatch exact balancers of the replication stage (docs/design.md, Baselines): they
plan every exchange from the router's output, as their runtimes do on the device, so their plans
say ``replica_timing="after_router"`` (`REPLICA_TIMINGS`) and `simulate` exposes their forward
weight copies (nothing is left to hide them behind: the layer's attention ran before its router).

* ``moonep`` (`moonep_replication`, `MoonEpOptions`): MoonEP (vLLM PR 52101, Megatron-LM PR 7450).
  Per exchange and NVLink domain every rank computes exactly its share of the domain's routed
  tokens (S·K when every rank sends S): the most overloaded home fills the roomiest rank
  completely, and each home hands its quotas out from its hottest experts; at most
  ``replication_buffers`` distinct experts copied onto a rank (MoonEP's E / ep prefetch slots).
* ``ultraep`` (`ultraep_replication`, `UltraEpOptions`): UltraEP (xtuner PR 2050, arXiv
  2606.04101). Per exchange and NVLink domain, the smallest load threshold an export plan meets
  (binary search), each overloaded rank exporting quotas of its hottest experts to the ranks with
  the most slack, at most ``replication_redundant`` replicas a rank (half its own experts by
  default, as UltraEP's README configures it), each of at least
  ``replication_min_tokens`` tokens.

The algorithms are in the Rust core (``replication/moonep.rs``, ``replication/ultraep.rs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from routepack import _core
from routepack.plan import Placement
from routepack.stages.context import PlanContext
from routepack.stages.options import computed, count, option
from routepack.stages.options import StageOptions
from routepack.stages.replication import Block, _block, _common, replica_table

#: How a replication choice's copies move (`Plan.replica_timing`): those planned from the
#: router's output are fetched after it; every other choice's are prefetched.
REPLICA_TIMINGS: Dict[str, str] = {"moonep": "after_router", "ultraep": "after_router"}


@dataclass(frozen=True)
class MoonEpOptions(StageOptions):
    """Options of the ``moonep`` replication."""

    #: Prefetch buffers a rank (distinct experts copied onto it per exchange), >= 0; None, the
    #: default: MoonEP's own, ⌈E / ep⌉ (its `Buffer` holds `E / R` prefetch slots a rank). Capped
    #: by `Topology.replica_slots`: a plan is exact only with MoonEP's count.
    replication_buffers: Optional[int] = computed(count(0))


@dataclass(frozen=True)
class UltraEpOptions(StageOptions):
    """Options of the ``ultraep`` replication (defaults: UltraEP's, from the Rust core)."""

    #: Spare slots a rank (UltraEP's ``num_local_redundant_experts``), >= 0; None, the default:
    #: half a rank's own experts, ⌈⌈E / ep⌉ / 2⌉, the ratio of UltraEP's README example (4 master
    #: and 2 redundant experts a rank). Capped by `Topology.replica_slots`.
    replication_redundant: Optional[int] = computed(count(0))
    #: The least tokens a replica takes (``ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA``), >= 1.
    replication_min_tokens: int = option("replication", "replication_min_tokens", count(1))


def experts_per_rank(num_experts: int, ep: int) -> int:
    """MoonEP's prefetch slots a rank: ⌈E / ep⌉."""
    return -(-int(num_experts) // int(ep))


def moonep_replication(
    ctx: PlanContext,
    options: MoonEpOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    block: Block = None,
) -> np.ndarray:
    """MoonEP's exact per-microbatch balance (``block``: see `Block`)."""
    args = _common(ctx, options, MoonEpOptions, placement, sample_rank, sample_micro, num_micro)
    buffers = options.replication_buffers
    if buffers is None:
        buffers = experts_per_rank(ctx.window.num_experts, ctx.topo.ep)
    return replica_table(_core.replicate_moonep(*args, buffers, block=_block(block)))


def ultraep_replication(
    ctx: PlanContext,
    options: UltraEpOptions,
    placement: Placement,
    sample_rank: np.ndarray,
    sample_micro: np.ndarray,
    num_micro: int,
    block: Block = None,
) -> np.ndarray:
    """UltraEP's quota-driven exact-load balance (``block``: see `Block`)."""
    args = _common(ctx, options, UltraEpOptions, placement, sample_rank, sample_micro, num_micro)
    redundant = options.replication_redundant
    if redundant is None:
        redundant = -(-experts_per_rank(ctx.window.num_experts, ctx.topo.ep) // 2)
    cols = _core.replicate_ultraep(*args, redundant, options.replication_min_tokens, block=_block(block))
    return replica_table(cols)


__all__ = [
    "MoonEpOptions",
    "REPLICA_TIMINGS",
    "UltraEpOptions",
    "experts_per_rank",
    "moonep_replication",
    "ultraep_replication",
]
