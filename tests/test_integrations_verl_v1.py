"""routepack on verl's default trainer: ``trainer.use_v1=true`` (verl 0.9.1's default, what
``python -m verl.trainer.main_ppo`` starts), on verl's own generated Megatron config with the
documented lines only (docs/trainers.md), on CPU (tests/verl_v1_harness.py says what runs for
real and what stands in). The v1 ``PPOTrainer._balance_batch`` plans every PPO mini-batch from
the routes in TransferQueue, and the workers run the planned microbatches in the log-prob pass
and the update; what the install reports matches what ran. One test per part an install could
report as running that does not: the v1 trainer not hooked, router replay off, the checkpoint
format, grouped experts. Skipped where verl's v1 trainer does not import, except in CI (tests/conftest.py: CI_REQUIRES)."""

import logging

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
torch = pytest.importorskip("torch")

import routepack as rp  # noqa: E402
import verl_harness as vh  # noqa: E402
import verl_v1_harness as v1h  # noqa: E402
from routepack.integrations import verl as rv  # noqa: E402
from routepack.integrations.verl import hooks as _verl_hooks  # noqa: E402
from routepack.integrations.verl import v1 as _v1  # noqa: E402
from routepack.integrations.verl.plans import slice_window  # noqa: E402
from verl_batches import cost_model  # noqa: E402

L, K, E, CAP, DP = 2, 2, 6, 48, 2
MB = "actor_rollout_ref.actor.megatron"
#: the documented lines (docs/trainers.md, "The user change") that are verl settings
DOCUMENTED = {
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
    f"{MB}.router_replay.mode": "R3",
}
#: this test's sizes (not user changes: a run sets its own batch sizes and GPUs)
SIZES = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": CAP,
    "trainer.n_gpus_per_node": DP,
}
#: the whole plan's lines (placement, redundant slots, replicas)
WHOLE = {
    f"{MB}.vanilla_mbridge": True,
    f"{MB}.override_transformer_config.moe_grouped_gemm": False,
    f"{MB}.override_mcore_model_config": {"routepack": {"slots_per_rank": 5, "replica_slots": 2}},
}


@pytest.fixture(autouse=True)
def clean():
    rv.reset_fallbacks()
    yield
    if rv.active() is not None:
        rv.active().uninstall()
    _verl_hooks.unpatch()


def default_config(**values):
    """verl's generated Megatron config, verl's default trainer (v1), the documented lines."""
    from omegaconf import OmegaConf

    import os

    import verl

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), vh.CONFIGS["megatron"]))
    assert cfg.trainer.use_v1 is True and cfg.actor_rollout_ref.actor.ppo_epochs == 1  # verl's defaults
    for key, value in {**DOCUMENTED, **SIZES, **values}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def step_batch(store, step, size=16):
    rng = np.random.default_rng(step)
    samples = [
        v1h.agent_loop_sample(rng, int(rng.integers(3, 9)), int(rng.integers(1, 14)), L, K, E) for _ in range(size)
    ]
    return v1h.put_samples(store, samples, step), samples


