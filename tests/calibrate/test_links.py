"""`routepack.calibrate.links`: the three ops timed at every message size on two spawned gloo
ranks, on either clock; a bad clock is refused before anything is spawned. No assertion is on a
measured time."""

from __future__ import annotations

import pytest

from routepack.calibrate.links import check_clock
from routepack.calibrate.sweeps import Sweeps
from routepack.errors import RoutepackError
from synthetic import HAS_TORCH


def test_the_clock_is_checked():
    assert check_clock("wall", "cuda") == "wall" and check_clock("cpu", "cpu") == "cpu"
    for clock, device in (("cpu", "cuda"), ("tsc", "cpu"), (None, "cpu")):
        with pytest.raises(RoutepackError, match="links_clock"):
            check_clock(clock, device)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_every_op_and_size_is_timed_on_two_ranks():
    from routepack.calibrate import links

    sweeps = Sweeps(
        tokens_per_expert=(1,),
        active_experts=(1,),
        max_tokens=1,
        lengths=(8,),
        message_bytes=(64, 4096),
        warmup=0,
        repeats=1,
    )
    got = links.measure(sweeps, "cpu", ranks=2, timeout_s=240, clock="cpu")
    assert [p["op"] for p in got["sweep"]] == ["p2p"] * 2 + ["all_to_all"] * 2 + ["all_reduce"] * 2
    assert [p["bytes"] for p in got["sweep"]] == [64, 4096] * 3
    assert len(got["measured_s"]) == 6 and all(t >= 0 for t in got["measured_s"])
    assert got["ranks"] == 2 and got["backend"] == "gloo" and got["clock"] == "cpu"
