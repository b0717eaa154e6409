"""`routepack.integrations.slime.plan_dp_schedule` in slime's ``_split_train_data_by_dp``
(tests/slime_split_standin.py: the method's packaging, written from slime's source; slime's
own ``build_dp_schedule`` from the vendored copy at 624b824 for comparison): every DP rank
gets the planned samples and runs the planned microbatches step by step, in both batch
modes and under VPP; a sample over ``max_tokens_per_gpu`` runs alone (as in slime), priced
and counted in the certificate; the backend picks the policy; metrics use slime's names."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.integrations import slime as rs
from slime_batches import parallel_config, rollout, slime_args
from slime_split_standin import RolloutManager, RoutepackRolloutManager, actor_steps
from verl_batches import cost_model

E = 5
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def args_for(cap, gbs, dynamic=True, micro_batch_size=1):
    a = slime_args(cap)
    a.global_batch_size, a.num_experts, a.expert_model_parallel_size, a.num_gpus_per_node = gbs, E, 1, 2
    a.use_dynamic_batch_size, a.micro_batch_size = dynamic, micro_batch_size
    return a


def rollout_data(routed, lens, ids):
    return {
        "tokens": [list(range(n)) for n in lens],
        "rollout_ids": ids,
        "rollout_routed_experts": routed,
        "rewards": [float(i) for i in range(len(lens))],
        "loss_masks": [[1] * (n // 2) for n in lens],
        "raw_reward": [0.0] * len(lens),
    }


def check_ranks(ranks, manager, data, ids, gbs, dp, cap=None, size=None):
    """Every rank holds its planned samples' fields and runs the plans' microbatches."""
    plans = manager.routepack.last_plans
    steps = rs.step_samples(ids, gbs)
    assert len(plans) == len(steps)
    topo = manager.routepack.topology(dp)
    for plan, samples in zip(plans, steps):
        w = rs.window_from_slime([data["rollout_routed_experts"][i] for i in samples], E)
        plan.validate(w, topo, max(plan.report["trainer"]["token_cap"], int(w.seq_lens.max())))
    for r, rank in enumerate(ranks):
        assert rank["tokens"] == [data["tokens"][j] for j in rank["partition"]]
        assert rank["rewards"] == [data["rewards"][j] for j in rank["partition"]]
        assert rank["raw_reward"] is data["raw_reward"] and rank["total_lengths"] == [len(t) for t in data["tokens"]]
        for s, micro in enumerate(actor_steps(rank)):
            want = [[steps[s][int(i)] for i in plans[s].cell_samples(r, m)] for m in range(plans[s].num_micro)]
            assert micro == want
            for mb in micro:
                tokens = sum(len(data["tokens"][j]) for j in mb)
                if cap is not None:
                    assert tokens <= cap or len(mb) == 1  # a lone over-cap sample, as in slime
                if size is not None:
                    assert 1 <= len(mb) <= size


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), dp=st.sampled_from([1, 2, 4]), gbs=st.integers(1, 4), vpp=st.booleans())
def test_every_rank_gets_its_planned_samples_dynamic(seed, dp, gbs, vpp):
    rng = np.random.default_rng(seed)
    gbs = max(gbs, dp)
    cap = 30
    routed, lens, ids = rollout(rng, gbs * int(rng.integers(1, 3)), cap, experts=E)
    cfg = parallel_config(dp, vpp=2 if vpp else 1, group=2 if vpp else 1)
    manager = RoutepackRolloutManager(args_for(cap, gbs), cfg, cost_model(2, E), anneal_moves=300)
    data = rollout_data(routed, lens, ids)
    try:
        ranks = manager._split_train_data_by_dp(data)
    except AssertionError as e:  # a step too small for every rank (or VPP's multiple): slime's own
        # schedule, which the rollout fell back to, cannot make it either
        assert "could only produce" in str(e), e
        why = manager.routepack.fell_back
        assert "cannot fill" in why or "microbatch_group_size_per_vp_stage" in why, why
        return
    assert manager.routepack.fell_back is None
    check_ranks(ranks, manager, data, ids, gbs, dp, cap=cap)
    if vpp:
        assert all(n % 2 == 0 for n in ranks[0]["num_microbatches"])
    theirs = RolloutManager(args_for(cap, gbs), cfg)
    try:
        slime_ranks = theirs._split_train_data_by_dp(rollout_data(routed, lens, ids))
    except AssertionError:
        return
    assert slime_ranks[0]["global_batch_sizes"] == ranks[0]["global_batch_sizes"]
    assert sorted(j for r in slime_ranks for j in r["partition"]) == sorted(j for r in ranks for j in r["partition"])
    assert set(slime_ranks[0]) | {rs.PLANS_KEY} == set(ranks[0])  # the same fields reach the actor, and the plans


def test_over_cap_sample_runs_alone_priced_and_counted():
    rng = np.random.default_rng(3)
    cap, dp, gbs = 24, 2, 4
    routed, lens, ids = rollout(rng, 4, cap, experts=E)
    from verl_batches import distinct_topk

    routed[2] = distinct_topk(rng, 59, 2, 2, E).astype(np.int32)  # 60 tokens: over the cap of 24
    lens[2] = 60
    data = rollout_data(routed, lens, ids)
    manager = RoutepackRolloutManager(args_for(cap, gbs), parallel_config(dp), cost_model(2, E), anneal_moves=300)
    ranks = manager._split_train_data_by_dp(data)
    check_ranks(ranks, manager, data, ids, gbs, dp, cap=cap)
    alone = [mb for r in ranks for step in actor_steps(r) for mb in step if 2 in mb]
    assert alone == [[2]]
    slime_ranks = RolloutManager(args_for(cap, gbs), parallel_config(dp))._split_train_data_by_dp(
        rollout_data(routed, lens, ids)
    )
    assert [mb for r in slime_ranks for step in actor_steps(r) for mb in step if 2 in mb] == [
        [2]
    ]  # slime runs it alone too
    (plan,) = manager.routepack.last_plans
    samples = rs.step_samples(ids, gbs)[0]
    w = rs.window_from_slime([routed[i] for i in samples], E)
    over = samples.index(2)
    assert plan.report["trainer"]["oversize"] == {"samples": [over], "token_cap": cap, "bound_cap": 60}
    topo = manager.routepack.topology(dp)
    sim = rp.simulate(plan, w, topo, cost_model(2, E), cap)  # priced on the real lengths
    assert plan.report["predicted"]["step_time"] == pytest.approx(sim.step_time)
    assert sim.lower_bound_time <= sim.step_time * (1 + 1e-12)  # a few ulp over: issue 33 class 3, the core's
    cut = rp.simulate(plan, rp.Window(np.minimum(w.seq_lens, cap), w.counts * 0, top_k=2), topo, cost_model(2, E), cap)
    assert sim.step_time > cut.step_time  # its 60 tokens are priced, not the cut 24
    rows = plan.report["packing"]["rows_lower_bound"]["rows"]
    assert rows >= 1 and plan.num_micro * dp >= rows  # the certificate counts it as a row of its own


def test_static_mode_makes_slimes_microbatch_counts():
    rng = np.random.default_rng(7)
    cap, dp, gbs = 30, 2, 4
    for seed in range(6):
        routed, lens, ids = rollout(np.random.default_rng(seed), 8, cap, experts=E)
        steps = rs.step_samples(ids, gbs)
        size = 2
        if any((-(-len(s) // size)) % dp for s in steps):
            refused = RoutepackRolloutManager(args_for(cap, gbs, False, size), parallel_config(dp), cost_model(2, E))
            with pytest.raises(AssertionError, match="static path"):  # routepack falls back to slime's own
                refused._split_train_data_by_dp(rollout_data(routed, lens, ids))
            assert "micro_batch_size" in refused.routepack.fell_back
            with pytest.raises(AssertionError, match="static path"):  # slime refuses it too
                RolloutManager(args_for(cap, gbs, False, size), parallel_config(dp))._split_train_data_by_dp(
                    rollout_data(routed, lens, ids)
                )
            continue
        manager = RoutepackRolloutManager(args_for(cap, gbs, False, size), parallel_config(dp), cost_model(2, E))
        data = rollout_data(routed, lens, ids)
        ranks = manager._split_train_data_by_dp(data)
        check_ranks(ranks, manager, data, ids, gbs, dp, size=size)
        theirs = RolloutManager(args_for(cap, gbs, False, size), parallel_config(dp))._split_train_data_by_dp(
            rollout_data(routed, lens, ids)
        )
        assert ranks[0]["num_microbatches"] == theirs[0]["num_microbatches"]
    del rng


def test_backend_picks_the_policy_and_metrics_use_slimes_names(monkeypatch):
    a = args_for(30, 2)
    with pytest.raises(rp.RoutepackError, match="policy: 'routepack' plans expert placement.*backend='fsdp'"):
        rs.planner_from_args(a, cost_model(2, E), backend="fsdp", policy="routepack")
    with pytest.raises(rp.RoutepackError, match="policy: 'eplb' plans expert placement.*backend='megatron'"):
        rs.planner_from_args(a, cost_model(2, E), policy="eplb")
    planner = rs.planner_from_args(a, cost_model(2, E))
    assert planner.policy_name == "routepack_packing" and not planner.runs.placement
    a.train_backend = "fsdp"
    assert rs.planner_from_args(a, cost_model(2, E)).runs.backend == "fsdp"
    a.train_backend = "deepspeed"
    with pytest.raises(rp.RoutepackError, match="args.train_backend: routepack plans for"):
        rs.planner_from_args(a, cost_model(2, E))
    del a.train_backend
    import routepack.integrations.megatron as rm

    monkeypatch.setattr(rm, "EXECUTES", frozenset({"placement", "replicas"}), raising=False)
    planner = rs.planner_from_args(a, cost_model(2, E))  # declared, but the actor's MoE layers are Megatron's
    assert planner.policy_name == "routepack_packing" and "--spec" in planner.runs.why
    a.spec = ["routepack.integrations.slime", "layer_spec"]  # the actor builds routepack's layers: all of it runs
    whole = rs.planner_from_args(a, cost_model(2, E))
    assert whole.runs.placement and whole.policy_name.startswith("routepack"), whole.runs
    del a.spec
    monkeypatch.undo()
    rng = np.random.default_rng(0)
    routed, lens, ids = rollout(rng, 4, 30, experts=E)
    manager = RoutepackRolloutManager(args_for(30, 2), parallel_config(2), cost_model(2, E), anneal_moves=200)
    manager._split_train_data_by_dp(rollout_data(routed, lens, ids))
    m = manager.routepack_metrics
    for key in (
        "routepack/step_time_s",
        "routepack/max_vio/max",
        "routepack/max_vio/layer_0",
        "routepack/experts_migrated",
        "routepack/replicas",
        "perf/routepack_plan_time",
    ):
        assert key in m, key
    assert m["routepack/plans"] == len(manager.routepack.last_plans) and m["routepack/experts_migrated"] == 0
    assert all(
        p.report["trainer"]["runs"]
        == {"schedule": True, "placement": False, "replicas": False, "why": planner.runs.why}
        for p in manager.routepack.last_plans
    )


def dense_rollout(rng, rollouts, cap):
    """A rollout of a model whose layer 0 is dense: SGLang's rows [T - 1, 3, k], row 0 zero."""
    routed, lens, ids = rollout(rng, rollouts, cap, layers=3, experts=E)
    for r in routed:
        r[:, 0] = 0
    return routed, lens, ids


