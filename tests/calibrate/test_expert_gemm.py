"""`routepack.calibrate.expert_gemm`: the expert kernel timed at every point of the grid, in
the grid's order, as `EPMoE` runs it (the stack's idle slots included); the kernel it times
computes what `grouped_swiglu` does. No assertion is on a measured time."""

from __future__ import annotations

import numpy as np
import pytest

from routepack.calibrate.sweeps import Sweeps
from synthetic import HAS_TORCH, MODEL

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")

SWEEPS = Sweeps(
    tokens_per_expert=(1, 3, 8),
    active_experts=(1, 2),
    max_tokens=16,
    lengths=(8,),
    message_bytes=(64,),
    warmup=0,
    repeats=2,
    short_repeats=0,
)


@pytest.mark.parametrize("stack", [None, 4])
def test_every_grid_point_is_timed_in_order(stack):
    import torch
    from dataclasses import replace

    from routepack.calibrate import expert_gemm

    ticks = []
    got = expert_gemm.measure(
        replace(MODEL, hidden=16, expert_ffn=8), SWEEPS, "cpu", torch.float32, lambda: ticks.append(1), stack
    )
    grid = SWEEPS.expert_grid()
    assert [(p["active_experts"], p["tokens_per_expert"]) for p in got["sweep"]] == list(grid)
    assert all(p["tokens"] == p["active_experts"] * p["tokens_per_expert"] for p in got["sweep"])
    assert len(got["measured_s"]) == len(got["forward_s"]) == len(grid)
    assert all(0 < f <= m for f, m in zip(got["forward_s"], got["measured_s"]))
    assert len(ticks) == SWEEPS.repeats * len(grid)


def test_the_timed_kernel_is_grouped_swiglu_in_arrival_order():
    import torch

    from routepack.calibrate.expert_gemm import _experts
    from routepack.torch.moe import swiglu

    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(3, 16, 8, generator=g), torch.randn(3, 4, 16, generator=g)
    unit = np.array([1, 0, 1, 1, 0])  # slot 2 idle
    order = np.argsort(unit, kind="stable")
    x = torch.randn(5, 16, generator=g)
    out = _experts(x, torch.from_numpy(order), torch.from_numpy(np.argsort(order)), np.array([2, 3, 0]), w1, w2)
    want = torch.stack([swiglu(x[i : i + 1], w1[u], w2[u])[0] for i, u in enumerate(unit)])
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
