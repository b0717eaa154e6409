"""Replication: re-exports of `routepack.stages.replication` (the ``none``, ``hot_n``,
``relibra`` and ``routepack`` replications, their options and `replica_table`), and ReLibra's
placement from `routepack.stages.placement`.

``DEFAULT_HOT_EXPERTS`` and ``DEFAULT_REPLICA_SLOTS`` are the core's defaults of the options
``replication_hot_experts`` and ``replication_slots``.
"""

from routepack.stages.options import DEFAULTS
from routepack.stages.placement import relibra_placement
from routepack.stages.replication import (
    HotNOptions,
    RelibraReplicationOptions,
    RoutepackReplicationOptions,
    hot_n_replication,
    no_replication,
    relibra_replication,
    replica_table,
    routepack_replication,
)

DEFAULT_HOT_EXPERTS: int = DEFAULTS["replication"]["replication_hot_experts"]
DEFAULT_REPLICA_SLOTS: int = DEFAULTS["replication"]["replication_slots"]

__all__ = [
    "DEFAULT_HOT_EXPERTS",
    "DEFAULT_REPLICA_SLOTS",
    "HotNOptions",
    "RelibraReplicationOptions",
    "RoutepackReplicationOptions",
    "hot_n_replication",
    "no_replication",
    "relibra_placement",
    "relibra_replication",
    "replica_table",
    "routepack_replication",
]
