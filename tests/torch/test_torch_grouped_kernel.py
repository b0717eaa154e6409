"""`routepack.torch.moe.grouped_swiglu` over a rank's slots and its replica copies in one call:
the same outputs and gradients as one stack holding both, on both of its paths
(``torch._grouped_mm`` and the loop over groups), and per row what `swiglu` gives."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from routepack.torch import moe  # noqa: E402


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_slots_and_copies_in_one_call_equal_one_stack(path, monkeypatch):
    if path == "loop":
        monkeypatch.setitem(moe._GROUPED_MM_OK, ("cpu", torch.float32), False)
    g = torch.Generator().manual_seed(0)
    H, I, spr, R = 16, 8, 3, 2
    counts = np.array([2, 0, 3, 1, 2])  # a slot idle, then two copies
    w1, w2 = torch.randn(spr, H, 2 * I, generator=g), torch.randn(spr, I, H, generator=g)
    w1r, w2r = torch.randn(R, H, 2 * I, generator=g), torch.randn(R, I, H, generator=g)
    x = torch.randn(int(counts.sum()), H, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w1r, w2r)]
    out = moe.grouped_swiglu(leaves[0], counts, (leaves[1], leaves[3]), (leaves[2], leaves[4]))
    out.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, w1, w2, w1r, w2r)]
    want = moe.grouped_swiglu(ref[0], counts, torch.cat([ref[1], ref[3]]), torch.cat([ref[2], ref[4]]))
    want.square().sum().backward()
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(leaves, ref):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    unit = np.repeat(np.arange(spr + R), counts)
    s1, s2 = torch.cat([w1, w1r]), torch.cat([w2, w2r])
    rows = torch.stack([moe.swiglu(x[i : i + 1], s1[u], s2[u])[0] for i, u in enumerate(unit)])
    assert torch.allclose(out, rows, rtol=1e-5, atol=1e-5)
