"""routepack inside verl: a `Window` from verl's batch, plans for its PPO steps, and the two
places verl balances hooked so that the plans run.

verl's layout (``verl/experimental/agent_loop/agent_loop.py``, ``utils/megatron/
router_replay_utils.py``, verl 0.9):

* ``batch["routed_experts"]`` ``[B, T, L, k]``: top-k logical expert ids per position, int16
  (uint8 ids where a recorder stores them so, E <= 256), zero where nothing was recorded;
  ``T`` = prompt + response length, prompts left-padded, responses right-padded.
* ``batch["attention_mask"]`` ``[B, T]``: 1 for real tokens; a sample's length is its sum.
* R3 (rollout routing replay): the rollout engine records no route for the final generated
  token, and verl's replay mask (``build_r3_replay_mask``) leaves that final response row to
  the trainer's own router; its ``routed_experts`` row is a zero placeholder.
* R2 (routes recorded by the trainer's own forward): every real position has a route; they
  appear in the log-prob pass, after ``_balance_batch``, so a step plans from the previous
  step's.

Two ways in:

* `install` (`routepack.integrations.verl.hooks`): hooks ``RayPPOTrainer._balance_batch``
  (the DP split, one plan per PPO mini-batch) and the workers' ``prepare_micro_batches`` (the
  planned microbatches in every mini-batch and epoch); plans travel with the batch. The
  backend decides what a plan may hold (FSDP: the schedule on the static placement).
  `setup_process` does the same in Ray's worker processes.
* the functions a custom trainer calls itself: `window_from_verl`, `plan_batch`,
  `balance_batch` / `balance_partitions` (what ``_balance_batch`` computes) and
  `rearrange_micro_batches` / `micro_batch_indices` (what ``rearrange_micro_batches`` returns).

torch, tensordict and verl are imported only by the functions that build verl objects or
hook verl; the index functions need numpy only. Install with ``pip install 'routepack[verl]'``.
"""

from __future__ import annotations

from routepack.integrations.shared.equal_counts import equal_count_plan
from routepack.integrations.shared.trainer import BACKENDS, TrainerPlanner, backend_policy, backend_runs, step_metrics
from routepack.integrations.verl.hooks import (
    FALLBACKS,
    VerlInstall,
    active,
    install,
    install_from_config,
    reset_fallbacks,
    settings_from_config,
    setup_process,
)
from routepack.integrations.verl.plans import NoPlan, StepPlans, micro_indices, plan_key, step_plans
from routepack.integrations.verl.split import (
    balance_batch,
    balance_order,
    balance_partitions,
    balance_stats,
    micro_batch_indices,
    plan_batch,
    prepare_dynamic_batch,
    rearrange_micro_batches,
)
from routepack.integrations.verl.window import MODES, window_from_verl

__all__ = [
    "BACKENDS",
    "FALLBACKS",
    "MODES",
    "NoPlan",
    "StepPlans",
    "TrainerPlanner",
    "VerlInstall",
    "active",
    "backend_policy",
    "backend_runs",
    "balance_batch",
    "balance_order",
    "balance_partitions",
    "balance_stats",
    "equal_count_plan",
    "install",
    "install_from_config",
    "micro_batch_indices",
    "micro_indices",
    "plan_batch",
    "plan_key",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
    "reset_fallbacks",
    "settings_from_config",
    "setup_process",
    "step_metrics",
    "step_plans",
    "window_from_verl",
]
