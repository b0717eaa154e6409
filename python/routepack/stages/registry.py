"""The stage registry: every stage choice by name, with its options dataclass.

The tables are written out here, by listing the stage functions; importing a stage module
registers nothing. A choice of your own is added at run time, explicitly::

    from routepack.stages import NoOptions, register_placement
    register_placement("mine", my_placement)            # f(ctx, options) -> Placement
    rp.plan_window(..., policy=rp.Policy(placement="mine"))

with ``register_packing`` (``f(ctx, options, placement)``) and ``register_replication``
(``f(ctx, options, placement, sample_rank, sample_micro, num_micro)``) for the other stages.
Pass a frozen `StageOptions` subclass as ``options`` to take options: its field names join
`known_options` and ``plan_window(**options)`` fills them.
"""

from __future__ import annotations

import warnings
from collections import abc
from dataclasses import fields
from typing import Any, Callable, Dict, FrozenSet, Mapping, NamedTuple, Tuple, Type

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.stages.options import NoOptions, StageOptions
from routepack.stages.packing import RoutepackPackingOptions, kk_packing, routepack_packing, sequential_packing
from routepack.stages.placement import (
    EplbOptions,
    RoutepackPlacementOptions,
    eplb_hierarchical_placement,
    eplb_placement,
    relibra_placement,
    routepack_placement,
    static_placement,
)
from routepack.stages.policy import Policy
from routepack.stages.replication_live import MoonEpOptions, UltraEpOptions, moonep_replication, ultraep_replication
from routepack.stages.replication import (
    HotNOptions,
    RelibraReplicationOptions,
    RoutepackReplicationOptions,
    hot_n_replication,
    no_replication,
    relibra_replication,
    routepack_replication,
)


class Stage(NamedTuple):
    """One stage choice: the function that runs it and the dataclass of its options."""

    run: Callable[..., Any]
    options: Type[StageOptions]


PLACEMENTS: Dict[str, Stage] = {
    "static": Stage(static_placement, NoOptions),
    "eplb": Stage(eplb_placement, EplbOptions),
    "eplb_hierarchical": Stage(eplb_hierarchical_placement, EplbOptions),
    "relibra": Stage(relibra_placement, NoOptions),
    "routepack": Stage(routepack_placement, RoutepackPlacementOptions),
}

PACKINGS: Dict[str, Stage] = {
    "sequential": Stage(sequential_packing, NoOptions),
    "kk": Stage(kk_packing, NoOptions),
    "routepack": Stage(routepack_packing, RoutepackPackingOptions),
}

REPLICATIONS: Dict[str, Stage] = {
    "none": Stage(no_replication, NoOptions),
    "hot_n": Stage(hot_n_replication, HotNOptions),
    "relibra": Stage(relibra_replication, RelibraReplicationOptions),
    "routepack": Stage(routepack_replication, RoutepackReplicationOptions),
    "moonep": Stage(moonep_replication, MoonEpOptions),
    "ultraep": Stage(ultraep_replication, UltraEpOptions),
}

#: The tables by stage name, in planning order.
STAGES: Dict[str, Dict[str, Stage]] = {"placement": PLACEMENTS, "packing": PACKINGS, "replication": REPLICATIONS}

#: Old option names → their stage-prefixed names (the old ones still work, with a
#: DeprecationWarning).
DEPRECATED_OPTIONS: Dict[str, str] = {
    "exact_nodes": "packing_exact_nodes",
    "replica_slots": "replication_slots",
    "hot_experts": "replication_hot_experts",
}


def known_options() -> FrozenSet[str]:
    """Every option name a registered stage choice takes (its options dataclass's fields)."""
    return frozenset(f.name for table in STAGES.values() for stage in table.values() for f in fields(stage.options))


#: The option names of the built-in stage choices (`known_options` also counts registered ones).
KNOWN_OPTIONS: FrozenSet[str] = known_options()


def _register(stage: str, name: str, fn: Callable[..., Any], options: Type[StageOptions]) -> None:
    table = STAGES[stage]
    if not isinstance(name, str) or not name:
        raise RoutepackTypeError(f"name: expected a non-empty str, got {name!r}")
    if name in table:
        raise RoutepackError(f"name: {stage} {name!r} is already registered; known: {sorted(table)}")
    if not callable(fn):
        raise RoutepackTypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if not (isinstance(options, type) and issubclass(options, StageOptions)):
        raise RoutepackTypeError(f"options: expected a StageOptions subclass, got {options!r}")
    table[name] = Stage(fn, options)


