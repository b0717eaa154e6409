"""routepack in a verl PPO run: `install` hooks verl's balancing and microbatching, and the
plans run in every PPO mini-batch and epoch.

Runs verl's own code on CPU (no GPU, no Ray, no model download): the driver's
``RayPPOTrainer._balance_batch`` on a batch in verl's layout with R3 routes (``routed_experts``
[B, T, L, k]), then, on each DP rank, what verl's worker does with its chunk: the no-padding
conversion, the PPO mini-batches and epochs of ``make_iterator``, and the engine's
``prepare_micro_batches``. The trainer object and the worker loop stand in for Ray's; the
batch is synthetic. Prints what ran and what did not.

The whole user change (docs/trainers.md):

    from routepack.integrations import verl as rv
    rv.install(config, routepack.CostModel.load("cost.json"))

    python examples/verl_ppo.py
"""

import argparse
import os
from types import SimpleNamespace

import numpy as np

import routepack as rp
from routepack.integrations import verl as rv

DP, EXPERTS, LAYERS, K, PROMPT, RESPONSE = 2, 8, 2, 2, 256, 3840
MINI_BATCH, N, EPOCHS, MAX_TOKENS = 8, 2, 2, 8192  # ppo_mini_batch_size (prompts), rollout.n, ppo_epochs, tokens a GPU


def verl_config():
    """verl's own PPO config (FSDP), with the settings this run uses."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    for key, value in {
        "actor_rollout_ref.actor.ppo_mini_batch_size": MINI_BATCH,
        "actor_rollout_ref.rollout.n": N,
        "actor_rollout_ref.actor.ppo_epochs": EPOCHS,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "trainer.use_v1": False,  # this example drives the legacy RayPPOTrainer's methods
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": MAX_TOKENS,
        "trainer.n_gpus_per_node": DP,
    }.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def synthetic_batch(rng, batch=32):
    """A DataProto as verl's agent loop leaves it: left-padded prompts, right-padded
    responses, R3 routes for every token but the last generated one, some experts hot."""
    import torch
    from verl.protocol import DataProto

    total = PROMPT + RESPONSE
    routed = np.zeros((batch, total, LAYERS, K), dtype=np.int16)
    mask = np.zeros((batch, total), dtype=np.int64)
    response_mask = np.zeros((batch, RESPONSE), dtype=np.int64)
    for b in range(batch):
        p, r = int(rng.integers(4, PROMPT + 1)), int(rng.integers(1, RESPONSE + 1))
        mask[b, PROMPT - p : PROMPT + r] = 1
        response_mask[b, :r] = 1
        keys = rng.random((p + r - 1, LAYERS, EXPERTS)) ** np.linspace(3, 0.3, EXPERTS)
        routed[b, PROMPT - p : PROMPT + r - 1] = np.argsort(-keys, axis=2)[:, :, :K]
    ids = torch.arange(batch * total).reshape(batch, total) % 1000
    m = torch.from_numpy(mask)
    tensors = {
        "input_ids": ids,
        "prompts": ids[:, :PROMPT],
        "responses": ids[:, PROMPT:],
        "attention_mask": m,
        "position_ids": (m.cumsum(-1) - 1).clamp(min=0),
        "response_mask": torch.from_numpy(response_mask),
        "routed_experts": torch.from_numpy(routed),
    }
    return DataProto.from_dict(tensors, {"uid": np.array([str(b // N) for b in range(batch)], dtype=object)})


def worker(rank, chunk, inst):
    """DP rank ``rank``'s update, as verl's TrainingWorker.train_mini_batch and the FSDP
    engine run it: mini-batches by make_iterator, each microbatched by the engine's
    prepare_micro_batches (hooked by install)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(chunk.to_tensordict())
    per_rank = MINI_BATCH * N // DP
    planned = 0
    for i, mini in enumerate(tu.make_iterator(td, mini_batch_size=per_rank, epochs=EPOCHS, seed=42 + rank)):
        tu.assign_non_tensor(mini, use_dynamic_bsz=True, max_token_len_per_gpu=MAX_TOKENS, sp_size=1)
        micro, _ = transformer_impl.prepare_micro_batches(data=mini, dp_group=None, same_micro_num_in_dp=True)
        epoch, j = divmod(i, len(td) // per_rank)
        plan = inst.last.payload[rv.plan_key(inst.last.step, j)]["ranks"][rank]
        got = [m["routepack_sample"][:, 1].tolist() for m in micro]
        planned += got == plan
        tokens = [int(m["input_ids"].offsets().diff().sum()) for m in micro]
        print(
            f"  DP rank {rank}, epoch {epoch}, mini-batch {j}: microbatches {got} ({tokens} tokens, cap {MAX_TOKENS})"
        )
    return planned, i + 1


def main():
    # no options: --help prints what the example does
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError as e:
        raise SystemExit(f"examples/verl_ppo.py needs verl and its trainer's dependencies ({e})")
    rng = np.random.default_rng(0)
    config = verl_config()
    model = rp.ModelShape(LAYERS, EXPERTS, K, hidden=256, expert_ffn=128, attention=["full"] * LAYERS)
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())

    inst = rv.install(config, cost, anneal_moves=2000)  # the user change: one line (and the import)
    print(inst.describe())

    trainer = SimpleNamespace(  # what _balance_batch reads of a RayPPOTrainer
        config=config,
        actor_rollout_wg=SimpleNamespace(_dispatch_info={"actor": list(range(DP))}),
        global_steps=1,
        use_prefix_grouper=False,
        _get_dp_size=lambda wg, role: DP,
    )
    batch = synthetic_batch(rng)
    metrics = {}
    RayPPOTrainer._balance_batch(trainer, batch, metrics=metrics)  # verl calls it in fit(); hooked
    print(
        f"step 1: {len(inst.last.plans)} PPO mini-batches planned, predicted update "
        f"{metrics['routepack/step_time_s'] * 1e3:.3f} ms ({EPOCHS} epochs), max_vio "
        f"{metrics['routepack/max_vio/max']:.3f}, planning {metrics['timing_s/routepack_plan'] * 1e3:.1f} ms"
    )
    kk = rp.stages.policy.Policy("static", "kk", "none")
    verl_time = sum(
        rp.plan_window(w, inst.last.topo, cost, token_cap=MAX_TOKENS, policy=kk).report["predicted"]["step_time"]
        for w in inst.last.windows
    )
    print(
        f"  verl's own balancing (Karmarkar-Karp) of the same mini-batches, predicted: {verl_time * EPOCHS * 1e3:.3f} ms"
    )
    ran = total = 0
    for rank, chunk in enumerate(batch.chunk(DP)):  # verl's dispatch: equal chunks
        a, b = worker(rank, chunk, inst)
        ran, total = ran + a, total + b
    runs = inst.report()["runs"]
    print("parts of the plan that ran:")
    print(
        f"  schedule: ran in {ran} of {total} mini-batch passes (DP ranks x mini-batches x epochs); fallbacks {dict(rv.FALLBACKS)}"
    )
    for part in ("placement", "replicas"):
        print(f"  {part}: {'ran' if runs[part] else 'not run: ' + runs['why']}")
    assert ran == total and not rv.FALLBACKS


if __name__ == "__main__":
    main()
