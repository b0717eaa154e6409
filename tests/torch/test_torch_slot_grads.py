"""A slot's replica gradients are added to its local gradient in fp32 and rounded once to
the parameter's dtype (issue 16, item 2: a bf16 parameter must not get its fp32 replica
gradient rounded twice). `complete_slot_grads` on random bf16 gradients, no processes (no
redundant experts, so no collective)."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from routepack.torch.slot_link import complete_slot_grads, redundant_experts  # noqa: E402


def _layer(spr, experts):
    row = np.arange(spr, dtype=np.int32) % experts
    return SimpleNamespace(phy2log=row, num_experts=experts, group=None, local_experts=lambda: row)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spr=st.integers(1, 4), n_extra=st.integers(1, 3), own=st.booleans())
def test_replica_gradients_are_summed_in_fp32_and_rounded_once(seed, spr, n_extra, own):
    g = torch.Generator().manual_seed(seed)
    mod = _layer(spr, spr)  # every expert once: nothing redundant
    assert redundant_experts(mod.phy2log, mod.num_experts).size == 0
    g1 = torch.randn(spr, 3, 4, generator=g).bfloat16()
    g2 = torch.randn(spr, 2, 3, generator=g).bfloat16()
    if not own:  # views of larger tensors: shared, so never edited
        g1 = torch.cat([g1, g1]).view(2, spr, 3, 4)[0]
        g2 = torch.cat([g2, g2]).view(2, spr, 2, 3)[1]
    n = g1[0].numel() + g2[0].numel()
    slots = torch.randint(0, spr, (n_extra,), generator=g).tolist()
    extra = {}
    for s in slots:  # fp32 replica gradients, several per slot possible
        extra[s] = extra.get(s, torch.zeros(n)) + torch.randn(n, generator=g) * 1e-2
    k1, k2 = g1.clone(), g2.clone()
    o1, o2 = complete_slot_grads(mod, g1, g2, extra)
    # the layer's own gradients (fresh, dense) are completed in place, others in new tensors
    assert (o1 is g1 and o2 is g2) if own else (torch.equal(g1, k1) and torch.equal(g2, k2))
    assert o1.dtype == torch.bfloat16 and o2.dtype == torch.bfloat16
    for s in range(spr):
        local = torch.cat([k1[s].reshape(-1), k2[s].reshape(-1)]).float()
        want = (local + extra[s]).bfloat16() if s in extra else local.bfloat16()
        got = torch.cat([o1[s].reshape(-1), o2[s].reshape(-1)])
        assert torch.equal(got, want), s
