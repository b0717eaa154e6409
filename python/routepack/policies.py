"""Policies: a choice per stage, and the named presets DESIGN.md compares.

A stage function takes a `PlanContext` (and what earlier stages produced) and returns its
part of the plan. Each stage registers its functions here by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class Policy:
    """placement: static | eplb | routepack; packing: sequential | kk | routepack;
    replication: none | hot_n | relibra | routepack."""

    placement: str = "static"
    packing: str = "sequential"
    replication: str = "none"
    #: Where placement loads come from: "window" (this window, an oracle), or "previous"
    #: (``previous_window=``, what history-based balancers do in practice).
    loads: str = "window"


@dataclass
class PlanContext:
    """Everything a stage may read."""

    window: Any
    topo: Any
    cost: Any
    token_cap: int
    previous: Any = None
    previous_window: Any = None
    seed: int = 0
    anneal_moves: Optional[int] = None
    time_budget_s: Optional[float] = None
    options: Dict[str, Any] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)
    #: What stages report about their decisions, by stage name (lands in plan.report).
    reports: Dict[str, Any] = field(default_factory=dict)

    def placement_loads(self) -> np.ndarray:
        """float64 ``[L, E]`` loads the placement stage balances."""
        if self.policy.loads == "previous":
            if self.previous_window is None:
                raise ValueError(
                    "previous_window: this policy plans placement from the previous window's loads; pass previous_window="
                )
            return self.previous_window.layer_expert_load()
        return self.window.layer_expert_load()


#: Packing returns (sample_rank [S], sample_micro [S], num_micro, report dict).
PackingResult = Tuple[np.ndarray, np.ndarray, int, Dict[str, Any]]

#: Every option name a stage accepts through ``plan_window(..., **options)``; each stage module
#: adds its own, and `plan_window` refuses names no stage knows (typos fail loudly).
KNOWN_OPTIONS: set = set()

PLACEMENTS: Dict[str, Callable[..., Any]] = {}
PACKINGS: Dict[str, Callable[..., PackingResult]] = {}
REPLICATIONS: Dict[str, Callable[..., np.ndarray]] = {}

#: Named presets: the systems of DESIGN.md's comparison table and ablations.
PRESETS: Dict[str, Policy] = {
    # Megatron-LM's default: expert e on rank e // ceil(E/ep), arrival-order first fit
    "static": Policy("static", "sequential", "none"),
    # DeepSeek EPLB placement + verl's Karmarkar-Karp balancing, from the previous window's
    # loads (what it does in practice) and from this window's loads (an oracle)
    "eplb": Policy("eplb", "kk", "none", loads="previous"),
    "eplb_oracle": Policy("eplb", "kk", "none", loads="window"),
    # MindSpeed's balanced MoE: N hot experts per microbatch and layer broadcast to every rank
    "hot_n": Policy("static", "sequential", "hot_n"),
    # ReLibra: node-level expert reordering per window + intra-node replication per microbatch;
    # both from routing replay, so from this window's loads (as its paper describes)
    "relibra": Policy("relibra", "sequential", "relibra", loads="window"),
    # ablations of routepack, as in the papers: placement alone, packing alone, both
    "routepack_placement": Policy("routepack", "sequential", "none"),
    "routepack_packing": Policy("static", "routepack", "none"),
    "routepack_no_replication": Policy("routepack", "routepack", "none"),
    # routepack: every stage, planned from this window's routing replay
    "routepack": Policy("routepack", "routepack", "routepack"),
}


def register_preset(name: str, policy: Policy) -> None:
    PRESETS[name] = policy


def resolve(policy: Any) -> Tuple[str, Policy]:
    """A preset name or a `Policy` → (name, Policy), checking every stage exists."""
    if isinstance(policy, Policy):
        name = f"{policy.placement}+{policy.packing}+{policy.replication}"
        pol = policy
    elif isinstance(policy, str):
        if policy not in PRESETS:
            raise ValueError(f"policy: unknown preset {policy!r}; known: {sorted(PRESETS)}")
        name, pol = policy, PRESETS[policy]
    else:
        raise TypeError(f"policy: expected a preset name or a Policy, got {type(policy).__name__}")
    for stage, table, choice in (
        ("placement", PLACEMENTS, pol.placement),
        ("packing", PACKINGS, pol.packing),
        ("replication", REPLICATIONS, pol.replication),
    ):
        if choice not in table:
            raise ValueError(f"policy.{stage}: unknown choice {choice!r}; known: {sorted(table)}")
    if pol.loads not in ("window", "previous"):
        raise ValueError(f"policy.loads: expected 'window' or 'previous', got {pol.loads!r}")
    return name, pol
