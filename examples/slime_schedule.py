"""routepack in a slime trainer: one plan per training step from the rollouts' routing
replay, and the plans in place of ``build_dp_schedule``'s packing.

Runs on a synthetic rollout in slime's own layout (no GPU, no download): per sample
``rollout_routed_experts`` int32 [len(tokens) - 1, L, k], ``total_lengths`` and
``rollout_indices`` (two samples per rollout for some rollouts, as compact/subagent rollouts
emit). Prints each DP rank's schedule in ``build_dp_schedule``'s structure.

    python examples/slime_schedule.py
"""

import argparse
from types import SimpleNamespace

import numpy as np

import routepack as rp
from routepack.integrations import slime as rs

DP, EXPERTS, LAYERS, K, CAP = 2, 8, 2, 2, 128


def synthetic_rollout(rng, rollouts=12):
    routed, lengths, ids = [], [], []
    for rid in range(rollouts):
        for _ in range(1 + int(rng.random() < 0.3)):
            n = int(rng.integers(8, CAP + 1))
            keys = rng.random((n - 1, LAYERS, EXPERTS)) ** np.linspace(3, 0.3, EXPERTS)
            routed.append(np.argsort(-keys, axis=2)[:, :, :K].astype(np.int32))  # SGLang: no route for the last token
            lengths.append(n)
            ids.append(rid)
    return routed, lengths, ids


def main():
    # no options: --help prints what the example does
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    routed, total_lengths, rollout_indices = synthetic_rollout(rng)
    args = SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=CAP,
        balance_data=False,
        balance_by_flops=False,
        micro_batch_size=1,
    )
    train_parallel_config = {"dp_size": DP, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    global_batch_size = 6  # rollouts per training step

    topo = rp.Topology(dp=DP, ep=2, gpus_per_node=2, slots_per_rank=5)
    model = rp.ModelShape(
        num_layers=LAYERS,
        num_experts=EXPERTS,
        top_k=K,
        hidden=256,
        expert_ffn=128,
        attention=["full"] * LAYERS,
        expert_groups=1,
    )
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    plans = []
    for samples in rs.step_samples(rollout_indices, global_batch_size):  # slime's steps
        window = rs.window_from_slime(
            [routed[i] for i in samples], EXPERTS, total_lengths=[total_lengths[i] for i in samples]
        )
        plans.append(rp.plan_window(window, topo, cost, token_cap=CAP, anneal_moves=2000))

    # was: build_dp_schedule(args, train_parallel_config, total_lengths, global_batch_size=..., rollout_indices=...)
    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = rs.build_dp_schedule(
        args,
        train_parallel_config,
        total_lengths,
        global_batch_size=global_batch_size,
        rollout_indices=rollout_indices,
        plans=plans,
    )
    print(
        f"{len(plans)} steps, microbatches per rank per step {num_microbatches}, rollouts per step {global_batch_sizes}"
    )
    for r in range(DP):
        tokens = [sum(total_lengths[partitions[r][i]] for i in mb) for mb in micro_batch_indices[r]]
        print(
            f"  DP rank {r}: samples {partitions[r]}\n    microbatches {micro_batch_indices[r]} ({tokens} tokens, cap {CAP})"
        )
        assert all(t <= CAP for t in tokens) and all(micro_batch_indices[r])


if __name__ == "__main__":
    main()
