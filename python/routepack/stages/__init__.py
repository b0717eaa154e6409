"""The planning stages, one module each, and their registry.

* `routepack.stages.placement`: where experts live (``static``, ``eplb``, ``relibra``,
  ``routepack``).
* `routepack.stages.packing`: samples into rows and rows onto cells (``sequential``, ``kk``,
  ``routepack``).
* `routepack.stages.replication`: intra-batch copies per exchange (``none``, ``hot_n``,
  ``relibra``, ``routepack``).
* `routepack.stages.registry`: the tables of choices by name (function, options dataclass),
  written out by listing them, and ``register_*`` to add one at run time.
* `routepack.stages.options`: the options dataclasses' base, checks and the core's defaults.

Each stage choice takes one frozen options dataclass; ``plan_window(**options)`` fills it by
field name (stage-prefixed: ``placement_*``, ``eplb_*``, ``anneal_*``, ``packing_*``,
``replication_*``).
"""

from routepack.stages.context import PackingResult, PlanContext
from routepack.stages.options import DEFAULTS, NoOptions, StageOptions
from routepack.stages.packing import (
    DEFAULT_ANNEAL_MOVES,
    DEFAULT_ANNEAL_MOVES_ACROSS_NODES,
    RoutepackPackingOptions,
    kk_packing,
    routepack_packing,
    sequential_packing,
)
from routepack.stages.placement import (
    EplbOptions,
    RoutepackPlacementOptions,
    eplb_placement,
    relibra_placement,
    routepack_placement,
    static_placement,
)
from routepack.stages.policy import Policy
from routepack.stages.registry import (
    DEPRECATED_OPTIONS,
    KNOWN_OPTIONS,
    PACKINGS,
    PLACEMENTS,
    REPLICATIONS,
    STAGES,
    Stage,
    canonical_options,
    known_options,
    register_packing,
    register_placement,
    register_replication,
    stage_options,
)
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
from routepack.stages.replication_live import MoonEpOptions, UltraEpOptions, moonep_replication, ultraep_replication

__all__ = [
    "DEFAULTS",
    "DEFAULT_ANNEAL_MOVES",
    "DEFAULT_ANNEAL_MOVES_ACROSS_NODES",
    "DEPRECATED_OPTIONS",
    "EplbOptions",
    "HotNOptions",
    "KNOWN_OPTIONS",
    "MoonEpOptions",
    "NoOptions",
    "PACKINGS",
    "PLACEMENTS",
    "PackingResult",
    "PlanContext",
    "Policy",
    "REPLICATIONS",
    "RelibraReplicationOptions",
    "RoutepackPackingOptions",
    "RoutepackPlacementOptions",
    "RoutepackReplicationOptions",
    "STAGES",
    "Stage",
    "StageOptions",
    "UltraEpOptions",
    "canonical_options",
    "eplb_placement",
    "hot_n_replication",
    "kk_packing",
    "known_options",
    "moonep_replication",
    "no_replication",
    "register_packing",
    "register_placement",
    "register_replication",
    "relibra_placement",
    "relibra_replication",
    "replica_table",
    "routepack_packing",
    "routepack_placement",
    "routepack_replication",
    "sequential_packing",
    "stage_options",
    "static_placement",
    "ultraep_replication",
]
