"""Replication: re-exports of `routepack.stages.replication` (the ``none``, ``hot_n``,
``relibra`` and ``routepack`` replications, their options and `replica_table`), and ReLibra's
placement from `routepack.stages.placement`.

``DEFAULT_HOT_EXPERTS`` and ``DEFAULT_REPLICATION_SLOTS`` are the core's defaults of the options
``replication_hot_experts`` and ``replication_slots``. ``DEFAULT_REPLICA_SLOTS``, the old name
of the second, still works with a DeprecationWarning (``replica_slots`` now names only the
topology's replica buffers, `routepack.Topology.replica_slots`).
"""

from routepack._deprecation import module_aliases
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
DEFAULT_REPLICATION_SLOTS: int = DEFAULTS["replication"]["replication_slots"]

#: The deprecated names of this module (`routepack._deprecation.module_aliases`).
__getattr__ = module_aliases(__name__, {"DEFAULT_REPLICA_SLOTS": "DEFAULT_REPLICATION_SLOTS"})


__all__ = [
    "DEFAULT_HOT_EXPERTS",
    "DEFAULT_REPLICATION_SLOTS",
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
