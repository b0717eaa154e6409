"""routepack's exception hierarchy (defined once, in the Rust bindings).

``RoutepackError`` is a ``ValueError``: every input error raises it or a subclass, naming the
argument and the offending value; a wrong type raises ``RoutepackTypeError``, which is also a
``TypeError``. ``InvalidPlanError`` is raised by
``Plan.validate``; ``InfeasibleError`` when no plan can exist (a sample longer than the cap).
``RoutepackInternalError`` is a bug: a Rust panic caught at the boundary.
"""

from routepack._core import (
    InfeasibleError,
    InvalidPlanError,
    RoutepackError,
    RoutepackInternalError,
    RoutepackTypeError,
)

__all__ = ["RoutepackError", "InvalidPlanError", "InfeasibleError", "RoutepackInternalError",
           "RoutepackTypeError"]
