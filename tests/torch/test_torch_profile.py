"""`routepack.torch.profile`: marks charge forward work where it runs and backward work to the
part that ran between two marks, in the engine's order; regions are exclusive; an `EPMoE`
layer's microbatch is cut into its parts (`routepack.parts.PARTS`), which add up to it, and
into segments between the group's collectives; no profile, no marks."""

import datetime
import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.parts import PARTS, PRICED_BY  # noqa: E402
from routepack.torch import profile  # noqa: E402
from routepack.torch.moe import EPMoE  # noqa: E402


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Advance(torch.autograd.Function):
    """Identity that moves ``clock`` by ``fwd`` in forward and by ``bwd`` in backward."""

    @staticmethod
    def forward(ctx, x, clock, fwd, bwd):  # type: ignore[override]
        clock.t += fwd
        ctx.clock, ctx.bwd = clock, bwd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.clock.t += ctx.bwd
        return grad, None, None, None


@settings(max_examples=40, deadline=None)
@given(
    work=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5),
    inner=st.integers(0, 5),
)
def test_marks_attribute_forward_and_backward_work_to_the_part_between_them(work, inner):
    clock = Clock()
    prof = profile.PartProfile(clock)
    profile._active, prev = prof, profile._active
    try:
        x = torch.ones(3, requires_grad=True)
        h = profile.mark(x, "other", "p0")
        for i, (fwd, bwd) in enumerate(work):
            h = Advance.apply(h, clock, fwd, bwd)
            if i == 0:
                with profile.region("r"):  # exclusive: its seconds leave p0
                    clock.t += inner
            h = profile.mark(h, f"p{i}", f"p{i + 1}" if i + 1 < len(work) else "other")
        h.sum().backward()
        got = prof.take()
    finally:
        profile._active = prev
    for i, (fwd, bwd) in enumerate(work):
        assert got.get(f"p{i}", 0.0) == fwd + bwd
    assert got.get("r", 0.0) == inner and got["other"] == 0.0


@pytest.fixture(scope="module")
def group():
    """A gloo group of world size 1 (created here unless one exists; destroyed if created)."""
    made = not dist.is_initialized()
    if made:
        store = os.path.join(tempfile.mkdtemp(prefix="rp_profile_"), "store")
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
        )
    yield
    if made:
        dist.destroy_process_group()


def test_a_layer_is_cut_into_its_parts(group):
    """One rank, expert 0 in two of its three slots (redundant: its sum runs), a forward and
    backward of two layers: every part the layer has is charged, the parts add up to the
    microbatch on the profile's clock, and without a profile the layer makes no mark."""
    topo = rp.Topology(1, 1, 1, 3)
    layers = [EPMoE(l, 2, 16, 8, topo, np.array([0, 1, 0], dtype=np.int32)) for l in range(2)]
    g = torch.Generator().manual_seed(0)
    for mod in layers:
        mod.load_logical(torch.randn(2, 16, 16, generator=g), torch.randn(2, 8, 16, generator=g))
    x = torch.randn(5, 16, generator=g, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    gates = torch.rand(5, 2, generator=g)
    with profile.profiling("cpu") as prof:
        t0 = prof.last
        h = x
        for mod in layers:
            h = h + mod(h, ids, gates)
        h.sum().backward()
        got = prof.take()
        total = prof.last - t0
        segments = prof.segments()
    assert set(got) == set(PARTS)  # every part listed, and no other
    for part in ("route", "gather", "all_to_all", "unit_sort", "expert", "combine", "slot_grads", "redundant_sum"):
        assert got[part] > 0, part
    assert got["replica_fill"] == got["replica_grads"] == 0.0
    assert sum(got.values()) == pytest.approx(total, rel=1e-6, abs=1e-9)
    # a segment per collective returned (4 all-to-alls and the redundant expert's all-reduce a
    # layer), and the rest: together the microbatch
    assert len(segments) == 2 * 5 + 1 and all(v >= 0 for v in segments)
    assert sum(segments) == pytest.approx(total, rel=1e-3, abs=1e-4)
    assert profile.active() is None
    y = layers[0](x, ids, gates)
    assert y.grad_fn is not None and "Mark" not in type(y.grad_fn).__name__


def test_every_part_has_a_pricing_term_or_none():
    assert set(PRICED_BY) == set(PARTS)
    assert set(v for v in PRICED_BY.values() if v) <= {
        "attention",
        "all_to_all",
        "expert",
        "replication",
        "redundant_grads",
    }
