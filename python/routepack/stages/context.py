"""`PlanContext`: everything a stage function may read, and the stage signatures' types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from routepack.errors import RoutepackError
from routepack.stages.policy import Policy

#: Packing returns (sample_rank [S], sample_micro [S], num_micro, report dict).
PackingResult = Tuple[np.ndarray, np.ndarray, int, Dict[str, Any]]


@dataclass
class PlanContext:
    """Everything a stage may read. A stage's own options arrive as its typed options
    dataclass (the stage function's second argument); ``options`` holds every option
    ``plan_window`` was given, under its current (stage-prefixed) name."""

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
                raise RoutepackError(
                    "previous_window: this policy plans placement from the previous window's loads; pass previous_window="
                )
            return self.previous_window.layer_expert_load()
        return self.window.layer_expert_load()

    def demand_window(self) -> Any:
        """The window whose samples gave `placement_loads` (None when it is missing)."""
        return self.previous_window if self.policy.loads == "previous" else self.window


__all__ = ["PackingResult", "PlanContext"]
