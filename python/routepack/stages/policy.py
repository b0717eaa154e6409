"""`Policy`: the choice made for each stage (names in the stage registry)."""

from __future__ import annotations

from dataclasses import dataclass


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
    loads: str = "window"


__all__ = ["Policy"]