def register_placement(name: str, fn: Callable[..., Any], options: Type[StageOptions] = NoOptions) -> None:
    """Adds placement ``name``: ``fn(ctx, options) -> Placement``."""
    _register("placement", name, fn, options)


def register_packing(name: str, fn: Callable[..., Any], options: Type[StageOptions] = NoOptions) -> None:
    """Adds packing ``name``: ``fn(ctx, options, placement) -> (sample_rank, sample_micro,
    num_micro, report)``."""
    _register("packing", name, fn, options)


def register_replication(name: str, fn: Callable[..., Any], options: Type[StageOptions] = NoOptions) -> None:
    """Adds replication ``name``: ``fn(ctx, options, placement, sample_rank, sample_micro,
    num_micro) -> replicas``."""
    _register("replication", name, fn, options)


def canonical_options(options: Mapping[str, Any], stacklevel: int = 2) -> Dict[str, Any]:
    """``options`` under their current names: a deprecated name becomes its new one (with a
    DeprecationWarning naming it); an unknown name raises `RoutepackError` listing the valid
    ones. ``stacklevel`` is the warning's, counted from the caller of this function."""
    options = _options_mapping(options)
    known = known_options()
    out: Dict[str, Any] = {}
    for key, value in options.items():
        new = DEPRECATED_OPTIONS.get(key)
        if new is not None:
            warnings.warn(f"option {key!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=stacklevel + 1)
            if new in options:
                raise RoutepackError(f"options: {key!r} and {new!r} are the same option; pass only {new!r}")
            key = new
        out[key] = value
    unknown = set(out) - known
    if unknown:
        raise RoutepackError(f"options: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    return out


def stage_options(policy: Policy, options: Mapping[str, Any]) -> Tuple[StageOptions, StageOptions, StageOptions]:
    """The typed options of the policy's (placement, packing, replication) from canonical
    ``options``. Every registered options class checks its fields, so a bad value raises
    whichever stages the policy runs; ``policy`` must name registered choices
    (`check_policy`) and ``options`` be a mapping."""
    check_policy(policy)
    options = _options_mapping(options)
    built: Dict[type, StageOptions] = {}
    for table in STAGES.values():
        for stage in table.values():
            cls = stage.options
            if cls not in built:
                names = {f.name for f in fields(cls)}
                built[cls] = cls(**{k: v for k, v in options.items() if k in names})
    return (
        built[PLACEMENTS[policy.placement].options],
        built[PACKINGS[policy.packing].options],
        built[REPLICATIONS[policy.replication].options],
    )


def _options_mapping(options: Any) -> Mapping[str, Any]:
    """``options`` if it is a mapping with str keys, else an error naming ``options``."""
    if not isinstance(options, abc.Mapping):
        raise RoutepackTypeError(
            f"options: expected a mapping of option names to values, got {type(options).__name__} {options!r:.80}"
        )
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise RoutepackTypeError(f"options: option names are str, got {bad[0]!r} ({type(bad[0]).__name__})")
    return options


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is a `Policy` whose every stage choice is a registered name and whose
    ``loads`` is "window" or "previous", else an error naming the field (``policy.packing``)."""
    if not isinstance(policy, Policy):
        raise RoutepackTypeError(f"policy: expected a routepack.Policy, got {type(policy).__name__} {policy!r:.80}")
    for stage, table in STAGES.items():
        choice = getattr(policy, stage)
        if not isinstance(choice, str):
            raise RoutepackTypeError(
                f"policy.{stage}: expected a str naming a {stage} choice, got "
                f"{type(choice).__name__} {choice!r:.80}; known: {sorted(table)}"
            )
        if choice not in table:
            raise RoutepackError(f"policy.{stage}: unknown choice {choice!r}; known: {sorted(table)}")
    if not isinstance(policy.loads, str) or policy.loads not in ("window", "previous"):
        raise RoutepackError(f"policy.loads: expected 'window' or 'previous', got {policy.loads!r:.80}")
    if not isinstance(policy.choose, bool):
        raise RoutepackTypeError(f"policy.choose: expected a bool, got {type(policy.choose).__name__}")
    return policy


__all__ = [
    "DEPRECATED_OPTIONS",
    "KNOWN_OPTIONS",
    "PACKINGS",
    "PLACEMENTS",
    "REPLICATIONS",
    "STAGES",
    "Stage",
    "canonical_options",
    "check_policy",
    "known_options",
    "register_packing",
    "register_placement",
    "register_replication",
    "stage_options",
]
