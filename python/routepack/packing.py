"""Packing: re-exports of `routepack.stages.packing` (the ``sequential``, ``kk`` and
``routepack`` packings, `RoutepackPackingOptions` and `DEFAULT_ANNEAL_MOVES`)."""

from routepack.stages.packing import (
    DEFAULT_ANNEAL_MOVES,
    DEFAULT_ANNEAL_MOVES_ACROSS_NODES,
    RoutepackPackingOptions,
    kk_packing,
    routepack_packing,
    sequential_packing,
)

__all__ = [
    "DEFAULT_ANNEAL_MOVES",
    "DEFAULT_ANNEAL_MOVES_ACROSS_NODES",
    "RoutepackPackingOptions",
    "kk_packing",
    "routepack_packing",
    "sequential_packing",
]
