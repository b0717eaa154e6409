"""`routepack.integrations.verl.install` on verl's own code (verl 0.9.1, CPU; tests/verl_harness.py
says exactly what runs for real and what stands in): the driver's ``_balance_batch`` plans
every PPO mini-batch from the batch's R3 routes (or, in R2, from the routes the previous
step's log-prob pass recorded), verl's dispatcher and worker (``train_mini_batch``,
``make_iterator``) cut the planned mini-batches in every epoch, and the engine's
``prepare_micro_batches`` returns the planned microbatches, whose outputs verl restores in
order. Every refusal and fallback names its option. Skipped where verl's trainer does not
import, except in CI (tests/conftest.py: CI_REQUIRES), where that fails."""

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.ray_trainer")  # in CI a skip here fails (tests/conftest.py)
pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
torch = pytest.importorskip("torch")

import routepack as rp  # noqa: E402
import verl_harness as vh  # noqa: E402
from routepack.integrations import verl as rv  # noqa: E402
from routepack.integrations.verl import hooks as _verl_hooks  # noqa: E402
from routepack.integrations.verl.plans import slice_window  # noqa: E402
from routepack.integrations.shared.trainer import window_from_loads  # noqa: E402
from verl_batches import cost_model, distinct_topk, verl_batch  # noqa: E402

P, R, L, K, E = 8, 24, 2, 2, 6
CAP = 36


@pytest.fixture(autouse=True)
def clean():
    rv.reset_fallbacks()
    yield
    if rv.active() is not None:
        rv.active().uninstall()
    _verl_hooks.unpatch()


def config(backend="fsdp", **values):
    base = {
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": CAP,
    }
    return vh.verl_config(backend, **{**base, **values})


def batch(seed, size=16):
    rng = np.random.default_rng(seed)
    vb = verl_batch(rng, size, P, R, L, K, E)
    vb.response_mask[:, 0] = 1  # every sample has a response (verl's batches do)
    vb.attention_mask[:, P] = 1
    return vh.data_proto(vb, P)


def positions(entry):
    return entry["micro"]


def check_step(inst, trainer, log, proto, window, epochs, dp=2):
    """Balance, log-prob pass and PPO update of one step, against the plans."""
    metrics = {}
    trainer.balance(proto, metrics)
    assert metrics["routepack/planned"] == 1.0, rv.FALLBACKS
    for key in (
        "routepack/step_time_s",
        "routepack/max_vio/max",
        "routepack/max_vio/layer_1",
        "routepack/experts_migrated",
    ):
        assert key in metrics
    assert metrics["timing_s/routepack_plan"] > 0 and metrics["global_seqlen/balanced_max"] > 0
    sp = inst.last
    mbs = inst.settings["minibatch_size"]
    for j, (plan, sub) in enumerate(zip(sp.plans, sp.windows)):
        plan.validate(sub, sp.topo, sp.token_cap)
        if window is not None:
            assert sub == slice_window(window, j * mbs, (j + 1) * mbs)
    payload = [sp.payload[rv.plan_key(sp.step, j)] for j in range(len(sp.plans))]
    # the log-prob pass (forward only): the rank's whole chunk, every mini-batch's microbatches in turn
    log.clear()
    old, _ = trainer.old_log_prob(proto)
    resp = proto.batch["response_mask"].sum(-1)
    for b in range(len(proto)):  # verl restored the outputs in batch order (log-prob = position)
        assert (old.batch["old_log_probs"][b, : int(resp[b])] == b).all()
    for entry in log:
        assert positions(entry) == [c for p in payload for c in p["ranks"][entry["rank"]]]
    # the PPO update: every epoch, every mini-batch, the planned microbatches
    log.clear()
    trainer.update_actor(proto)
    for r in range(dp):
        mine = [e for e in log if e["rank"] == r]
        assert len(mine) == epochs * len(payload)
        for i, entry in enumerate(mine):
            assert positions(entry) == payload[i % len(payload)]["ranks"][r]
            assert all(t <= inst.settings["token_cap"] for t in entry["tokens"])
    assert not rv.FALLBACKS
    return sp


