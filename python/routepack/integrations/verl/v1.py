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

from typing import Any

from routepack.errors import RoutepackError
from routepack.integrations.verl.plans import NoPlan
from routepack.integrations.verl.settings import _get

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
    return bool(_get(config, "trainer.use_v1", True))


def check_config(config: Any, mode: str) -> None:
    """Refuses what the v1 hook cannot follow, naming the option."""
    if mode == "R2":
        raise RoutepackError(
            "actor_rollout_ref.actor.megatron.router_replay.mode=R2 on verl's v1 trainer (trainer.use_v1=True): the "
            "routes its log-prob pass records go to TransferQueue, which routepack does not read; use mode=R3 "
            "(with actor_rollout_ref.rollout.enable_rollout_routing_replay=True) or trainer.use_v1=False"
        )


class Fields:
    """The shape `VerlInstall.plan_step` reads a batch in: ``.batch`` a mapping of fields."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def route_fields(tq: Any, batch: Any) -> Any:
    """The step's ``routed_experts`` and ``response_mask`` from TransferQueue (``tq``, as the
    trainer module bound it), or `NoPlan`."""
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


__all__ = ["MODULE", "ROUTE_FIELDS", "Fields", "check_config", "route_fields", "trainer_class", "uses_v1"]
