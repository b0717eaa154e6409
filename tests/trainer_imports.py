"""Importing a trainer's modules in a test: skipped where they cannot import on a developer's
machine, a failure in CI (``CI`` set, as `.ci/run` and CI services set it), where `.ci/run`
installs what they import, so that a missing dependency cannot turn a suite green by skipping."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def import_or_skip(name: str, reason: str) -> Any:
    """``name`` imported; where it cannot be: the ImportError in CI, a module-level skip elsewhere."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if in_ci():
            raise ImportError(f"{name} does not import in CI ({reason}): {e}") from e
        pytest.skip(f"{reason}: {e}", allow_module_level=True)
