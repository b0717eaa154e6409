"""Samples longer than the token cap (docs/design.md, "Samples over the cap").

``plan_window(..., oversize=...)``:

* ``"refuse"`` (the default, also None): such a sample makes the window infeasible; the
  `InfeasibleError` names it and suggests "alone" and "split".
* ``"alone"``: it runs in a microbatch of its own (as slime does). Every packing builds its rows
  with its length counted as the cap, so nothing else fits beside it, and the row count's lower
  bound and certificate are those of a problem in which it must run alone; it is priced at its
  real length. `Plan.validate` then accepts a cell over the cap that holds one sample.
* ``"split"``: it is split over a context-parallel group (``Topology(cp=...)``, cp >= 2): the
  ``cp`` consecutive DP ranks of one CP group run it at one microbatch, rank j of the group
  holding ``n // cp`` of its tokens plus one for j < ``n % cp``, and nothing else runs in those
  cells. The plan records it at the group's first rank; the group's other cells at that
  microbatch hold no sample of the plan's arrays. It needs ``cp <= n <= cp * token_cap``.
  `simulate` prices it as ring attention (the core's ``split`` module; docs/design.md).

The mode a plan was made with is in ``plan.report["oversize"]`` (``{"mode", "samples",
"token_cap"}``); `Plan.validate` and `simulate` read it from there when not told.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from routepack.errors import RoutepackError, RoutepackTypeError

#: ``oversize`` values: refuse the window, run the sample alone, split it over a CP group.
OVERSIZE_MODES = ("refuse", "alone", "split")


def oversize_mode(value: Any, name: str = "oversize") -> str:
    """``value`` (None, a mode name, or a plan report's ``{"mode": ...}``) as a mode of
    `OVERSIZE_MODES`; None is "refuse"."""
    if isinstance(value, dict):
        value = value.get("mode")
        name = f"{name}['mode']"
    if value is None:
        return "refuse"
    if not isinstance(value, str):
        raise RoutepackTypeError(f"{name}: expected one of {OVERSIZE_MODES}, got {type(value).__name__} {value!r}")
    if value not in OVERSIZE_MODES:
        raise RoutepackError(f"{name}: {value!r} is not one of {OVERSIZE_MODES}")
    return value


def plan_mode(plan: Any, oversize: Optional[Any] = None) -> str:
    """The mode ``oversize`` names, else the one ``plan.report`` records, else "refuse"."""
    if oversize is not None:
        return oversize_mode(oversize)
    return oversize_mode(plan.report.get("oversize"), "plan.report['oversize']")


def over_cap(seq_lens: np.ndarray, token_cap: int) -> np.ndarray:
    """int64 indices of the samples longer than ``token_cap``, ascending."""
    return np.flatnonzero(np.asarray(seq_lens) > token_cap).astype(np.int64)


def refusal(s: int, n: int, token_cap: int) -> str:
    """The words of the `InfeasibleError` for sample ``s`` of ``n`` tokens over ``token_cap``
    (the core's packers say the same)."""
    return (
        f"sample {s} has {n} tokens, more than token_cap = {token_cap}; raise the cap, or plan with "
        'oversize="alone" (it runs in a microbatch of its own) or oversize="split" (split over a '
        "context-parallel group, topo.cp >= 2)"
    )


def refuse_split(plan: Any, where: str) -> None:
    """Raises `RoutepackError` when ``plan`` splits samples over context-parallel groups
    (``plan.report["oversize"]["mode"] == "split"``): ``where`` (a trainer's glue) runs each
    sample on one rank and does not execute context parallelism."""
    over = plan.report.get("oversize") if isinstance(getattr(plan, "report", None), dict) else None
    if isinstance(over, dict) and over.get("mode") == "split":
        raise RoutepackError(
            f'{where}: the plan was made with oversize="split" (samples {over.get("samples")} split over '
            "context-parallel groups), which this glue does not execute (it runs each sample on one rank); "
            'plan with oversize="alone"'
        )


def split_view(window: Any, token_cap: int, cp: int, sample_rank: np.ndarray, sample_micro: np.ndarray) -> Any:
    """``(pieces, rank, micro)``: the window of a plan's pieces, each sample over ``token_cap``
    split into ``cp`` (its routed tokens in proportion), and each piece's cell, piece j of a
    split sample on its rank + j (the core's ``split`` module). What a stage that reads cells
    (replication) plans on under "split"."""
    from routepack import _core
    from routepack.window import Window

    lens, counts, rank, micro = _core.split_pieces(
        window.seq_lens, window.counts, token_cap, cp, sample_rank, sample_micro
    )
    return Window(lens, counts), rank, micro


def report(mode: str, seq_lens: np.ndarray, token_cap: int, **extra: Any) -> Dict[str, Any]:
    """What ``plan.report["oversize"]`` holds: the mode, the samples over the cap and the cap."""
    return {"mode": mode, "samples": over_cap(seq_lens, token_cap).tolist(), "token_cap": int(token_cap), **extra}


__all__ = [
    "OVERSIZE_MODES",
    "over_cap",
    "oversize_mode",
    "plan_mode",
    "refusal",
    "refuse_split",
    "report",
    "split_view",
]
