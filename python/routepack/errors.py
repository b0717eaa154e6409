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


class RoutepackFileError(RoutepackError):
    """A file `Window.load` or `Plan.load` reads is damaged (not a zip, truncated, missing
    arrays, pickled objects, a header claiming more data than the file holds, or contents
    that fail the class's checks). The message names the path and what is wrong. Defined in
    Python, on top of the core's `RoutepackError`, since only the Python side reads files."""


__all__ = [
    "RoutepackError",
    "InvalidPlanError",
    "InfeasibleError",
    "RoutepackFileError",
    "RoutepackInternalError",
    "RoutepackTypeError",
]
