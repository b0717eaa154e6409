"""What the trainer adapters (`verl`, `slime`, `megatron`) share: turning a trainer's
tensors into numpy without importing torch, and reading a plan's cells in execution order.
numpy, errors and `_checks` only; no framework is imported here."""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from routepack._checks import instance_of, positive_int
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.oversize import refuse_split
from routepack.plan import Plan


def as_numpy(value: Any, name: str) -> np.ndarray:
    """``value`` (a numpy array, a torch tensor on any device, or a nested sequence) as a
    numpy array; torch is never imported (a tensor is recognised by its ``detach``/``cpu``)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        if getattr(value, "is_nested", False):
            raise RoutepackTypeError(f"{name}: a nested (jagged) tensor; pass the padded [B, T, ...] tensor")
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise RoutepackTypeError(f"{name}: cannot be read as an array ({e})") from None


def require(module: str, what: str, extra: str) -> Any:
    """``module`` imported, or an ImportError saying that ``what`` needs it and which extra
    installs it (the frameworks are optional: only the functions that build their objects
    import them)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {module.split('.')[0]}: pip install 'routepack[{extra}]' ({e})") from e


def plans_list(plans: Any, name: str = "plans") -> List[Plan]:
    """One `Plan` or a non-empty sequence of them, as a list (each checked to be a Plan, and
    refused where it splits samples over context-parallel groups: no trainer glue runs that)."""
    if isinstance(plans, Plan):
        refuse_split(plans, name)
        return [plans]
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence):
        raise RoutepackTypeError(f"{name}: expected a Plan or a list of Plans, got {type(plans).__name__}")
    if len(plans) == 0:
        raise RoutepackError(f"{name}: expected at least one Plan, got none")
    for i, p in enumerate(plans):
        instance_of(p, Plan, f"{name}[{i}]")
        refuse_split(p, f"{name}[{i}]")
    return list(plans)


def num_ranks(plan: Plan, name: str = "plan") -> int:
    """DP ranks of ``plan``: one past the largest rank a sample runs on (every rank has a
    sample: a plan has no empty cell)."""
    if plan.num_samples == 0:
        raise RoutepackError(f"{name}: has no samples")
    return int(plan.sample_rank.max()) + 1


def rank_cells(plan: Plan, rank: int, name: str = "plan") -> List[np.ndarray]:
    """The samples (global indices, ascending) of each microbatch step of DP rank ``rank``,
    steps in execution order 0..M-1. A step without samples (a plan that did not pass
    `Plan.validate`) is refused: every trainer here runs a microbatch per step; so is a plan
    made with ``oversize="split"`` (its samples span the ranks of a CP group, which no trainer
    glue here runs)."""
    refuse_split(plan, name)
    rank = positive_int(rank, "dp_rank", minimum=0)
    ranks = num_ranks(plan, name)
    if rank >= ranks:
        raise RoutepackError(f"dp_rank: {rank} is not a DP rank of {name} (it has {ranks})")
    mine = np.flatnonzero(plan.sample_rank == rank)
    order = mine[np.argsort(plan.sample_micro[mine], kind="stable")]
    steps = plan.sample_micro[order]
    cells = np.split(order, np.flatnonzero(np.diff(steps)) + 1)
    if len(cells) != plan.num_micro or int(steps[0]) != 0:
        raise RoutepackError(
            f"{name}: DP rank {rank} runs {len(np.unique(steps))} of its {plan.num_micro} microbatch steps; "
            "a plan from plan_window (or one that passed Plan.validate) has no empty cell"
        )
    return cells


def rank_order(plan: Plan, rank: int, name: str = "plan") -> np.ndarray:
    """int64 ``[S_r]``: rank ``rank``'s samples (global indices) in execution order: step by
    step, ascending inside a step. This is the order the rank receives its samples in."""
    return np.concatenate(rank_cells(plan, rank, name)).astype(np.int64)


def local_micro_indices(plan: Plan, rank: int, name: str = "plan") -> List[List[int]]:
    """Per step of rank ``rank`` (execution order), the positions of its samples in
    `rank_order` (so the lists tile ``range(S_r)`` in order)."""
    out, start = [], 0
    for cell in rank_cells(plan, rank, name):
        out.append(list(range(start, start + len(cell))))
        start += len(cell)
    return out


__all__ = ["as_numpy", "local_micro_indices", "num_ranks", "plans_list", "rank_cells", "rank_order", "require"]
