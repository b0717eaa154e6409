"""Single-process parts of routepack.torch: the dense reference, checksums, replay order,
plan digests, expert state discovery."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import routepack as rp  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import checksum, dense_moe, plan_digest, rank_microbatches, swiglu  # noqa: E402
import selfcheck as sc  # noqa: E402


def test_dense_moe_is_the_gate_weighted_sum_of_experts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    w1 = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 3, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0], [1, 2]])
    gw = torch.rand(5, 2, generator=g, dtype=torch.float64)
    want = torch.stack(
        [sum(gw[t, j] * swiglu(x[t : t + 1], w1[ids[t, j]], w2[ids[t, j]])[0] for j in range(2)) for t in range(5)]
    )
    assert torch.allclose(dense_moe(x, ids, gw, w1, w2), want, rtol=1e-12, atol=1e-12)


def test_checksum_sees_value_and_position():
    buf = torch.arange(1000, dtype=torch.int32).view(torch.uint8).clone()
    base = checksum(buf)
    assert checksum(buf.clone()) == base
    flipped = buf.clone()
    flipped[1234] ^= 1
    assert checksum(flipped) != base
    swapped = buf.view(torch.int32).clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert checksum(swapped.view(torch.uint8)) != base
    assert checksum(buf[:-4]) != checksum(torch.cat([buf[:-4], buf.new_zeros(4)]))  # length counts too


def test_rank_microbatches_follow_the_plan_in_execution_order():
    case = sc.Case()
    plan, _, window, routed, cu = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, case.topology()))
    seen = []
    for d in range(case.dp):
        mbs = rank_microbatches(plan, routed, d, cu)
        assert [mb.micro for mb in mbs] == list(range(plan.num_micro))
        for mb in mbs:
            assert np.array_equal(mb.samples, plan.cell_samples(d, mb.micro))
            want = np.concatenate([routed[cu[s] : cu[s + 1]] for s in mb.samples])
            assert np.array_equal(mb.routed.numpy(), want)
            assert mb.cu_seqlens[-1] == want.shape[0]
            seen.extend(mb.samples.tolist())
    assert sorted(seen) == list(range(plan.num_samples))
    per_sample = [routed[cu[s] : cu[s + 1]] for s in range(plan.num_samples)]
    a = rank_microbatches(plan, per_sample, 1)
    b = rank_microbatches(plan, routed, 1, cu)
    assert all(torch.equal(x.routed, y.routed) for x, y in zip(a, b))
    with pytest.raises(rp.RoutepackError, match="cu_seqlens"):
        rank_microbatches(plan, routed, 0)
    with pytest.raises(rp.RoutepackError, match="rank"):
        rank_microbatches(plan, routed, 9, cu)


def test_plan_digest_covers_decisions_not_report():
    case = sc.Case()
    plan, _, _, _, _ = sc.make_plans(case, 1, Placement.static(case.layers, case.experts, case.topology()))
    same = Plan(
        plan.placement,
        plan.sample_rank,
        plan.sample_micro,
        plan.num_micro,
        plan.replicas.copy(),
        plan.migration,
        report={"x": 1},
    )
    assert plan_digest(same) == plan_digest(plan)
    shifted = plan.replicas.copy()  # plan arrays are read-only: a changed plan is a new one
    shifted["share"][0] += 0.125
    other = Plan(plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, shifted, plan.migration)
    assert plan_digest(other) != plan_digest(plan)
