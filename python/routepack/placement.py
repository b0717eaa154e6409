"""Placement analysis: DeepSeek EPLB's entry point, and how balanced a placement is.

The placement stage choices (``static``, ``eplb``, ``relibra``, ``routepack``) and their
options live in `routepack.stages.placement`; they are re-exported here.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from routepack import _core
from routepack._checks import instance_of, loads_array, positive_int
from routepack.model import Topology
from routepack.plan import Placement
from routepack.stages.placement import (
    EplbOptions,
    RoutepackPlacementOptions,
    eplb_placement,
    relibra_placement,
    routepack_placement,
    static_placement,
)


def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's entry point, same arguments and results (computed in Rust).

    Args:
        weight: ``[L, E]`` load of each logical expert (any numeric dtype; used as float64).
        num_replicas: physical slots R per layer, a multiple of ``num_gpus``.
        num_groups: expert groups; hierarchical policy when ``num_groups % num_nodes == 0``.
        num_nodes, num_gpus: ``num_gpus`` a multiple of ``num_nodes``.

    Returns:
        ``phy2log`` int64 ``[L, R]`` (slot p on GPU ``p // (R // num_gpus)``), ``log2phy``
        int64 ``[L, E, X]`` padded with -1 (X = the largest replica count), ``logcnt`` int64
        ``[L, E]``.
    """
    w = loads_array(weight, "weight")
    return _core.rebalance_experts(
        w,
        positive_int(num_replicas, "num_replicas"),
        positive_int(num_groups, "num_groups"),
        positive_int(num_nodes, "num_nodes"),
        positive_int(num_gpus, "num_gpus"),
    )


def aggregate_imbalance(placement: Placement, loads: Any) -> np.ndarray:
    """float64 ``[L]``: max / mean over EP ranks of window load per rank (each expert's
    ``loads [L, E]`` split evenly over its replicas)."""
    instance_of(placement, Placement, "placement")._check_fields("placement")
    return _core.aggregate_imbalance(
        placement.phy2log, placement.num_experts, placement.slots_per_rank, loads_array(loads, "loads")
    )


def imbalance_lower_bound(loads: Any, topo: Any) -> np.ndarray:
    """float64 ``[L]``: the lowest aggregate imbalance any placement on ``topo`` can reach,
    max(mean rank load, optimal largest per-replica load) / mean rank load."""
    instance_of(topo, Topology, "topo")
    return _core.imbalance_lower_bound(loads_array(loads, "loads"), topo.num_slots, topo.ep)


__all__ = [
    "EplbOptions",
    "RoutepackPlacementOptions",
    "aggregate_imbalance",
    "eplb_placement",
    "imbalance_lower_bound",
    "rebalance_experts",
    "relibra_placement",
    "routepack_placement",
    "static_placement",
]