def test_the_default_trainer_plans_every_minibatch(monkeypatch):
    store = v1h.install_store(monkeypatch)
    cfg = default_config()
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    assert PPOTrainer._balance_batch is _verl_hooks._balance_batch_v1 and inst.settings["trainer"] == "v1"
    report = inst.report()
    assert report["runs"]["schedule"] is True and report["runs"]["placement"] is False  # verl's Megatron-Bridge
    assert "vanilla_mbridge" in report["runs"]["why"] and "moe_grouped_gemm" in report["runs"]["why"]
    assert "v1 trainer" in inst.describe() and "placement: does not run" in inst.describe()
    trainer, log = v1h.harness("megatron", DP, cfg, store)
    for step in (1, 2):
        trainer.global_steps = step
        batch, samples = step_batch(store, step)
        fields = store.kv_batch_get(batch.keys, "train", ["routed_experts", "response_mask"])
        window = rv.window_from_verl(fields, num_experts=E)  # what the driver plans from, by hand
        metrics = {}
        batch = trainer.balance(batch, metrics)
        assert metrics["routepack/planned"] == 1.0, rv.FALLBACKS
        sp = inst.last
        assert len(sp.plans) == 2  # 16 samples, mini-batches of ppo_mini_batch_size * n = 8
        for plan, sub in zip(sp.plans, sp.windows):
            plan.validate(sub, sp.topo, sp.token_cap)
        for j, sub in enumerate(sp.windows):  # each mini-batch planned from its own samples' routes
            assert sub == slice_window(window, j * 8, (j + 1) * 8)
        payload = [sp.payload[rv.plan_key(step, j)] for j in range(2)]
        ids = store.kv_batch_get(batch.keys, "train", ["routepack_sample"])["routepack_sample"]
        assert ids[:, 0].tolist() == [step] * 16 and ids[:, 1].tolist() == list(range(16))  # written beside the data
        log.clear()
        trainer.old_log_prob(batch, {})
        for entry in log:  # the log-prob pass: the rank's chunk, every mini-batch's planned microbatches
            assert entry["micro"] == [c for p in payload for c in p["ranks"][entry["rank"]]]
        lp = store.kv_batch_get(batch.keys, "train", ["old_log_probs"])["old_log_probs"]
        for pos in range(16):  # the engine's log-prob is the sample's position: restored in batch order
            assert (lp[pos] == pos).all()
        log.clear()
        trainer.update_actor(batch, {})
        for r in range(DP):
            mine = [e for e in log if e["rank"] == r]
            assert [e["micro"] for e in mine] == [p["ranks"][r] for p in payload]  # every PPO mini-batch
            assert all(t <= CAP for e in mine for t in e["tokens"])
        assert not rv.FALLBACKS


def test_without_routes_verl_balances_and_says_why(monkeypatch, caplog):
    store = v1h.install_store(monkeypatch)
    cfg = default_config()
    rv.install(cfg, cost_model(L, E), anneal_moves=300)
    trainer, _ = v1h.harness("megatron", DP, cfg, store)
    rng = np.random.default_rng(3)
    samples = [v1h.agent_loop_sample(rng, 4, 5, L, K, E) for _ in range(8)]
    for s in samples:
        del s["routed_experts"]
    batch = v1h.put_samples(store, samples, 1)
    metrics = {}
    with caplog.at_level(logging.INFO, "routepack.integrations.verl"):
        out = trainer.balance(batch, metrics)
    assert metrics["routepack/planned"] == 0.0 and "global_seqlen/balanced_max" in metrics  # verl's own ran
    assert sorted(out.keys) == sorted(batch.keys) and rv.FALLBACKS["no_routes"] == 1
    assert "enable_rollout_routing_replay" in caplog.text


def test_v1_not_hooked_is_refused_at_install(monkeypatch):
    """trainer.use_v1=True where the v1 trainer does not import: install refuses (the legacy
    trainer alone would be hooked, and the default trainer would never plan)."""

    def missing():
        raise ImportError("No module named 'transfer_queue'")

    monkeypatch.setattr(_v1, "trainer_class", missing)
    with pytest.raises(rp.RoutepackError, match=r"trainer.use_v1=True: verl's v1 trainer does not import here"):
        rv.install(default_config(), cost_model(L, E))
    assert rv.active() is None
    inst = rv.install(default_config(**{"trainer.use_v1": False}), cost_model(L, E))  # the legacy trainer: hooked
    assert inst.settings["trainer"] == "legacy"