def test_every_minibatch_and_epoch_runs_its_plan_r3():
    cfg = config()
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    assert inst.report()["runs"]["placement"] is False and inst.report()["minibatch_size"] == 8
    trainer, log = vh.harness("fsdp", 2, cfg)
    for step in (1, 2):
        trainer.global_steps = step
        proto = batch(step)
        window = rv.window_from_verl(proto.batch, num_experts=E)  # before the reorder
        sp = check_step(inst, trainer, log, proto, window, epochs=2)
        assert len(sp.plans) == 2 and min(p.num_micro for p in sp.plans) >= 2  # several microbatches a mini-batch


def test_r2_plans_from_the_previous_steps_routes(caplog):
    cfg = config("megatron", **{"actor_rollout_ref.actor.megatron.router_replay.mode": "R2"})
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    rng = np.random.default_rng(9)
    trainer, log = vh.harness(
        "megatron", 2, cfg, record_routes=lambda n: torch.from_numpy(distinct_topk(rng, n, L, K, E))
    )
    previous = None
    for step in (1, 2, 3):
        trainer.global_steps = step
        proto = batch(10 + step)
        del proto.batch["routed_experts"]  # R2: no rollout routes
        if step == 1:
            with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
                metrics = {}
                trainer.balance(proto, metrics)
            assert metrics["routepack/planned"] == 0.0 and rv.FALLBACKS["r2_first"] == 1
            assert "R2: no routes recorded yet" in caplog.text
            old, _ = trainer.old_log_prob(proto)
        else:
            lens = proto.batch["attention_mask"].sum(-1).numpy()
            sp = check_step(inst, trainer, log, proto, window_from_loads(lens, previous), epochs=2)
            assert sp.step == step
            old, _ = trainer.old_log_prob(proto)
        routes = old.batch["routed_experts"]  # what the log-prob pass recorded, per sample
        recorded = rp.Window.from_routed_experts(routes.values().numpy(), routes.offsets().numpy(), E)
        assert inst.previous == recorded
        previous = recorded
        rv.reset_fallbacks()