def test_dense_layers_plan_from_slimes_moe_layer_freq():
    rng = np.random.default_rng(11)
    routed, lens, ids = dense_rollout(rng, 4, 30)
    args = args_for(30, 2)
    args.num_layers, args.moe_layer_freq = 3, [0, 1, 1]  # slime's Megatron arguments for the model
    manager = RoutepackRolloutManager(args, parallel_config(2), cost_model(2, E), anneal_moves=200)
    data = rollout_data(routed, lens, ids)
    ranks = manager._split_train_data_by_dp(data)
    assert manager.routepack.fell_back is None and manager.routepack_metrics["routepack/planned"] == 1.0
    for plan, w in zip(manager.routepack.last_plans, manager.routepack.last_windows):
        assert w.num_layers == 2 and plan.placement.phy2log.shape[0] == 2  # keyed by the 2 MoE layers
    for rank in ranks:
        assert rank[rs.PLANS_KEY] is not None and len(rank["micro_batch_indices"]) == sum(rank["num_microbatches"])


def test_routes_it_cannot_plan_fall_back_to_slimes_schedule(caplog):
    """The same dense rollout with args that do not say which layers are dense: routepack
    cannot count row 0 (expert 0 twice), so slime's own build_dp_schedule runs, the reason is
    logged once, and no plans ship."""
    rng = np.random.default_rng(11)
    routed, lens, ids = dense_rollout(rng, 4, 30)
    args = args_for(30, 2)
    args.num_layers = 3  # moe_layer_freq unset: Megatron's default 1, every layer MoE
    rs.FALLBACKS.clear()
    manager = RoutepackRolloutManager(args, parallel_config(2), cost_model(2, E), anneal_moves=200)
    with caplog.at_level("WARNING", logger="routepack.integrations.slime"):
        for _ in range(2):
            ranks = manager._split_train_data_by_dp(rollout_data(routed, lens, ids))
    theirs = RolloutManager(args_for(30, 2), parallel_config(2))._split_train_data_by_dp(
        rollout_data(routed, lens, ids)
    )
    assert [r["partition"] for r in ranks] == [r["partition"] for r in theirs]
    assert [r["micro_batch_indices"] for r in ranks] == [r["micro_batch_indices"] for r in theirs]
    assert all(r.get(rs.PLANS_KEY) is None for r in ranks)  # begin_step runs the placement in force
    assert "lists expert 0 twice" in manager.routepack.fell_back and "moe_layers" in manager.routepack.fell_back
    assert manager.routepack_metrics["routepack/planned"] == 0.0 and rs.FALLBACKS == {"RoutepackError": 2}
    logged = [r for r in caplog.records if "slime's own build_dp_schedule runs instead" in r.getMessage()]
    assert len(logged) == 1