def test_replay_off_is_refused_or_reported():
    with pytest.raises(rp.RoutepackError, match="enable_rollout_routing_replay=False"):
        rv.install(
            default_config(**{"actor_rollout_ref.rollout.enable_rollout_routing_replay": False}), cost_model(L, E)
        )
    inst = rv.install(default_config(**WHOLE, **{f"{MB}.router_replay.mode": "disabled"}), cost_model(L, E))
    runs = inst.report()["runs"]
    assert runs["placement"] is False and runs["replicas"] is False
    assert f"{MB}.router_replay.mode=R3 enables it" in runs["why"]
    inst.uninstall()
    with pytest.raises(rp.RoutepackError, match="router_replay.mode=R2 on verl's v1 trainer"):
        rv.install(default_config(**{f"{MB}.router_replay.mode": "R2"}), cost_model(L, E))


def test_the_whole_plan_reports_runs_with_the_documented_lines():
    inst = rv.install(default_config(**WHOLE), cost_model(L, E))
    runs = inst.report()["runs"]
    assert (runs["schedule"], runs["placement"], runs["replicas"]) == (True, True, True)
    assert inst.planner.policy_name == "routepack" and inst.planner.topology(2).replica_slots == 2
    assert "placement: runs; replicas: runs" in inst.describe()


def test_grouped_experts_are_reported_not_running():
    whole = dict(WHOLE)
    del whole[f"{MB}.override_transformer_config.moe_grouped_gemm"]  # mbridge's MoE bridges: moe_grouped_gemm=True
    inst = rv.install(default_config(**whole), cost_model(L, E))
    runs = inst.report()["runs"]
    assert runs["placement"] is False and runs["replicas"] is False and inst.planner.policy_name == "routepack_packing"
    assert "moe_grouped_gemm=False builds SequentialMLP" in runs["why"] and "TEGroupedMLP" in inst.describe()


def test_the_checkpoint_format_is_refused_at_install():
    save = {"trainer.save_freq": 5}  # verl's default save_contents holds the optimizer
    with pytest.raises(rp.RoutepackError, match="dist_ckpt_optim_fully_reshardable=False with trainer.save_freq > 0"):
        rv.install(default_config(**WHOLE, **save), cost_model(L, E))
    fully = {f"{MB}.dist_ckpt_optim_fully_reshardable": True}
    with pytest.raises(rp.RoutepackError, match="save_contents holds 'optimizer'"):  # redundant slots: not yet
        rv.install(default_config(**WHOLE, **save, **fully), cost_model(L, E))
    contents = {"actor_rollout_ref.actor.checkpoint.save_contents": ["model", "extra"]}
    inst = rv.install(default_config(**WHOLE, **save, **contents), cost_model(L, E))
    assert inst.report()["runs"]["placement"] is True
    inst.uninstall()
    inst = rv.install(default_config(**save), cost_model(L, E))  # placement does not run: nothing to refuse
    assert inst.report()["runs"]["placement"] is False


def test_a_batch_verl_pads_is_planned_with_its_padding(monkeypatch):
    """14 samples, mini-batches of 8: verl's own padding (``upsample_batch_to_divisible_size``)
    adds 2 synthetic samples of 128 tokens with zero routes; the plans cover all 16."""
    store = v1h.install_store(monkeypatch)
    cfg = default_config(**{"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 160})
    inst = rv.install(cfg, cost_model(L, E), anneal_moves=300)
    trainer, log = v1h.harness("megatron", DP, cfg, store)
    trainer.global_steps = 5
    batch, _ = step_batch(store, 5, size=14)
    metrics = {}
    batch = trainer.balance(batch, metrics)
    assert metrics["routepack/planned"] == 1.0, rv.FALLBACKS
    assert len(batch) == 16 and sum(bool(t.get("is_padding")) for t in batch.tags) == 2
    sp = inst.last
    for plan, sub in zip(sp.plans, sp.windows):
        plan.validate(sub, sp.topo, sp.token_cap)
    log.clear()
    trainer.update_actor(batch, {})
    payload = [sp.payload[rv.plan_key(5, j)] for j in range(2)]
    for r in range(DP):
        assert [e["micro"] for e in log if e["rank"] == r] == [p["ranks"][r] for p in payload]
    assert not rv.FALLBACKS
