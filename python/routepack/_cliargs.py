"""What every subcommand of the command line checks its arguments with (`routepack.cli` and
`routepack.measure.cli` both use it): a user error is one line on stderr and exit status 2,
never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator


class UsageError(Exception):
    """A user error the CLI reports in one line (exit 2)."""


def count(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def writable(path: str, flag: str) -> Path:
    """``path`` if a file can be written there (checked before the work starts), else `UsageError`."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return p


def load_cost(path: str, flag: str = "--cost") -> Any:
    """The `CostModel` in the JSON file ``path``; a missing file, a folder, or a file that is
    not a whole cost model's JSON is a `UsageError` naming ``flag`` and the path."""
    from routepack.errors import RoutepackError
    from routepack.model import CostModel

    try:
        return CostModel.load(path)
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
    except RoutepackError as e:
        raise UsageError(f"{flag}: {e}") from None


__all__ = ["UsageError", "count", "load_cost", "writable"]


@contextlib.contextmanager
def naming_npz(args: argparse.Namespace) -> Iterator[None]:
    """A window `compare` / `sweep` refuse (``windows[i]: ...``) named by its ``--npz`` file."""
    from routepack.errors import RoutepackError

    try:
        yield
    except RoutepackError as e:
        m = re.match(r"windows\[(\d+)\]: (.*)", str(e), re.S)
        if not args.npz or m is None or int(m.group(1)) >= len(args.npz):
            raise
        raise UsageError(f"--npz {args.npz[int(m.group(1))]}: {m.group(2)}") from None
