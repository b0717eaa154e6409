"""Old public names that still work: each use warns once per call site with a
DeprecationWarning naming the new name (CHANGELOG.md, "Deprecated", lists them all).

Renamed options of `plan_window` are `routepack.stages.registry.DEPRECATED_OPTIONS`; renamed
module attributes go through `module_aliases`."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Dict


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated in favour of ``new`` (``stacklevel`` as `warnings.warn`'s,
    counted from the caller of this function's caller by default)."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


def module_aliases(module: str, aliases: Dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) under which each old name in ``aliases`` (old -> new)
    returns the module's attribute of the new name, with a DeprecationWarning; any other
    missing name raises `AttributeError` as usual."""

    def __getattr__(name: str) -> Any:
        new = aliases.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        renamed(f"{module}.{name}", f"{module}.{new}")
        return getattr(sys.modules[module], new)

    return __getattr__
