"""routepack in verl's v1 trainer (verl's default since 0.9: ``trainer.use_v1=true``,
``python -m verl.trainer.main_ppo`` starts ``TaskRunnerV1``, whose trainer is a
``verl.trainer.ppo.v1.trainer_base.PPOTrainer`` subclass; it never imports ``RayPPOTrainer``).

The v1 trainer keeps a step's samples in TransferQueue: its ``_balance_batch`` receives a
``KVBatchMeta`` (sample keys and tags, no tensors), pads it to the mini-batch multiple
(``upsample_batch_to_divisible_size``), reorders the keys and returns the batch. The hook here
does verl's same first lines (DP size, padding), then reads the step's routes from
TransferQueue (``routed_experts`` ``[j, L, k]`` per sample, jagged, as the agent loop stores
them; ``response_mask`` for the missing last route) and plans every PPO mini-batch
(`routepack.integrations.verl.hooks.VerlInstall.plan_step`). The planned order goes into the
batch's keys (verl's dispatcher cuts equal DP chunks of them, as in the legacy trainer), each
sample's ``routepack_sample`` tensor field is written to TransferQueue beside its data, and the
plans ride in ``batch.extra_info``, which verl's ``tqbridge`` hands every worker as non-tensor
data: the workers' ``prepare_micro_batches`` hook then finds them as in the legacy trainer.

Where a step cannot be planned verl's own ``_balance_batch`` runs on the padded batch (its
padding is then a no-op), logged once per kind, as in the legacy hook. R2 (routes recorded by the
trainer's own log-prob pass) is refused on this trainer at install (`check_config`): the v1
log-prob pass writes its outputs to TransferQueue, where no hook reads them yet.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from routepack.errors import RoutepackError

#: the module of verl's v1 trainer base class
MODULE = "verl.trainer.ppo.v1.trainer_base"
#: the per-sample fields the hook reads from TransferQueue
ROUTE_FIELDS = ("routed_experts", "response_mask")


def trainer_class() -> Any:
    """verl's v1 ``PPOTrainer`` (imports ``transfer_queue``: PyPI ``transferqueue``)."""
    import importlib

    return importlib.import_module(MODULE).PPOTrainer


def uses_v1(config: Any) -> bool:
    """Whether ``config`` starts verl's v1 trainer (``trainer.use_v1``, verl's default True)."""
    from routepack.integrations.verl.hooks import _get

    return bool(_get(config, "trainer.use_v1", True))


def check_config(config: Any, mode: str) -> None:
    """Refuses what the v1 hook cannot follow, naming the option."""
    if mode == "R2":
        raise RoutepackError(
            "actor_rollout_ref.actor.megatron.router_replay.mode=R2 on verl's v1 trainer (trainer.use_v1=True): the "
            "routes its log-prob pass records go to TransferQueue, which routepack does not read; use mode=R3 "
            "(with actor_rollout_ref.rollout.enable_rollout_routing_replay=True) or trainer.use_v1=False"
        )


class _Fields:
    """The shape `VerlInstall.plan_step` reads a batch in: ``.batch`` a mapping of fields."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def balance_batch(
    self: Any, batch: Any, metrics: Dict[str, Any], logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
) -> Any:
    """In place of the v1 ``PPOTrainer._balance_batch``: the planned order, sample ids and plans;
    verl's own on `NoPlan`. Returns the (padded, reordered) ``KVBatchMeta``, as verl's does."""
    import sys

    from routepack.integrations.shared.arrays import require
    from routepack.integrations.shared.trainer import plan_seconds, step_metrics
    from routepack.integrations.verl import hooks
    from routepack.integrations.verl.plans import SAMPLE_KEY, NoPlan
    from routepack.integrations.verl.split import balance_stats

    original = hooks._ORIGINALS["PPOTrainer:_balance_batch"]
    inst = hooks.active() if hooks.active() is not None else hooks._lazy_install(self)
    if inst is None:
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    torch = require("torch", "routepack.integrations.verl", "verl")
    base = sys.modules[MODULE]  # verl's own names (tq, padding) as the trainer module bound them
    worker_group = self.actor_rollout_wg
    if "actor" not in worker_group._dispatch_info:  # verl's lines: the actor's DP size
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    dp = max(worker_group._dispatch_info["actor"]) + 1
    batch = base.upsample_batch_to_divisible_size(
        batch, self._get_required_batch_multiple(dp), self.tokenizer.eos_token_id
    )
    step = int(getattr(self, "global_steps", 0))
    try:
        fields = _route_fields(base.tq, batch, inst.settings["mode"])
        plans = inst.plan_step(_Fields(fields), dp, step)
    except NoPlan as e:
        hooks.log_fallback(e, "driver")
        metrics["routepack/planned"] = 0.0
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    lens = [int(tag["seq_len"]) for tag in batch.tags]
    batch.reorder([int(i) for i in plans.order])
    ids = torch.from_numpy(plans.sample_ids)
    base.tq.kv_batch_put(
        keys=batch.keys, partition_id=batch.partition_id, fields=base.TensorDict({SAMPLE_KEY: ids}, batch_size=len(ids))
    )
    if batch.extra_info is None:
        batch.extra_info = {}
    batch.extra_info.update(plans.payload)
    metrics.update(balance_stats(lens, plans.partitions, logging_prefix))
    metrics.update(step_metrics(plans.plans, inst.settings["epochs"]))
    metrics["routepack/planned"] = 1.0
    metrics["timing_s/routepack_plan"] = plan_seconds(plans.plans)
    return batch


def _route_fields(tq: Any, batch: Any, mode: str) -> Optional[Any]:
    """The step's ``routed_experts`` and ``response_mask`` from TransferQueue, or `NoPlan`."""
    from routepack.integrations.verl.plans import NoPlan

    present = set(batch.fields or ROUTE_FIELDS)
    if "routed_experts" not in present:
        raise NoPlan(
            "no_routes",
            "R3: the batch has no 'routed_experts' (actor_rollout_ref.rollout.enable_rollout_routing_replay=True "
            "records them)",
        )
    try:
        return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(ROUTE_FIELDS))
    except (KeyError, ValueError, RuntimeError) as e:
        raise NoPlan("no_routes", f"R3: the step's routed_experts cannot be read from TransferQueue ({e})") from None


__all__ = ["MODULE", "ROUTE_FIELDS", "balance_batch", "check_config", "trainer_class", "uses_v1"]
