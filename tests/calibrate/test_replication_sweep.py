"""`routepack.calibrate.replication`: replica copies filled and their gradients returned between
two spawned gloo ranks by `routepack.torch`'s replica exchange, every point timed, each rank
sending and receiving the point's copies. No assertion is on a measured time."""

from __future__ import annotations

import pytest

import routepack as rp
from routepack.calibrate.sweeps import Sweeps
from synthetic import HAS_TORCH


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_every_point_sends_its_copies_both_ways():
    from routepack.calibrate import replication

    model = rp.ModelShape(1, 4, 2, 32, 16, attention=("linear",), shared_experts=0)
    sweeps = Sweeps(
        tokens_per_expert=(1,),
        active_experts=(1,),
        max_tokens=1,
        lengths=(8,),
        message_bytes=(64,),
        warmup=0,
        repeats=1,
        replication_copies=(1, 3),
    )
    got = replication.measure(model, sweeps, "cpu", "float32", ranks=4, timeout_s=240, clock="cpu")
    weights = 4 * 3 * 32 * 16  # fp32 w1 [H, 2I] and w2 [I, H] of one expert
    assert got["weight_bytes_per_expert"] == got["grad_bytes_per_expert"] == weights
    assert [p["copies"] for p in got["sweep"]] == [1, 3]
    for p, t in zip(got["sweep"], got["measured_s"]):
        assert p["link_bytes"] == p["copies"] * 2 * weights and p["staged_bytes"] == 2 * p["link_bytes"]
        assert t > 0
    # the sweep is between a pair, whatever `ranks` says
    assert got["ranks"] == 2 and got["backend"] == "gloo" and got["clock"] == "cpu" and got["dtype"] == "float32"
