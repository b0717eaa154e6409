"""routepack.integrations.slime against slime's own ``build_dp_schedule`` (THUDM/slime at
commit 624b824, 2026-08-21, run from the verbatim copy in tests/slime_reference/: slime is
not on PyPI). On the same rollouts both return the same structure (a 4-tuple of lists of
ints), the same steps (grouping by rollout, trailing rollouts dropped) and the same
``global_batch_sizes``; ours keeps the cap where slime's ``--balance-by-flops`` does not
(#2017)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent / "slime_reference"))
slime_dp = pytest.importorskip("slime.utils.dp_schedule")

import routepack as rp  # noqa: E402
from routepack.integrations import slime as rs  # noqa: E402
from slime_batches import parallel_config, plans_for_steps, rollout, slime_args  # noqa: E402
from test_integrations_slime import check_schedule  # noqa: E402


def structure(out):
    """The types of a schedule, level by level."""
    partitions, micro, num_mb, gbs = out
    return (
        type(out),
        len(out),
        type(partitions),
        {type(p) for p in partitions},
        {type(i) for p in partitions for i in p},
        type(micro),
        {type(m) for m in micro},
        {type(mb) for m in micro for mb in m},
        {type(i) for m in micro for mb in m for i in mb},
        type(num_mb),
        {type(n) for n in num_mb},
        type(gbs),
        {type(g) for g in gbs},
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dp=st.sampled_from([1, 2, 4]),
    gbs=st.integers(1, 4),
    extra=st.integers(0, 3),
    cap=st.integers(8, 40),
    balance_data=st.booleans(),
)
def test_same_structure_and_steps_as_slime(seed, dp, gbs, extra, cap, balance_data):
    rng = np.random.default_rng(seed)
    gbs = max(gbs, dp)
    routed, lens, ids = rollout(rng, gbs * int(rng.integers(1, 3)) + extra, cap)
    args = slime_args(cap, balance_data=balance_data)
    try:
        theirs = slime_dp.build_dp_schedule(args, parallel_config(dp), lens, global_batch_size=gbs, rollout_indices=ids)
    except AssertionError:
        theirs = None  # slime refuses (a step it cannot split into a multiple of dp)
    topo = rp.Topology(dp=dp, ep=min(dp, 2), gpus_per_node=2, slots_per_rank=3 if dp > 1 else 6)
    plans = plans_for_steps(routed, lens, ids, gbs, topo, cap, "routepack", seed % 100)
    if plans is None:
        return
    ours = rs.build_dp_schedule(
        args, parallel_config(dp), lens, global_batch_size=gbs, rollout_indices=ids, plans=plans
    )
    check_schedule(ours, lens, ids, gbs, dp, cap, plans)
    if theirs is None:
        return
    assert structure(ours) == structure(theirs)
    assert ours[3] == theirs[3] and len(ours[2]) == len(theirs[2])
    assert sorted(i for p in ours[0] for i in p) == sorted(i for p in theirs[0] for i in p)
    # step by step, the same samples (slime's mbs of step s are its first num_mb[s] per rank)
    for out in (ours, theirs):
        partitions, micro, num_mb, _ = out
        got = []
        for s, m in enumerate(num_mb):
            start = sum(num_mb[:s])
            got.append(sorted(partitions[r][i] for r in range(dp) for mb in micro[r][start : start + m] for i in mb))
        assert got == [sorted(x) for x in rs.step_samples(ids, gbs)]


def test_slime_balance_by_flops_exceeds_the_cap_ours_does_not():
    """#2017, reproduced on slime's code: FLOPs balancing splits by workload and ignores
    max_tokens_per_gpu; the plan-driven schedule never exceeds it."""
    exceeded = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        routed, lens, ids = rollout(rng, 4, 30)
        args = slime_args(30, balance_by_flops=True)
        try:
            parts, micro, _, _ = slime_dp.build_dp_schedule(
                args, parallel_config(2), lens, global_batch_size=4, rollout_indices=ids
            )
        except AssertionError:
            continue
        exceeded += any(sum(lens[parts[r][i]] for i in mb) > 30 for r in range(2) for mb in micro[r])
        topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=3)
        plans = plans_for_steps(routed, lens, ids, 4, topo, 30)
        if plans is not None:
            ours = rs.build_dp_schedule(
                args, parallel_config(2), lens, global_batch_size=4, rollout_indices=ids, plans=plans
            )
            check_schedule(ours, lens, ids, 4, 2, 30, plans)
    assert exceeded > 0
