"""`routepack.calibrate.migration`: experts with their Adam state swapped between two spawned
gloo ranks by `routepack.torch.migrate`, every point timed, each rank sending and receiving
the point's experts. No assertion is on a measured time."""

from __future__ import annotations

import pytest

import routepack as rp
from routepack.calibrate.sweeps import Sweeps
from synthetic import HAS_TORCH


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_every_point_swaps_its_experts_on_two_ranks():
    from routepack.calibrate import migration

    model = rp.ModelShape(1, 4, 2, 32, 16, attention=("linear",), shared_experts=0)
    sweeps = Sweeps(
        tokens_per_expert=(1,),
        active_experts=(1,),
        max_tokens=1,
        lengths=(8,),
        message_bytes=(64,),
        warmup=0,
        repeats=1,
        migration_moves=(1, 2, 4),
    )
    got = migration.measure(model, sweeps, "cpu", "float32", ranks=2, timeout_s=240, clock="cpu")
    state = 12 * 3 * 32 * 16  # fp32 weights and Adam's two moments
    assert got["state_bytes_per_expert"] == state
    assert [p["moves"] for p in got["sweep"]] == [1, 2, 4]
    for p, t in zip(got["sweep"], got["measured_s"]):
        assert p["link_bytes"] == p["moves"] * state and p["staged_bytes"] == 2 * p["link_bytes"]
        assert t > 0
    assert got["ranks"] == 2 and got["backend"] == "gloo" and got["clock"] == "cpu" and got["dtype"] == "float32"
