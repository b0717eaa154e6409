"""Samples longer than the token cap (docs/design.md, "Samples over the cap").

``plan_window(..., oversize=...)``:

* ``"refuse"`` (the default, also None): such a sample makes the window infeasible; the
  `InfeasibleError` names it and suggests "alone".
* ``"alone"``: it runs in a microbatch of its own (as slime does). Every packing builds its rows
  with its length counted as the cap, so nothing else fits beside it, and the row count's lower
  bound and certificate are those of a problem in which it must run alone; it is priced at its
  real length. `Plan.validate` then accepts a cell over the cap that holds one sample.

The mode a plan was made with is in ``plan.report["oversize"]`` (``{"mode", "samples",
"token_cap"}``); `Plan.validate` and `simulate` read it from there when not told.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from routepack.errors import RoutepackError, RoutepackTypeError

#: ``oversize`` values: refuse the window, run the sample alone.
OVERSIZE_MODES = ("refuse", "alone")


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


def report(mode: str, seq_lens: np.ndarray, token_cap: int, **extra: Any) -> Dict[str, Any]:
    """What ``plan.report["oversize"]`` holds: the mode, the samples over the cap and the cap."""
    return {"mode": mode, "samples": over_cap(seq_lens, token_cap).tolist(), "token_cap": int(token_cap), **extra}


__all__ = ["OVERSIZE_MODES", "over_cap", "oversize_mode", "plan_mode", "report"]
