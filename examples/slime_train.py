"""routepack in a slime run: the plans in place of ``build_dp_schedule`` inside
``RolloutManager._split_train_data_by_dp``, in both of slime's batch modes, with a sample
longer than ``max_tokens_per_gpu`` running alone as slime runs it.

Runs on CPU without slime (it is not on PyPI) and without a GPU: a rollout in slime's layout
(per-sample ``tokens``, ``rollout_ids``, ``rollout_routed_experts`` int32 [len(tokens) - 1,
L, k]), the schedule from `plan_dp_schedule` called as the edited ``_split_train_data_by_dp``
calls it, each DP rank's data packaged as that method packages it, and each rank's training
steps walked microbatch by microbatch as slime's train actor walks them. Prints what ran.

The whole user change (docs/trainers.md), in slime/ray/rollout.py:

    from routepack.integrations import slime as rs
    self.routepack = rs.planner_from_args(args, routepack.CostModel.load("cost.json"))   # __init__
    ... = rs.plan_dp_schedule(..., rollout_routed_experts=data["rollout_routed_experts"], planner=self.routepack)

    python examples/slime_train.py
"""

import argparse
from types import SimpleNamespace

import numpy as np

import routepack as rp
from routepack.integrations import slime as rs

DP, EXPERTS, LAYERS, K, CAP = 2, 8, 2, 2, 256


def synthetic_rollout(rng, rollouts, two_per_rollout=0.3, long_sample=None):
    """slime's train data: per-sample tokens, rollout ids (some rollouts emit two samples)
    and the routes SGLang recorded (all tokens but the last), some experts hot."""
    data = {"tokens": [], "rollout_ids": [], "rollout_routed_experts": [], "rewards": []}
    for rid in range(rollouts):
        for _ in range(1 + int(rng.random() < two_per_rollout)):
            n = int(rng.integers(16, CAP + 1))
            if long_sample is not None and len(data["tokens"]) == long_sample:
                n = 3 * CAP  # longer than max_tokens_per_gpu: slime runs it alone
            keys = rng.random((n - 1, LAYERS, EXPERTS)) ** np.linspace(3, 0.3, EXPERTS)
            data["tokens"].append(list(range(n)))
            data["rollout_ids"].append(rid)
            data["rollout_routed_experts"].append(np.argsort(-keys, axis=2)[:, :, :K].astype(np.int32))
            data["rewards"].append(float(rng.random()))
    return data


def split_train_data_by_dp(args, train_parallel_config, data, planner, metrics):
    """``_split_train_data_by_dp`` with the user change: the schedule planned, then each
    rank's partition, per-sample fields and schedule lists, as slime packages them."""
    total_lengths = [len(t) for t in data["tokens"]]
    data["total_lengths"] = total_lengths
    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = (
        rs.plan_dp_schedule(  # was build_dp_schedule(
            args,
            train_parallel_config,
            total_lengths,
            global_batch_size=args.global_batch_size,
            rollout_indices=data["rollout_ids"],
            rollout_routed_experts=data["rollout_routed_experts"],  # added
            planner=planner,  # added
            metrics=metrics,  # added (optional): routepack/* and perf/routepack_plan_time
        )
    )
    ranks = []
    for r in range(train_parallel_config["dp_size"]):
        rank = {"partition": partitions[r]}
        for key in ("tokens", "rollout_ids", "rollout_routed_experts", "rewards"):
            rank[key] = [data[key][j] for j in partitions[r]]
        rank.update(
            total_lengths=total_lengths,
            global_batch_sizes=global_batch_sizes,
            num_microbatches=num_microbatches,
            micro_batch_indices=micro_batch_indices[r],
        )
        ranks.append(rank)
    return ranks


def train(ranks, planner, cap):
    """Each rank's steps as slime's actor runs them; checks they are the plans' microbatches."""
    for r, rank in enumerate(ranks):
        start = 0
        for s, n in enumerate(rank["num_microbatches"]):
            plan = planner.last_plans[s]
            mbs = rank["micro_batch_indices"][start : start + n]
            start += n
            tokens = [sum(len(rank["tokens"][i]) for i in mb) for mb in mbs]
            alone = [" (alone, over the cap)" if t > cap else "" for t in tokens]
            print(
                f"  DP rank {r}, step {s}: "
                + ", ".join(f"{len(mb)} samples {t} tokens{a}" for mb, t, a in zip(mbs, tokens, alone))
            )
            assert [len(mb) for mb in mbs] == [len(plan.cell_samples(r, m)) for m in range(plan.num_micro)]
            assert all(t <= cap or len(mb) == 1 for mb, t in zip(mbs, tokens))


def main():
    # no options: --help prints what the example does
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    model = rp.ModelShape(LAYERS, EXPERTS, K, hidden=256, expert_ffn=128, attention=["full"] * LAYERS)
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    args = SimpleNamespace(  # the slime/Megatron arguments routepack reads
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=CAP,
        micro_batch_size=2,
        global_batch_size=6,
        num_experts=EXPERTS,
        expert_model_parallel_size=2,
        num_gpus_per_node=2,
    )
    config = {"dp_size": DP, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    planner = rs.planner_from_args(args, cost, anneal_moves=2000)  # the user change, in __init__
    runs = planner.runs
    print(f"routepack on slime ({runs.backend}, policy {planner.policy_name!r})")

    data = synthetic_rollout(rng, 12, long_sample=5)
    metrics = {}
    ranks = split_train_data_by_dp(args, config, data, planner, metrics)
    print(
        f"dynamic batch mode: {len(planner.last_plans)} steps, microbatches per rank {ranks[0]['num_microbatches']}, "
        f"predicted {metrics['routepack/step_time_s'] * 1e3:.3f} ms, planning {metrics['perf/routepack_plan_time'] * 1e3:.1f} ms"
    )
    train(ranks, planner, CAP)
    over = [p.report["trainer"].get("oversize") for p in planner.last_plans]
    print(f"  over-cap samples planned alone (per step): {[o['samples'] if o else [] for o in over]}")

    args.use_dynamic_batch_size = False  # static batch mode: micro_batch_size samples a microbatch
    args.global_batch_size = 8  # as slime asks: samples a step a multiple of dp_size * micro_batch_size
    static = synthetic_rollout(rng, 16, two_per_rollout=0)
    ranks = split_train_data_by_dp(args, config, static, planner, {})
    print(
        f"static batch mode (micro_batch_size={args.micro_batch_size}): microbatches per rank {ranks[0]['num_microbatches']}"
    )
    train(ranks, planner, float("inf"))

    print("parts of the plan that ran:")
    print("  schedule: ran (every rank's microbatches are the plans' cells, step by step, in both modes)")
    for part in ("placement", "replicas"):
        print(f"  {part}: {'ran' if getattr(runs, part) else 'not run: ' + runs.why}")


if __name__ == "__main__":
    main()
