"""routepack's plans carried out whole in verl's Megatron engine (CPU, gloo, 2 ranks, EP 2):
verl's driver (``_balance_batch`` hooked, ``_update_actor``) plans 2 steps of 2 PPO
mini-batches each from skewed R3 routes that drift between steps; verl's worker
(``TrainingWorker.train_mini_batch`` / ``train_batch``) and Megatron engine
(``MegatronEngineWithLMHead``: model built by its ``_build_megatron_module`` through the
bridge, optimizer by ``_build_optimizer``, ``forward_backward_batch``, ``forward_step`` with
verl's R3 replay, ``optimizer_step``, ``get_per_tensor_param``) train Megatron-Core's GPTModel
(local spec, fp32, 8 experts top-2, 5 slots and 2 replica buffers a rank) with migration,
redundant experts and replicas, next to the stock model (Megatron's static placement) on the
same microbatches:

* losses per microbatch equal to 1e-5, and the logical weights after training;
* the weight export verl syncs to the rollout engine equals the stock model's;
* every planned mini-batch ran planned (``begin_window``) and the plans moved experts and held
  redundant copies and replicas.

What stands in for verl (no mbridge, no Transformer Engine, no HF checkpoint): see
tests/verl_megatron_harness.py; Megatron's CUDA-only calls: tests/megatron_cpu.py."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable")
pytest.importorskip("verl", reason="verl not importable")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5
STEPS, MINIBATCH, BATCH, P, R = 2, 4, 8, 6, 10
LAYOUT = {"slots_per_rank": 5, "replica_slots": 2}


def skew_routes(proto, case, step):
    """Each real routed row drawn from a skewed popularity that moves between steps."""
    rng = np.random.default_rng([case.seed, 5, step])
    routed = proto.batch["routed_experts"].numpy()
    real = np.abs(routed).sum(axis=(2, 3)) > 0
    for l in range(case.layers):
        pop = np.roll(np.array([0.4, 0.25, 0.1, 0.08, 0.07, 0.04, 0.03, 0.03]), 3 * step + l)
        for b, t in zip(*np.nonzero(real)):
            routed[b, t, l] = rng.choice(case.experts, size=case.top_k, replace=False, p=pop)
    proto.batch["routed_experts"] = torch.from_numpy(routed)


def train_rank(rank, world, device, plan_model):
    import megatron_cpu

    megatron_cpu.install(optimizers=True)
    os.environ["RAY_LOCAL_WORLD_SIZE"] = "2"
    from megatron.core import parallel_state

    import routepack as rp
    import verl_harness as vh
    import verl_megatron_harness as vmh
    import megatron_selfcheck as ms
    from routepack.integrations.verl import megatron_engine as vm
    from routepack.integrations import megatron as rm
    from routepack.integrations import verl as rv
    from routepack.stages.policy import Policy

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(dp=2, ep=2, slots_per_rank=5, replica_slots=2, token_cap=64, lr=1e-2)
    mb = "actor_rollout_ref.actor.megatron"
    cfg = vh.verl_config(
        "megatron",
        **{
            "actor_rollout_ref.actor.ppo_mini_batch_size": MINIBATCH,
            "actor_rollout_ref.actor.ppo_epochs": 1,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": case.token_cap,
            f"{mb}.vanilla_mbridge": True,
            f"{mb}.expert_model_parallel_size": 2,
            f"{mb}.router_replay.mode": "R3",
            f"{mb}.override_transformer_config.moe_grouped_gemm": False,  # the stand-in bridge builds SequentialMLP
            f"{mb}.override_mcore_model_config": {"routepack": dict(LAYOUT)},
        },
    )
    shape = rp.ModelShape(num_layers=case.layers, num_experts=case.experts, top_k=case.top_k, hidden=64, expert_ffn=32)
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    # EPLB's placement fills every slot (redundant copies) and follows the drifting loads (migration);
    # hot_n copies the hot experts in every microbatch (replicas): every part of a plan runs
    inst = rv.install(cfg, cost, policy=Policy("eplb", "routepack", "hot_n"), seed=1)
    if not plan_model:
        vm.unpatch_engine()  # the stock model: verl's engine as shipped, the same planned microbatches
    engine = vmh.make_engine(case, plan_model, LAYOUT, case.lr)
    worker = vmh.training_worker(engine, vmh.response_nll, case.token_cap)
    trainer = vh.Trainer(cfg, [])
    trainer.actor_rollout_wg = vmh.LocalGroup(rank, world, worker)
    losses, plans = [], []
    for step in range(1, STEPS + 1):
        trainer.global_steps = step
        proto = vmh.batches(case, step, BATCH, P, R)
        skew_routes(proto, case, step)
        metrics = {}
        trainer.balance(proto, metrics)
        assert metrics["routepack/planned"] == 1.0, metrics
        proto.meta_info.update({"temperature": 1.0})
        out = trainer.update_actor(proto)
        losses.append(worker_losses(out))
        plans += inst.last.plans
    handoff = vm.HANDOFFS.get(id(engine))
    exported, _ = engine.get_per_tensor_param()
    exported = {k: v.detach().numpy().copy() for k, v in exported}
    weights = {k: v.detach().numpy().copy() for k, v in rm.export_weights(engine.module)}
    return {
        "losses": losses,
        "weights": weights,
        "exported": exported,
        "plans_run": None if handoff is None else handoff.plans_run,
        "unplanned": None if handoff is None else handoff.unplanned_steps,
        "migrated": sum(len(p.migration) for p in plans),
        "replicas": sum(len(p.replicas) for p in plans),
        "redundant": int(
            sum((p.placement.phy2log >= 0).sum() - p.placement.num_experts * p.placement.num_layers for p in plans)
        ),
        "runs": inst.report()["runs"],
    }


def worker_losses(out):
    """The step's per-microbatch losses verl's worker reported (``metrics['loss']``)."""
    from verl.utils import tensordict_utils as tu

    metrics = tu.get(out, "metrics") if not hasattr(out, "meta_info") else out.meta_info["metrics"]
    value = metrics.get("loss", metrics.get("actor/loss"))
    return [float(x) for x in (value if isinstance(value, list) else [value])]


def _flat(losses):
    out = []
    for x in losses:
        out += [float(v) for v in (x if isinstance(x, list) else [x])]
    return np.array(out)


def test_verl_megatron_engine_runs_the_whole_plan():
    planned = run_ranks(train_rank, 2, True, join_timeout_s=600, pg_timeout_s=180)
    stock = run_ranks(train_rank, 2, False, join_timeout_s=600, pg_timeout_s=180)
    for rank in (0, 1):
        a, b = planned[rank], stock[rank]
        assert a["runs"]["placement"] and a["runs"]["replicas"], a["runs"]
        assert a["plans_run"] == STEPS * BATCH // MINIBATCH and a["unplanned"] == 0, (a["plans_run"], a["unplanned"])
        assert a["migrated"] > 0 and a["replicas"] > 0 and a["redundant"] > 0, (a["migrated"], a["replicas"])
        la, lb = _flat(a["losses"]), _flat(b["losses"])
        assert la.shape == lb.shape and np.abs(la - lb).max() <= TOL, (la, lb)
        assert set(a["weights"]) == set(b["weights"])
        assert max(float(np.abs(a["weights"][k] - b["weights"][k]).max()) for k in a["weights"]) <= TOL
        assert set(a["exported"]) == set(b["weights"])
        assert max(float(np.abs(a["exported"][k] - b["weights"][k]).max()) for k in a["exported"]) <= TOL
