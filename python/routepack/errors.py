"""routepack's exception hierarchy (defined once, in the Rust bindings).

``RoutepackError`` is a ``ValueError``: bad input raises it (or ``TypeError`` for a wrong
type), naming the argument and the offending value. ``InvalidPlanError`` is raised by
``Plan.validate``; ``InfeasibleError`` when no plan can exist (a sample longer than the cap).
``RoutepackInternalError`` is a bug: a Rust panic caught at the boundary.
"""

from routepack._core import (
    InfeasibleError,
    InvalidPlanError,
    RoutepackError,
    RoutepackInternalError,
)

__all__ = ["RoutepackError", "InvalidPlanError", "InfeasibleError", "RoutepackInternalError"]
