"""What `MegatronRunner.begin_window` refuses on each rank before anything moves (torch,
Megatron): a plan of another shape or topology, one its layers' replica buffers cannot hold,
one that places experts elsewhere without migrating them, and the job settings that would run
it wrongly (DDP's overlapped reduction with redundant experts, an optimizer left out of a
migration, MoE recompute with replicas under a pipeline)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from routepack._checks import positive_int
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.integrations.megatron.tables import buffer_of, cell_rows
from routepack.oversize import refuse_split
from routepack.plan import Plan
from routepack.torch.slot_link import redundant_experts
from routepack.torch.slot_state import stateful_owner
from routepack.window import Window

#: token cap for `Plan.validate` when the caller gives none (every check but the cap)
NO_CAP = 1 << 62


def recomputes_moe(config: Any) -> bool:
    """Whether Megatron reruns the MoE layers' forward in backward (full recompute, or
    selective recompute of ``"moe"``)."""
    granularity = getattr(config, "recompute_granularity", None)
    return granularity == "full" or (
        granularity == "selective" and "moe" in (getattr(config, "recompute_modules", None) or [])
    )


def check_plan(runner: Any, plan: Any, window: Any, optimizer: Any, token_cap: Optional[int]) -> None:
    """`MegatronRunner.check_plan`: local refusal, before anything moves, of a plan ``runner``'s
    job cannot carry out (each refusal names what it is about)."""
    if not isinstance(plan, Plan):
        raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
    if not isinstance(window, Window):
        raise RoutepackTypeError(f"window: expected routepack.Window, got {type(window).__name__}")
    refuse_split(plan, "the Megatron runner")
    E = runner.layers[0].num_logical
    if window.num_layers != runner.num_moe_layers or window.num_experts != E:
        raise InvalidPlanError(
            f"window has L={window.num_layers}, E={window.num_experts}; the model has "
            f"{runner.num_moe_layers} MoE layers of {E} experts"
        )
    plan.validate(window, runner.topo, NO_CAP if token_cap is None else positive_int(token_cap, "token_cap"))
    local = runner._local_plan(plan)
    if local.replicas.size and runner.pp_group is not None and recomputes_moe(runner.config):
        raise RoutepackError(
            f"config.recompute_granularity={runner.config.recompute_granularity!r}: recomputing the MoE layers "
            "in backward under a pipeline reruns a microbatch's routing and replica copies while a later "
            "microbatch is current; plan with replication='none' or recompute other modules"
        )
    for i, m in enumerate(runner.layers):
        for micro in range(plan.num_micro):
            where = f"(group {runner.group_index}, micro {micro}, layer {m.moe_index})"
            buffer_of(cell_rows(plan, runner.group_index, micro, m.moe_index), m.replica_slots, where)
        if not local.migration.size:
            row = local.placement.phy2log[i]
            diff = np.flatnonzero((row >= 0) & (row != m.phy2log))
            if diff.size:
                s = int(diff[0])
                raise InvalidPlanError(
                    f"plan puts expert {row[s]} in slot {s} of MoE layer {m.moe_index}, which holds "
                    f"{m.phy2log[s]} now, and has no migration"
                )
    redundant = any(redundant_experts(row, E).size for row in plan.placement.phy2log)
    if (redundant or plan.replicas.size) and any(getattr(c, "overlap_grad_reduce", False) for c in runner.ddp_configs):
        raise RoutepackError(
            "DistributedDataParallelConfig.overlap_grad_reduce: the plan has redundant experts or replicas, "
            "whose gradients are completed in the last microbatch's backward after DDP would have started "
            "reducing them; set overlap_grad_reduce=False"
        )
    if optimizer is None and local.migration.size:
        owner = stateful_owner([p for m in runner.layers for p in m.pieces.params()])
        if owner is not None or any(hasattr(p, "main_param") for m in runner.layers for p in m.pieces.params()):
            raise RoutepackError(
                f"optimizer: None, but {owner or 'a Megatron optimizer'} keeps state for the expert parameters; "
                f"the plan moves {local.migration.size} experts and that state would stay with the old slots"
            )
