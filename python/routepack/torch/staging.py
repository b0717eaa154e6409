"""Deprecated: the old name of `routepack.torch.waves` (a migration moved a few layers at a
time, in waves, under ``max_bytes_in_flight``). Importing it warns; ``plan_stages`` is
`routepack.torch.waves.plan_waves`."""

from __future__ import annotations

from typing import Any

from routepack._deprecation import renamed
from routepack.torch.waves import rank_bytes

renamed("routepack.torch.staging", "routepack.torch.waves")


def plan_stages(*args: Any, **kwargs: Any) -> Any:
    """Deprecated: `routepack.torch.waves.plan_waves`."""
    from routepack.torch.waves import plan_waves

    renamed("routepack.torch.staging.plan_stages", "routepack.torch.waves.plan_waves")
    return plan_waves(*args, **kwargs)


__all__ = ["plan_stages", "rank_bytes"]