def test_vpp_multiple_is_planned_and_checked_by_the_worker(caplog):
    vpp = {
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": 2,
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2,
    }
    cfg = config("megatron", **vpp, **{"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 64})
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    assert inst.settings["multiple"] == 2
    trainer, log = vh.harness("megatron", 2, cfg)
    for w in trainer.actor_rollout_wg.workers:
        w.engine.vpp_group = 2  # what Megatron's engine passes as num_batches_divided_by
    sp = check_step(inst, trainer, log, batch(3), None, epochs=2)
    assert all(p.num_micro % 2 == 0 for p in sp.plans)
    for w in trainer.actor_rollout_wg.workers:
        w.engine.vpp_group = 3  # a worker whose VPP group the plans were not made for
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        trainer.update_actor(next(iter([proto_after_balance(trainer, 4)])))
    assert rv.FALLBACKS["vpp"] > 0 and "microbatch_group_size_per_vp_stage" in caplog.text
    assert caplog.text.count("microbatch_group_size_per_vp_stage") == 1  # logged once


def proto_after_balance(trainer, seed):
    proto = batch(seed)
    trainer.balance(proto, {})
    sp = rv.active().last
    for plan, sub in zip(sp.plans, sp.windows):
        plan.validate(sub, sp.topo, sp.token_cap)
    return proto


def test_force_group_size_keeps_groups_together():
    cfg = config(**{"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 80})
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300, force_group_size=2)
    trainer, log = vh.harness("fsdp", 2, cfg)
    for w in trainer.actor_rollout_wg.workers:
        w.engine.force_group_size = 2
    proto = batch(5)
    check_step(inst, trainer, log, proto, None, epochs=2)
    order = inst.last.order
    for entry in log:
        for micro in entry["micro"]:
            originals = sorted(int(order[p]) for p in micro)
            assert [o // 2 for o in originals[0::2]] == [o // 2 for o in originals[1::2]]
    for w in trainer.actor_rollout_wg.workers:
        w.engine.force_group_size = 1
    trainer.update_actor(proto)
    assert rv.FALLBACKS["group"] > 0


@pytest.mark.parametrize(
    "key, value, option",
    [
        ("actor_rollout_ref.actor.use_dynamic_bsz", False, "use_dynamic_bsz"),
        ("actor_rollout_ref.actor.shuffle", True, "actor_rollout_ref.actor.shuffle"),
        ("trainer.balance_batch", False, "trainer.balance_batch"),
        ("actor_rollout_ref.actor.use_prefix_grouper", True, "use_prefix_grouper"),
        ("actor_rollout_ref.actor.strategy", "veomni", "actor_rollout_ref.actor.strategy"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 0, "ppo_max_token_len_per_gpu"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 0, "actor_rollout_ref.actor.ppo_mini_batch_size"),
        ("actor_rollout_ref.rollout.n", 0, "actor_rollout_ref.rollout.n"),
        ("actor_rollout_ref.actor.ppo_epochs", 0, "actor_rollout_ref.actor.ppo_epochs"),
    ],
)
def test_config_refusals_name_the_option(key, value, option):
    with pytest.raises(rp.RoutepackError, match=option):
        rv.install(config(**{key: value}), cost_model(L, E))
    assert rv.active() is None


def test_dynamic_context_parallel_is_refused():
    cfg = config("megatron", **{"actor_rollout_ref.actor.megatron.dynamic_context_parallel": True})
    with pytest.raises(rp.RoutepackError, match="dynamic_context_parallel"):
        rv.install(cfg, cost_model(L, E))


def test_the_backend_picks_the_policy():
    with pytest.raises(rp.RoutepackError, match="policy: 'routepack' plans expert placement.*backend='fsdp'"):
        rv.install(config(), cost_model(L, E), policy="routepack")
    with pytest.raises(rp.RoutepackError, match="policy: 'hot_n' plans intra-batch replicas.*backend='megatron'"):
        rv.install(config("megatron"), cost_model(L, E), policy="hot_n")
    with pytest.raises(rp.RoutepackError, match="slots_per_rank"):
        rv.install(config("megatron"), cost_model(L, E), slots_per_rank=E + 2)
    # verl's default Megatron engine (Megatron-Bridge) runs the schedule alone, named
    inst = rv.install(config("megatron"), cost_model(L, E))
    assert inst.planner.policy_name == "routepack_packing" and "vanilla_mbridge" in inst.planner.runs.why
    assert "placement: does not run" in inst.describe() and "vanilla_mbridge" in inst.describe()
    mb = "actor_rollout_ref.actor.megatron"
    layout = {
        f"{mb}.vanilla_mbridge": True,
        f"{mb}.router_replay.mode": "R3",
        f"{mb}.override_transformer_config.moe_grouped_gemm": False,
        f"{mb}.override_mcore_model_config": {"routepack": {"slots_per_rank": 5}},
    }
    inst = rv.install(
        config("megatron", **layout), cost_model(L, E)
    )  # ppo_epochs=2: mini-batches rerun in another order
    assert inst.planner.policy_name == "routepack_packing" and "ppo_epochs=2" in inst.planner.runs.why
    layout["actor_rollout_ref.actor.ppo_epochs"] = 1
    inst = rv.install(config("megatron", **layout), cost_model(L, E))  # no replica buffers: placement alone
    assert inst.planner.policy_name == "routepack_no_replication" and inst.planner.slots_per_rank == 5
    assert inst.report()["runs"] == {
        "schedule": True,
        "placement": True,
        "replicas": False,
        "why": inst.planner.runs.why,
    }
    assert "replica_slots is 0" in inst.planner.runs.why
    layout[f"{mb}.override_mcore_model_config"] = {"routepack": {"slots_per_rank": 5, "replica_slots": 2}}
    inst = rv.install(config("megatron", **layout), cost_model(L, E))
    assert inst.planner.policy_name == "routepack" and inst.planner.topology(2).replica_slots == 2
    for key, value in (("tensor_model_parallel_size", 2), ("pipeline_model_parallel_size", 2)):
        inst = rv.install(config("megatron", **layout, **{f"{mb}.{key}": value}), cost_model(L, E))
        assert inst.planner.policy_name == "routepack_packing" and key in inst.planner.runs.why
    with pytest.raises(rp.RoutepackError, match="slots_per_rank: 6, but the workers build 5"):
        rv.install(config("megatron", **layout), cost_model(L, E), slots_per_rank=6)
    ckpt = {
        "trainer.save_freq": 5,
        "actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer"],
        f"{mb}.dist_ckpt_optim_fully_reshardable": True,  # else refused for the format (test_integrations_verl_v1)
    }
    with pytest.raises(
        rp.RoutepackError, match=r"checkpoint.save_contents holds 'optimizer'.*save \['model', 'extra'\]"
    ):
        rv.install(config("megatron", **layout, **ckpt), cost_model(L, E))
    with pytest.raises(rp.RoutepackError, match="override_mcore_model_config.routepack: unknown key"):
        rv.install(
            config("megatron", **{f"{mb}.override_mcore_model_config": {"routepack": {"slot": 1}}}), cost_model(L, E)
        )
    assert rv.backend_policy("fsdp")[0] == "routepack_packing"


def test_driver_and_worker_fallbacks_are_logged_once_and_named(caplog):
    cfg = config()
    rv.install(cfg, cost_model(L, E), anneal_moves=300)
    trainer, log = vh.harness("fsdp", 2, cfg)
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        for step in (1, 2):  # R3 without routes: verl's balancing, said once
            proto = batch(step)
            del proto.batch["routed_experts"]
            metrics = {}
            trainer.balance(proto, metrics)
            assert metrics["routepack/planned"] == 0.0 and "global_seqlen/balanced_max" in metrics
    assert caplog.text.count("enable_rollout_routing_replay") == 1 and rv.FALLBACKS["no_routes"] == 2
    caplog.clear()
    proto = proto_after_balance(trainer, 7)  # planned with mini-batches of 8 samples
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf
    OmegaConf.update(
        cfg, "actor_rollout_ref.actor.ppo_mini_batch_size", 2, merge=False
    )  # a critic cutting mini-batches of 4
    log.clear()
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        trainer.update_actor(proto)
    assert rv.FALLBACKS["partial"] == 2 * 4 * 2 and caplog.text.count("ppo_mini_batch_size") == 1
    assert all(entry["sizes"] and sum(entry["sizes"]) == 2 for entry in log)  # verl's own microbatches ran


def test_uninstall_restores_verl():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine import utils
    from verl.workers.engine.fsdp import transformer_impl

    before = (RayPPOTrainer._balance_batch, utils.prepare_micro_batches, transformer_impl.prepare_micro_batches)
    inst = rv.install(config(), cost_model(L, E))
    assert transformer_impl.prepare_micro_batches is not before[2]
    inst.uninstall()
    assert (RayPPOTrainer._balance_batch, utils.prepare_micro_batches, transformer_impl.prepare_micro_batches) == before


ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path(rp.__file__).resolve().parent.parent  # where the routepack under test lives


def run_script(code, timeout=300):
    import os

    env = {**os.environ, "PYTHONPATH": f"{PACKAGE_DIR}:{ROOT}"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_setup_process_hooks_a_fresh_process_and_installs_from_the_config(tmp_path):
    cost_path = tmp_path / "cost.json"
    cost_model(L, E).save(cost_path)
    out = run_script(
        f"""
        import numpy as np
        from routepack.integrations import verl as rv
        rv.setup_process()  # what Ray's worker_process_setup_hook runs
        from verl.workers.engine.fsdp import transformer_impl
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from routepack.integrations.verl import hooks as _verl_hooks
        assert transformer_impl.prepare_micro_batches is _verl_hooks._prepare_micro_batches
        assert RayPPOTrainer._balance_batch is _verl_hooks._balance_batch
        import verl_harness as vh
        from test_integrations_verl_hooks import config, batch
        cfg = config()
        from omegaconf import OmegaConf
        OmegaConf.update(cfg, "routepack", {{"cost": "{cost_path}", "anneal_moves": 200}}, merge=False, force_add=True)
        trainer, log = vh.harness("fsdp", 2, cfg)
        metrics = {{}}
        trainer.balance(batch(1), metrics)
        sp = rv.active().last
        for plan, sub in zip(sp.plans, sp.windows):
            plan.validate(sub, sp.topo, sp.token_cap)
        print("planned", metrics["routepack/planned"], rv.active().describe())
        """
    )
    assert "planned 1.0 routepack on verl (legacy trainer, fsdp" in out


def test_dp_group_ranks_agree_before_taking_a_plan(tmp_path):
    """Two gloo ranks: rank 1's batch is stale, so both take verl's path (whose own
    all-reduce of the microbatch count then runs on both), and rank 0 says why. verl's
    path puts its all-reduce on ``get_device_name()``, "cuda" on a machine without
    accelerators: the ranks point it at the CPU."""
    script = f"""
        import sys, json, numpy as np, torch, torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
        from verl.utils import tensordict_utils as tu, seqlen_balancing
        seqlen_balancing.get_device_name = lambda: "cpu"  # verl picks "cuda" on a machine without accelerators
        from routepack.integrations import verl as rv
        from routepack.integrations.verl import hooks as _verl_hooks
        from routepack.integrations.shared.trainer import TrainerPlanner
        from verl_batches import cost_model
        rv.reset_fallbacks()
        _verl_hooks.patch_workers()
        from verl.workers.engine import utils
        rng = np.random.default_rng(0)
        lens = rng.integers(1, 20, size=8)
        w = rv.window_from_verl(routed_experts=np.zeros((8, 20, 1, 1), np.int16), attention_mask=(np.arange(20) < lens[:, None]).astype(np.int64), num_experts=2, mode="R2")
        sp = rv.step_plans(TrainerPlanner(cost_model(1, 2), "fsdp"), w, 2, 8, 40, step=5)
        for plan, sub in zip(sp.plans, sp.windows):
            plan.validate(sub, sp.topo, 40)
        rows = list(range(4 * rank, 4 * rank + 4))
        ids = torch.from_numpy(sp.sample_ids[rows])
        if rank == 1:
            ids[:, 0] = 4  # a stale plan on this rank only
        n = torch.from_numpy(w.seq_lens[sp.order][rows])
        mask = (torch.arange(20) < n[:, None]).long()
        td = tu.get_tensordict({{"attention_mask": mask, "input_ids": mask, "routepack_sample": ids}}, {{**sp.payload, "max_token_len_per_gpu": 40}})
        micro, idx = utils.prepare_micro_batches(td, dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
        print(json.dumps({{"rank": rank, "fallbacks": dict(rv.FALLBACKS), "micro": len(micro)}}))
        dist.destroy_process_group()
    """
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(script))
    import os

    env = {**os.environ, "PYTHONPATH": f"{PACKAGE_DIR}:{ROOT}"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    import json

    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert results[0]["fallbacks"] == {"disagree": 1} and results[1]["fallbacks"] == {"stale": 1}
    assert results[0]["micro"] == results[1]["micro"]  # verl's path, its count agreed over the group


def test_rays_setup_hook_hooks_an_actor_process():
    """Ray itself (a local one-CPU cluster): the job's ``worker_process_setup_hook`` given as
    the string docs/trainers.md puts in verl's config hooks verl in an actor's process."""
    pytest.importorskip("ray")
    out = run_script(
        f"""
        import ray
        ray.init(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False,
                 runtime_env={{"worker_process_setup_hook": "routepack.integrations.verl.setup_process",
                              "env_vars": {{"PYTHONPATH": "{PACKAGE_DIR}"}}}})

        @ray.remote
        class Probe:
            def check(self):
                from verl.workers.engine.fsdp import transformer_impl
                from verl.trainer.ppo.ray_trainer import RayPPOTrainer
                from routepack.integrations.verl import hooks as h
                return (transformer_impl.prepare_micro_batches is h._prepare_micro_batches,
                        RayPPOTrainer._balance_batch is h._balance_batch, h._LAZY)

        print("hooked", ray.get(Probe.remote().check.remote()))
        ray.shutdown()
        """,
        timeout=600,
    )
    assert "hooked (True, True, True)" in out


def test_more_driver_fallbacks_name_their_cause(caplog):
    """A sample over the cap (planner), and R2 routes that cannot be read."""
    cfg = config(**{"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 20})
    rv.install(cfg, cost_model(L, E), anneal_moves=300)
    trainer, _ = vh.harness("fsdp", 2, cfg)
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        metrics = {}
        trainer.balance(batch(1), metrics)
    assert metrics["routepack/planned"] == 0.0 and rv.FALLBACKS["planner"] == 1
    assert "more than token_cap = 20" in caplog.text and "ppo_max_token_len_per_gpu" in caplog.text
    rv.active().uninstall()
    rv.reset_fallbacks()
    caplog.clear()
    cfg = config("megatron", **{"actor_rollout_ref.actor.megatron.router_replay.mode": "R2"})
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    bad = lambda n: torch.full((n, L, K), E + 1, dtype=torch.int16)  # noqa: E731  ids outside [0, E)
    trainer, _ = vh.harness("megatron", 2, cfg, record_routes=bad)
    proto = batch(2)
    trainer.balance(proto, {})
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        trainer.old_log_prob(proto)
    assert rv.FALLBACKS["r2_routes"] == 1 and inst.previous is None
    assert "R2: the recorded routes cannot be read (routed_experts[0]: expert id 7 at token 0 (sample 0)" in caplog.text


def test_worker_static_and_min_micro_fallbacks_name_the_option(caplog):
    """A pass that runs verl's fixed-size path, and one that asks for more microbatches."""
    from verl.utils import tensordict_utils as tu

    cfg = config()
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    trainer, _ = vh.harness("fsdp", 2, cfg)
    proto = proto_after_balance(trainer, 3)
    rows = list(range(4))  # DP rank 0's share of mini-batch 0
    td = vh.left_right_2_no_padding(proto.select_idxs(rows).to_tensordict())
    tu.assign_non_tensor(td, max_token_len_per_gpu=CAP, micro_batch_size_per_gpu=1)
    _, idx = _verl_hooks._prepare_micro_batches(td, min_num_micro_batch=None)
    assert [[rows[i] for i in m] for m in idx] == inst.last.payload[rv.plan_key(1, 0)]["ranks"][0]
    with caplog.at_level(logging.WARNING, "routepack.integrations.verl"):
        _verl_hooks._prepare_micro_batches(td, min_num_micro_batch=len(idx) + 1)
        tu.assign_non_tensor(td, use_dynamic_bsz=False)
        micro, none = _verl_hooks._prepare_micro_batches(td)
    assert rv.FALLBACKS["min_micro"] == 1 and "min_num_micro_batch" in caplog.text
    assert rv.FALLBACKS["static"] == 1 and "use_dynamic_bsz" in caplog.text
    assert none is None and len(micro) == 4  # verl's fixed-size path: one sample a microbatch
