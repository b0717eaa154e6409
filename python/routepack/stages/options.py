"""What every stage's options dataclass shares: the defaults, read once from the Rust core,
and the checks a field declares.

Each stage choice has one frozen dataclass of options (a subclass of `StageOptions`). A
field's default is read from `DEFAULTS` (the core's ``Default`` impls, via
``_core.defaults()``), never written here; ``None`` marks a default the stage computes from
the window and topology. A field's ``metadata["check"]`` turns a user's value into the
field's type or raises `RoutepackError`/`RoutepackTypeError` naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional

from routepack import _core
from routepack._checks import MAX_INT, bounded_float, boolean, finite_float, positive_int, sequence
from routepack.errors import RoutepackError

#: ``{stage: {option name: default}}``, from the Rust core (the one source of every default).
DEFAULTS: Dict[str, Dict[str, Any]] = _core.defaults()

#: A check: (value, option name) -> the value as the field's type, or raises.
Check = Callable[[Any, str], Any]


def count(minimum: int = 0, maximum: int = MAX_INT) -> Check:
    """An int (numpy ints too, not bools) in ``minimum..=maximum``."""
    return lambda v, name: positive_int(v, name, minimum=minimum, maximum=maximum)


def number(lo: float = 0.0, hi: float = float("inf"), **open_ends: bool) -> Check:
    """A finite float in the interval ``lo..hi`` (closed, or open at an end `bounded_float`'s
    ``lo_open`` / ``hi_open`` name)."""
    if hi == float("inf") and not open_ends.get("lo_open"):
        return lambda v, name: finite_float(v, name, minimum=lo)
    return lambda v, name: bounded_float(v, name, lo, hi, **open_ends)


def flag() -> Check:
    """A bool (Python or numpy)."""
    return boolean


def optional(check: Check) -> Check:
    """``None`` (the stage computes the value) or what ``check`` accepts."""
    return lambda v, name: None if v is None else check(v, name)


def weights(n: int) -> Check:
    """``n`` finite weights >= 0, not all 0, as a tuple of floats."""

    def check(v: Any, name: str) -> tuple:
        items = sequence(v, name, f"{n} weights")
        if len(items) != n:
            raise RoutepackError(f"{name}: expected {n} weights, got {len(items)}: {v!r}")
        out = tuple(finite_float(x, f"{name}[{i}]") for i, x in enumerate(items))
        if not any(out):
            raise RoutepackError(f"{name}: weights must not all be 0, got {v!r}")
        return out

    return check


def option(stage: str, name: str, check: Check) -> Any:
    """A field whose default is ``DEFAULTS[stage][name]`` (the core's)."""
    return field(default=DEFAULTS[stage][name], metadata={"check": check})


def computed(check: Check) -> Any:
    """A field that defaults to None: the stage computes it (documented on the field)."""
    return field(default=None, metadata={"check": optional(check)})


@dataclass(frozen=True)
class StageOptions:
    """Base of every options dataclass: checks each field on construction."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check: Optional[Check] = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(getattr(self, f.name), f.name))


@dataclass(frozen=True)
class NoOptions(StageOptions):
    """The options of a stage choice that takes none (the baselines)."""


__all__ = [
    "DEFAULTS",
    "NoOptions",
    "StageOptions",
    "computed",
    "count",
    "flag",
    "number",
    "option",
    "optional",
    "weights",
]
