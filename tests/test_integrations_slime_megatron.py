"""routepack's plans carried out whole in slime's Megatron actor (CPU, gloo, 2 ranks, EP 2):
slime's driver (``_split_train_data_by_dp`` with ``plan_dp_schedule`` and ``step_plans``) plans
2 rollouts of 2 training steps from skewed R3 routes that drift between rollouts; slime's actor
(tests/slime_megatron_harness.py: ``train`` / ``train_one_step`` with ``begin_step`` and
``finish_step``, its model built through ``--spec routepack.integrations.slime layer_spec``)
trains Megatron-Core's GPTModel (fp32, 8 experts top-2, 5 slots and 2 replica buffers a rank)
with migration, redundant experts and replicas, next to slime's stock model (Megatron's static
placement) on the same microbatches, each rollout after a reference-model log-prob pass
(slime's weight backups switched through ``named_params_and_buffers``):

* training losses per microbatch and the reference passes' losses equal to 1e-5;
* the logical weights (`export_weights`) and what slime's weight update reads
  (``named_params_and_buffers``, verbatim from slime, through ``stock_layout``) equal the
  stock model's, and its weight backups restore across migrations;
* every step ran planned, and the plans moved experts and held redundant copies and replicas.

What stands in for slime: tests/slime_megatron_harness.py; Megatron's CUDA-only calls:
tests/megatron_cpu.py."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routepack as rp  # noqa: E402
from routepack.integrations import slime as rs  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5
ROLLOUTS, SAMPLES, GBS, CAP = 2, 8, 4, 32  # 2 steps of 4 samples a rollout, 2 microbatches a rank


def rank_main(rank, world, device):
    import megatron_cpu

    megatron_cpu.install(optimizers=True)
    from megatron.core import parallel_state

    import slime_megatron_harness as sh
    from slime_split_standin import RoutepackRolloutManager
    import megatron_selfcheck as ms
    from routepack.integrations.slime import actor as sm
    from routepack.stages.policy import Policy

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(dp=2, ep=2, slots_per_rank=5, replica_slots=2, token_cap=CAP, lr=1e-2)
    a_plan, a_stock = sh.slime_args(case, True, CAP, GBS), sh.slime_args(case, False, CAP, GBS)
    stock, stock_opt = sh.setup_model_and_optimizer(a_stock, case, init=True)
    plan, plan_opt = sh.setup_model_and_optimizer(a_plan, case, init=False)
    sh.load_weights(a_plan, plan, dict(sh.named_params_and_buffers(a_stock, stock)))  # slime's HF load
    initial = sh.exported(stock)
    loaded = _close(sh.exported(plan), initial)
    backups = {}
    for name, args, model in (("plan", a_plan, plan), ("stock", a_stock, stock)):
        b = sh.slime_src.TensorBackuper.create(
            lambda args=args, model=model: sh.named_params_and_buffers(args, model), None
        )
        b.backup("ref")
        b.backup("actor")
        backups[name] = b
    shape = rp.ModelShape(num_layers=case.layers, num_experts=case.experts, top_k=case.top_k, hidden=64, expert_ffn=32)
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    # EPLB's placement fills every slot (redundant copies) and follows the drifting loads (migration);
    # hot_n copies the hot experts in every microbatch (replicas): every part of a plan runs
    driver = RoutepackRolloutManager(
        a_plan,
        {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1},
        cost,
        policy=Policy("eplb", "routepack", "hot_n"),
        seed=1,
    )
    out = {"train": {"plan": [], "stock": []}, "ref": {"plan": [], "stock": []}, "migrated": 0, "replicas": 0}
    out["redundant"] = 0
    for rollout_id in range(ROLLOUTS):
        mine = driver._split_train_data_by_dp(sh.rollout(case, rollout_id, SAMPLES, CAP))[rank]
        plans = driver.routepack.last_plans
        out["migrated"] += sum(len(p.migration) for p in plans)
        out["replicas"] += sum(len(p.replicas) for p in plans)
        out["redundant"] += int(
            sum((p.placement.phy2log >= 0).sum() - p.placement.num_experts * p.placement.num_layers for p in plans)
        )
        stock_data = {k: v for k, v in mine.items() if k != rs.PLANS_KEY}  # slime without routepack
        for name, args, model, opt, data in (
            ("stock", a_stock, stock, stock_opt, stock_data),
            ("plan", a_plan, plan, plan_opt, mine),
        ):
            backups[name].restore("ref")  # slime's train_actor: the reference model's log-probs first
            out["ref"][name].append(sh.forward_only(args, case, model, data))
            backups[name].restore("actor")
            out["train"][name].append(sh.train(args, case, model, opt, data))
            backups[name].backup("actor")
    out["weights"] = {n: sh.exported(m) for n, m in (("plan", plan), ("stock", stock))}
    out["slime_view"] = {n: sh.slime_view(a, m) for n, a, m in (("plan", a_plan, plan), ("stock", a_stock, stock))}
    backups["plan"].restore("ref")  # after 4 windows of migration: the initial weights come back
    out["restored_ref"] = sh.exported(plan)
    backups["plan"].restore("actor")
    out["restored_actor"] = sh.exported(plan)
    h = sm.handoff(plan)
    out.update(loaded=loaded, initial=initial, plans_run=h.plans_run, unplanned=h.unplanned_steps)
    out["runs"] = driver.routepack.runs.as_dict()
    return out


def _close(a, b, tol=TOL):
    return set(a) == set(b) and max(float(np.abs(a[k] - b[k]).max()) for k in a) <= tol


def _flat(nested):
    return np.array([x for rollout in nested for step in rollout for x in (step if isinstance(step, list) else [step])])


def test_slime_actor_runs_the_whole_plan():
    got = run_ranks(rank_main, 2, join_timeout_s=900, pg_timeout_s=300)
    for rank in (0, 1):
        r = got[rank]
        assert r["runs"]["placement"] and r["runs"]["replicas"], r["runs"]
        assert r["loaded"], "the plan model did not load the stock weights through the stock-layout view"
        assert r["plans_run"] == ROLLOUTS * SAMPLES // GBS and r["unplanned"] == 0, (r["plans_run"], r["unplanned"])
        assert r["migrated"] > 0 and r["replicas"] > 0 and r["redundant"] > 0, (r["migrated"], r["replicas"])
        for kind in ("train", "ref"):
            a, b = _flat(r[kind]["plan"]), _flat(r[kind]["stock"])
            assert a.shape == b.shape and a.size and np.abs(a - b).max() <= TOL, (kind, a, b)
        assert _close(r["weights"]["plan"], r["weights"]["stock"])
        assert _close(r["slime_view"]["plan"], r["slime_view"]["stock"])
        assert _close(r["restored_actor"], r["weights"]["stock"])
        assert _close(r["restored_ref"], r["initial"])  # the reference backup, restored after 4 migrating steps
        assert not _close(r["initial"], r["weights"]["stock"], tol=1e-4)  # training moved the weights


def test_limits_name_the_option():
    base = dict(
        num_experts=8,
        expert_model_parallel_size=2,
        num_gpus_per_node=2,
        spec=["routepack.integrations.slime", "layer_spec"],
    )
    assert rs.limits(SimpleNamespace(**base)) is None
    assert rs.limits(SimpleNamespace(**{**base, "spec": None, "routepack_plan_spec": True})) is None
    for extra, flag in (
        ({"spec": None}, "--spec is None"),
        ({"spec": ["my_model", "my_spec"]}, "--spec is ['my_model', 'my_spec']"),
        ({"num_experts": None}, "--num-experts"),
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size=2"),
        ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size=2"),
        ({"virtual_pipeline_model_parallel_size": 2}, "--num-layers-per-virtual-pipeline-stage"),
        ({"context_parallel_size": 2}, "--context-parallel-size=2"),
        ({"expert_tensor_parallel_size": 2}, "--expert-tensor-parallel-size=2"),
        ({"moe_layer_freq": [0, 1]}, "--moe-layer-freq"),
        ({"mtp_num_layers": 1}, "--mtp-num-layers"),
        ({"use_critic": True}, "--use-critic"),
        ({"moe_grouped_gemm": True}, "--moe-grouped-gemm"),
        ({"overlap_param_gather": True}, "--overlap-param-gather"),
        ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type=flex"),
    ):
        why = rs.limits(SimpleNamespace(**{**base, **extra}))
        assert why is not None and flag in why, (extra, why)
    assert rs.limits(SimpleNamespace(**base, moe_layer_freq=[1, 1])) is None
