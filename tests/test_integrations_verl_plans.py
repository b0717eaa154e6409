"""A verl step's plans without verl: the driver's per-mini-batch plans and order
(`step_plans`) and the workers' lookup (`micro_indices`), against the contracts verl's worker
relies on: equal DP chunks, each worker mini-batch (consecutive ``mini_batch_size / dp``
samples of its chunk) one planned mini-batch, its microbatches the plan's cells, the log-prob
pass over the whole chunk the concatenation, VPP multiples, whole ``force_group_size`` groups;
and every reason a worker falls back, named. tests/test_integrations_verl_hooks.py runs the
same through verl's own code."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.integrations.shared.trainer import TrainerPlanner
from routepack.integrations.verl import NoPlan, micro_indices, step_plans
from verl_batches import cost_model

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def window(rng, n, cap, layers=2, experts=4):
    lens = rng.integers(1, cap + 1, size=n)
    counts = rng.integers(0, lens[:, None, None] + 1, size=(n, layers, experts))
    return rp.Window(lens, counts)


def planner(**kw):
    return TrainerPlanner(cost_model(2, 4), "fsdp", anneal_moves=300, **kw)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    dp=st.sampled_from([1, 2, 4]),
    minibatches=st.integers(1, 3),
    per_rank=st.integers(1, 5),
    group=st.sampled_from([1, 2]),
    multiple=st.sampled_from([1, 2]),
)
def test_step_plans_give_each_worker_minibatch_its_plan(seed, dp, minibatches, per_rank, group, multiple):
    rng = np.random.default_rng(seed)
    mbs = dp * per_rank * group
    cap = 40 * group
    w = window(rng, mbs * minibatches, 40)
    try:
        sp = step_plans(planner(), w, dp, mbs, cap, step=7, group=group, multiple=multiple)
    except rp.InfeasibleError as e:  # too few samples for the VPP multiple or the cells
        assert "microbatch_group_size_per_vp_stage" in str(e) or "cannot fill" in str(e), e
        return
    b = w.num_samples
    assert sorted(sp.order.tolist()) == list(range(b))
    assert [len(p) for p in sp.partitions] == [b // dp] * dp  # verl's DataProto.chunk(dp)
    lens = w.seq_lens[sp.order]  # the ordered batch's lengths
    chunk, share = b // dp, mbs // dp
    for j, (plan, sub) in enumerate(zip(sp.plans, sp.windows)):
        plan.validate(sub, sp.topo, cap)
        assert plan.num_micro % multiple == 0
        if multiple == 1 and group == 1:  # never predicted slower than verl's Karmarkar-Karp balancing
            assert plan.report["predicted"]["step_time"] <= plan.report["trainer"]["kk_step_time"]
        payload = sp.payload[f"routepack_plan_step7_minibatch{j}"]
        for r in range(dp):
            rows = np.arange(r * chunk + j * share, r * chunk + (j + 1) * share)  # the worker's mini-batch j
            perm = rng.permutation(len(rows))  # a worker may hold them in any order
            idx = micro_indices(sp.sample_ids[rows[perm]], sp.payload, lens[rows[perm]], cap, multiple, group)
            assert [[int(rows[perm][i]) for i in m] for m in idx] == payload["ranks"][r]
            assert all(int(lens[rows[perm][m]].sum()) <= cap for m in idx)
            if group > 1:  # consecutive pairs of the original batch share a microbatch
                for m in payload["ranks"][r]:
                    originals = sorted(int(sp.order[p]) for p in m)
                    assert all(
                        originals[i] // group == originals[i + 1] // group for i in range(0, len(originals), group)
                    )
    for r in range(dp):  # the log-prob pass: the rank's whole chunk, mini-batch after mini-batch
        rows = np.arange(r * chunk, (r + 1) * chunk)
        idx = micro_indices(sp.sample_ids[rows], sp.payload, lens[rows], force_group_size=group)
        want = [
            cell for j in range(minibatches) for cell in sp.payload[f"routepack_plan_step7_minibatch{j}"]["ranks"][r]
        ]
        assert [[int(rows[i]) for i in m] for m in idx] == want


def test_worker_fallbacks_name_their_cause():
    rng = np.random.default_rng(1)
    w = window(rng, 16, 30)
    sp = step_plans(planner(), w, 2, 8, 30, step=3)
    lens = w.seq_lens[sp.order]
    rows = np.arange(4)  # rank 0, mini-batch 0
    ids, ok = sp.sample_ids[rows], micro_indices(sp.sample_ids[rows], sp.payload, lens[rows], 30)
    assert sum(len(m) for m in ok) == 4

    def reason(*args, **kw):
        with pytest.raises(NoPlan) as e:
            micro_indices(*args, **kw)
        return e.value

    assert reason(ids, {}, lens[rows]).kind == "missing"
    assert "no 'routepack_sample'" in reason(None, sp.payload, lens[rows]).message
    stale = ids.copy()
    stale[:, 0] = 2
    e = reason(stale, sp.payload, lens[rows])
    assert e.kind == "stale" and "step(s) [3]" in e.message and "[2]" in e.message
    e = reason(ids[:3], sp.payload, lens[rows][:3])
    assert e.kind == "partial" and "ppo_mini_batch_size" in e.message
    small = int(max(lens[rows][m].sum() for m in ok)) - 1
    e = reason(ids, sp.payload, lens[rows], small)
    assert e.kind == "cap" and "max_token_len_per_gpu" in e.message
    if len(ok) % 3:
        e = reason(ids, sp.payload, lens[rows], None, 3)
        assert e.kind == "vpp" and "microbatch_group_size_per_vp_stage" in e.message
    e = reason(ids, sp.payload, lens[rows], None, None, 2)
    assert e.kind == "group" and "force_group_size" in e.message
    with pytest.raises(NoPlan, match="ppo_mini_batch_size"):
        step_plans(planner(), w, 2, 5, 30, step=3)
    with pytest.raises(NoPlan, match="force_group_size"):
        step_plans(planner(), w, 2, 8, 30, step=3, group=3)


def test_force_group_size_plans_whole_groups_and_prices_samples():
    """Pairs planned as one sample each; the plan that runs is over the samples, priced on them."""
    rng = np.random.default_rng(4)
    w = window(rng, 16, 20)
    sp = step_plans(planner(), w, 2, 16, 40, step=1, group=2)
    plan = sp.plans[0]
    plan.validate(sp.windows[0], sp.topo, 40)
    assert plan.num_samples == 16
    pair = plan.sample_rank[0::2] * 100 + plan.sample_micro[0::2]
    assert (pair == plan.sample_rank[1::2] * 100 + plan.sample_micro[1::2]).all()
    again = rp.simulate(plan, sp.windows[0], sp.topo, cost_model(2, 4), 40)
    assert again.step_time == pytest.approx(plan.report["predicted"]["step_time"])
