"""Stands in for slime's ``RolloutManager._split_train_data_by_dp`` and for the train actor's
walk over its schedule; tests/slime_reference does not hold ``slime/ray/rollout.py`` (it
imports ray, sglang and slime's whole rollout stack).

Written from reading slime's method (``slime/ray/rollout.py``, the ``build_dp_schedule``
version of 624b824), not copied: the sample lengths (``len(tokens)``) go into
``data["total_lengths"]``, the module-level ``build_dp_schedule`` (slime's own, from
tests/slime_reference) gives the schedule, and each DP rank gets a dict with its
``partition``, every per-sample field at the partition's indices, the global fields as they
are, and the schedule's ``global_batch_sizes``, ``num_microbatches`` and its
``micro_batch_indices``. Left out: ``_tensorize_rollout_data_for_training`` and the Ray
``Box(ray.put(...))`` around each dict. `RoutepackRolloutManager` is the same method with
the user change of docs/trainers.md: the ``build_dp_schedule`` call replaced by
``routepack.integrations.slime.plan_dp_schedule``, and each rank's dict given the step plans
(``rs.step_plans``) for the Megatron actor.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent / "slime_reference"))

from slime.utils.dp_schedule import build_dp_schedule  # noqa: E402  (slime's own, vendored)

from routepack.integrations import slime as rs  # noqa: E402

#: The per-sample fields slime hands each rank at its partition's indices, and the global ones.
PER_SAMPLE = (
    "tokens",
    "response_lengths",
    "rewards",
    "truncated",
    "loss_masks",
    "sample_indices",
    "rollout_ids",
    "rollout_log_probs",
    "rollout_routed_experts",
)
GLOBAL = ("raw_reward", "total_lengths")


def package(data: Dict[str, Any], schedule: tuple, dp_size: int, plans: Any = None) -> List[Dict[str, Any]]:
    partitions, micro, num_mb, gbs = schedule
    out = []
    for r in range(dp_size):
        rank: Dict[str, Any] = {"partition": partitions[r]}
        for key in PER_SAMPLE:
            if key in data:
                rank[key] = [data[key][j] for j in partitions[r]]
        for key in GLOBAL:
            if key in data:
                rank[key] = data[key]
        rank.update(global_batch_sizes=gbs, num_microbatches=num_mb, micro_batch_indices=micro[r])
        if plans is not None:
            rank[rs.PLANS_KEY] = plans
        out.append(rank)
    return out


class RolloutManager:
    """slime's rollout manager, as far as ``_split_train_data_by_dp`` reads it."""

    def __init__(self, args: Any, train_parallel_config: Dict[str, int]):
        self.args, self.train_parallel_config = args, train_parallel_config

    def _split_train_data_by_dp(self, data: Dict[str, Any]) -> List[Dict[str, Any]]:
        dp_size = self.train_parallel_config["dp_size"]
        total_lengths = [len(t) for t in data["tokens"]]
        data["total_lengths"] = total_lengths
        schedule = build_dp_schedule(
            self.args,
            self.train_parallel_config,
            total_lengths,
            global_batch_size=self.args.global_batch_size,
            rollout_indices=data["rollout_ids"],
        )
        return package(data, schedule, dp_size)


class RoutepackRolloutManager(RolloutManager):
    """The same, with docs/trainers.md's change: a planner made once, the schedule planned."""

    def __init__(self, args: Any, train_parallel_config: Dict[str, int], cost: Any, **options: Any):
        super().__init__(args, train_parallel_config)
        self.routepack = rs.planner_from_args(args, cost, **options)  # + (user change)
        self.routepack_metrics: Dict[str, float] = {}

    def _split_train_data_by_dp(self, data: Dict[str, Any]) -> List[Dict[str, Any]]:
        dp_size = self.train_parallel_config["dp_size"]
        total_lengths = [len(t) for t in data["tokens"]]
        data["total_lengths"] = total_lengths
        schedule = rs.plan_dp_schedule(  # was: build_dp_schedule(
            self.args,
            self.train_parallel_config,
            total_lengths,
            global_batch_size=self.args.global_batch_size,
            rollout_indices=data["rollout_ids"],
            rollout_routed_experts=data["rollout_routed_experts"],  # + (user change)
            planner=self.routepack,  # + (user change)
            metrics=self.routepack_metrics,  # + (user change)
        )
        # in the per-rank loop: rollout_data["routepack_plans"] = rs.step_plans(self.routepack)  (user change)
        return package(data, schedule, dp_size, rs.step_plans(self.routepack))


def actor_steps(rank: Dict[str, Any]) -> List[List[List[int]]]:
    """What a train actor runs, step by step: ``num_microbatches[s]`` microbatches taken in
    order from ``micro_batch_indices``, each as the global sample indices (``partition``)."""
    out, start = [], 0
    for n in rank["num_microbatches"]:
        out.append([[rank["partition"][i] for i in mb] for mb in rank["micro_batch_indices"][start : start + n]])
        start += n
    return out
