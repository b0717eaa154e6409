"""`routepack.calibrate.attention`: every sample length timed (the dense layer, or the MoE
layer's origin work alone), the head split, and `moe_origin` computing the gate-weighted
combine of the pairs it dispatches. No assertion is on a measured time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from routepack.calibrate.attention import head_dim
from routepack.calibrate.sweeps import Sweeps
from synthetic import HAS_TORCH, MODEL

SWEEPS = Sweeps(
    tokens_per_expert=(1,),
    active_experts=(1,),
    max_tokens=1,
    lengths=(4, 8, 16),
    message_bytes=(64,),
    warmup=0,
    repeats=2,
    short_repeats=0,
)


@pytest.mark.parametrize("hidden", [16, 64, 96, 2048, 7168])
def test_head_dim_divides_the_hidden_size(hidden):
    d = head_dim(hidden)
    assert hidden % d == 0 and d >= 1


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("dense", [True, False])
def test_every_length_is_timed(dense):
    import torch

    from routepack.calibrate import attention

    model = replace(MODEL, hidden=32, expert_ffn=16)
    got = attention.measure(model, SWEEPS, "cpu", torch.float32, dense=dense)
    assert [p["length"] for p in got["sweep"]] == list(SWEEPS.lengths)
    assert len(got["measured_s"]) == len(got["forward_s"]) == len(SWEEPS.lengths)
    assert all(0 < f <= m for f, m in zip(got["forward_s"], got["measured_s"]))
    assert got["parts"][-1] == "moe_origin" and (("attention" in got["parts"]) == dense)
    assert got["heads"] * got["head_dim"] == 32 and got["top_k"] == model.top_k


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_moe_origin_is_the_gate_weighted_sum_of_the_dispatched_pairs():
    import torch

    from routepack.calibrate.attention import moe_origin

    g = torch.Generator().manual_seed(0)
    n, k, h = 5, 2, 8
    x, gates = torch.randn(n, h, generator=g), torch.rand(n, k, generator=g)
    order = np.random.default_rng(0).permutation(n * k)
    got = moe_origin(x, torch.from_numpy(order // k), torch.from_numpy(np.argsort(order)), gates)
    assert torch.allclose(got, x + x * gates.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
