"""Policies: a choice per stage, and the named presets docs/design.md compares.

The stage functions and their options live in `routepack.stages` (one module per stage, an
explicit registry); this module holds the presets and resolves a policy against the registry.
`PlanContext`, `KNOWN_OPTIONS` and the ``PLACEMENTS``/``PACKINGS``/``REPLICATIONS`` tables are
re-exported from there.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.stages.context import PackingResult, PlanContext
from routepack.stages.policy import Policy
from routepack.stages.registry import KNOWN_OPTIONS, PACKINGS, PLACEMENTS, REPLICATIONS, check_policy, known_options

#: Named presets: the systems of docs/design.md's comparison table and ablations.
PRESETS: Dict[str, Policy] = {
    # Megatron-LM's default: expert e on rank e // ceil(E/ep), arrival-order first fit
    "static": Policy("static", "sequential", "none"),
    # DeepSeek EPLB placement + verl's Karmarkar-Karp balancing, from the previous window's
    # loads (what it does in practice) and from this window's loads (an oracle)
    "eplb": Policy("eplb", "kk", "none", loads="previous"),
    "eplb_oracle": Policy("eplb", "kk", "none", loads="window"),
    # the same with one expert group per node (EPLB's hierarchical policy on groups the model
    # does not have): the other configuration of the baseline; `eplb` is hierarchical already
    # for a model that routes with groups the nodes divide (DeepSeek-V3: 8)
    "eplb_hierarchical": Policy("eplb_hierarchical", "kk", "none", loads="previous"),
    "eplb_hierarchical_oracle": Policy("eplb_hierarchical", "kk", "none", loads="window"),
    # MindSpeed's balanced MoE: N hot experts per microbatch and layer broadcast to every rank
    "hot_n": Policy("static", "sequential", "hot_n"),
    # ReLibra: node-level expert reordering per window + intra-node replication per microbatch;
    # both from routing replay, so from this window's loads (as its paper describes)
    "relibra": Policy("relibra", "sequential", "relibra", loads="window"),
    # the per-microbatch exact balancers (docs/design.md, Baselines): MoonEP and UltraEP keep
    # parameter and optimizer ownership where the model put it (Megatron's static placement),
    # balance every exchange from the router's output inside each NVLink domain, and run under
    # the trainer's packing (verl's Karmarkar-Karp, what RL users' dynamic batches get)
    "moonep": Policy("static", "kk", "moonep", loads="window"),
    "ultraep": Policy("static", "kk", "ultraep", loads="window"),
    # ablations of routepack, as in the papers: placement alone, packing alone, both
    "routepack_placement": Policy("routepack", "sequential", "none"),
    "routepack_packing": Policy("static", "routepack", "none"),
    "routepack_no_replication": Policy("routepack", "routepack", "none"),
    # routepack: every stage, planned from this window's routing replay; the planner keeps the
    # fastest of its stages' candidates by simulate (routepack.choice)
    "routepack": Policy("routepack", "routepack", "routepack", choose=True),
}


def register_preset(name: str, policy: Policy) -> None:
    """Adds (or replaces) preset ``name`` (a non-empty str): `resolve` and ``plan_window``
    then take ``name`` as ``policy``. Its stage choices are checked when it is resolved (a
    choice may be registered after the preset)."""
    if not isinstance(name, str) or not name:
        raise RoutepackTypeError(f"name: expected a non-empty str, got {type(name).__name__} {name!r:.80}")
    if not isinstance(policy, Policy):
        raise RoutepackTypeError(f"policy: expected a Policy, got {type(policy).__name__}")
    PRESETS[name] = policy


def resolve(policy: Any) -> Tuple[str, Policy]:
    """A preset name or a `Policy` → (name, Policy), checking every stage exists
    (`routepack.stages.registry.check_policy`)."""
    if isinstance(policy, Policy):
        pol = check_policy(policy)
        name = f"{policy.placement}+{policy.packing}+{policy.replication}" + ("+choose" if policy.choose else "")
    elif isinstance(policy, str):
        if policy not in PRESETS:
            raise RoutepackError(f"policy: unknown preset {policy!r}; known: {sorted(PRESETS)}")
        name, pol = policy, check_policy(PRESETS[policy])
    else:
        raise RoutepackTypeError(f"policy: expected a preset name or a Policy, got {type(policy).__name__}")
    return name, pol


__all__ = [
    "KNOWN_OPTIONS",
    "PACKINGS",
    "PLACEMENTS",
    "PRESETS",
    "PackingResult",
    "PlanContext",
    "Policy",
    "REPLICATIONS",
    "known_options",
    "register_preset",
    "resolve",
]
