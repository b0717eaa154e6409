"""`Policy`: the choice made for each stage (names in the stage registry)."""

from __future__ import annotations

from dataclasses import dataclass


#: Where placement loads come from by default: this window's (see `Policy.loads`).
DEFAULT_LOADS = "window"


@dataclass(frozen=True)
class Policy:
    """placement: static | eplb | eplb_hierarchical | relibra | routepack; packing: sequential | kk | routepack;
    replication: none | hot_n | relibra | routepack (or any name registered with
    `routepack.stages.register_placement` and its siblings)."""

    placement: str = "static"
    packing: str = "sequential"
    replication: str = "none"
    #: Where placement loads come from: "window" (this window, an oracle), or "previous"
    #: (``previous_window=``, what history-based balancers do in practice).
    loads: str = DEFAULT_LOADS
    #: Whether the planner scores candidate stage outputs (the packing's own and verl's KK;
    #: with routepack's placement, also the placement in force) by `simulate` and keeps the
    #: fastest (`routepack.choice`): the ``routepack`` preset is the best of its own stages.
    choose: bool = False


__all__ = ["DEFAULT_LOADS", "Policy"]
