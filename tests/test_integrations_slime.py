"""routepack.integrations.slime: the Window from slime's per-sample recordings (the last
token padded as slime pads it, or skipped) against a per-token reference, and the schedule
from plans against every invariant ``build_dp_schedule`` documents plus what its open bugs
break (#2017 cap, #1838/#1860 empty microbatches, #2065 more microbatches than samples):
over random rollouts with several samples per rollout, dropped trailing rollouts and
lengths at the cap. tests/test_integrations_slime_real.py compares with slime's own code."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.integrations import slime as rs
from slime_batches import parallel_config, plans_for_steps, rollout, slime_args

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(routed, experts, last_token):
    layers, k = routed[0].shape[1:]
    out = np.zeros((len(routed), layers, experts), dtype=np.int32)
    for i, a in enumerate(routed):
        rows = list(a)
        if last_token == "pad":
            rows.append((np.arange(layers * k).reshape(layers, k)) % experts)
        for row in rows:
            for l in range(layers):
                for e in row[l]:
                    out[i, l, int(e)] += 1
    return out


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    last=st.sampled_from(["pad", "skip"]),
    dtype=st.sampled_from([np.int32, np.int16, np.uint8]),
)
def test_window_counts_as_slime_replays(seed, n, last, dtype):
    rng = np.random.default_rng(seed)
    routed, lens, _ = rollout(rng, n, 12)
    routed = [a.astype(dtype) for a in routed]
    if rng.random() < 0.3:
        routed[0] = routed[0][:0]  # a one-token sample: nothing recorded
        lens[0] = 1
    w = rs.window_from_slime(routed, 5, total_lengths=lens, last_token=last)
    assert w.seq_lens.tolist() == lens and w.top_k == 2
    np.testing.assert_array_equal(w.expert_tokens, reference(routed, 5, last))
    torch = pytest.importorskip("torch")
    assert rs.window_from_slime([torch.from_numpy(a) for a in routed], 5, last_token=last) == w


def test_window_errors_name_the_argument():
    rng = np.random.default_rng(0)
    routed, lens, _ = rollout(rng, 3, 10)
    bad = [a.copy() for a in routed]
    bad[1][0, 0, 0] = 9
    with pytest.raises(rp.RoutepackError, match=r"rollout_routed_experts\[1\]: expert id 9 at token 0 \(sample 1\)"):
        rs.window_from_slime(bad, 5)
    with pytest.raises(rp.RoutepackError, match=r"rollout_routed_experts\[0\]: has"):
        rs.window_from_slime(routed, 5, total_lengths=[n + 1 for n in lens])
    with pytest.raises(rp.RoutepackError, match="last_token"):
        rs.window_from_slime(routed, 5, last_token="drop")
    with pytest.raises(rp.RoutepackError, match="num_experts: 1 is fewer"):
        rs.window_from_slime(routed, 1)
    with pytest.raises(rp.RoutepackTypeError, match="rollout_routed_experts"):
        rs.window_from_slime(routed[0], 5)
    with pytest.raises(rp.RoutepackError, match=r"rollout_routed_experts\[1\]: shape"):
        rs.window_from_slime([routed[0], routed[1][:, :1]], 5)
    with pytest.raises(rp.RoutepackError, match="total_lengths"):
        rs.window_from_slime(routed, 5, total_lengths=lens[:1])


def check_schedule(out, lens, ids, gbs, dp, cap, plans):
    partitions, micro, num_mb, gbsizes = out
    steps = rs.step_samples(ids, gbs)
    assert isinstance(out, tuple) and len(out) == 4
    assert len(partitions) == len(micro) == dp and gbsizes == [gbs] * len(steps)
    assert num_mb == [p.num_micro for p in plans]
    kept = sorted(i for s in steps for i in s)
    assert sorted(i for p in partitions for i in p) == kept  # every kept sample exactly once
    for r in range(dp):
        assert len(micro[r]) == sum(num_mb)  # same count on every rank (PP sync)
        flat = [i for mb in micro[r] for i in mb]
        assert flat == list(range(len(partitions[r])))  # tiles the partition in order
        assert all(mb for mb in micro[r])  # no empty microbatch (#1838, #1860)
        start = 0
        for s, m in enumerate(num_mb):  # per step: no more microbatches than samples (#2065)
            mbs = micro[r][start : start + m]
            assert m <= sum(len(mb) for mb in mbs)
            assert {partitions[r][i] for mb in mbs for i in mb} <= set(steps[s])  # a step stays a step
            start += m
        for mb in micro[r]:  # the cap, always (#2017)
            assert sum(lens[partitions[r][i]] for i in mb) <= cap


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    dp=st.sampled_from([1, 2, 4]),
    gbs=st.integers(1, 4),
    extra=st.integers(0, 3),
    cap=st.integers(4, 40),
    policy=st.sampled_from(["routepack", "static", "eplb_oracle"]),
)
def test_schedule_meets_build_dp_schedule_invariants(seed, dp, gbs, extra, cap, policy):
    rng = np.random.default_rng(seed)
    gbs = max(gbs, dp)  # each step needs a sample per rank
    routed, lens, ids = rollout(rng, gbs * int(rng.integers(1, 3)) + extra, cap)
    topo = rp.Topology(dp=dp, ep=min(dp, 2), gpus_per_node=2, slots_per_rank=3 if dp > 1 else 6)
    plans = plans_for_steps(routed, lens, ids, gbs, topo, cap, policy, seed % 100)
    if plans is None:  # a step too small to give every rank a microbatch: refused by the planner
        return
    out = rs.build_dp_schedule(
        slime_args(cap), parallel_config(dp), lens, global_batch_size=gbs, rollout_indices=ids, plans=plans
    )
    check_schedule(out, lens, ids, gbs, dp, cap, plans)


def test_cp_scales_the_cap_and_refusals_name_the_argument():
    rng = np.random.default_rng(5)
    routed, lens, ids = rollout(rng, 4, 20)
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=3)
    plans = plans_for_steps(routed, lens, ids, 4, topo, 40)
    kw = dict(global_batch_size=4, rollout_indices=ids, plans=plans)
    out = rs.build_dp_schedule(slime_args(20), parallel_config(2, cp=2), lens, **kw)  # cap 20 * 2
    check_schedule(out, lens, ids, 4, 2, 40, plans)
    too_small = min(sum(lens[out[0][0][i]] for i in mb) for mb in out[1][0]) - 1
    with pytest.raises(rp.RoutepackError, match=r"plans\[0\]: microbatch"):
        rs.build_dp_schedule(slime_args(too_small), parallel_config(2), lens, **kw)
    with pytest.raises(rp.RoutepackError, match="micro_batch_size = 1 \\(static batch mode\\)"):
        a = slime_args(40)  # static mode: micro_batch_size = 1, the dynamic plans hold more
        a.use_dynamic_batch_size = False
        rs.build_dp_schedule(a, parallel_config(2), lens, **kw)
    with pytest.raises(rp.RoutepackError, match="plans: 2 plans for 1"):
        rs.build_dp_schedule(slime_args(40), parallel_config(2), lens, **{**kw, "plans": plans * 2})
    with pytest.raises(rp.RoutepackError, match=r"plans\[0\]: runs on 2 DP ranks, dp_size is 4"):
        rs.build_dp_schedule(slime_args(40), parallel_config(4), lens, **kw)
    with pytest.raises(rp.RoutepackError, match="train_parallel_config: has no 'cp_size'"):
        rs.build_dp_schedule(slime_args(40), {"dp_size": 2}, lens, **kw)
    with pytest.raises(rp.RoutepackError, match="global_batch_size"):
        rs.build_dp_schedule(slime_args(40), parallel_config(2), lens, **{**kw, "global_batch_size": 9})
    if plans[0].num_micro % 2:
        with pytest.raises(rp.RoutepackError, match="microbatch_group_size_per_vp_stage"):
            rs.build_dp_schedule(slime_args(40), parallel_config(2, vpp=2, group=2), lens, **kw)
