"""A pipeline stage's share of a plan, for the glue (`routepack.torch.PlanRunner` and
`routepack.integrations.megatron.MegatronRunner`).

Under pipeline parallelism (``topo.pp > 1``) a rank holds the MoE layers of its stage
(`Topology.stage_layers`), while the plan covers every MoE layer of the model. Each stage:

* checks the whole plan against the whole window (its layer count is the plan's, not the
  stage's);
* agrees on it with its EP group and, over the pipeline group (the ranks that hold the other
  stages of the same model replica), with every other stage: one digest per window, and a
  stage that refuses the plan or holds another makes every rank raise before anything moves
  (`agree_stages`);
* carries out the rows of its own layers only (`stage_plan`): their placement rows and their
  migration and replica rows, renumbered in the stage's layer order.

Intra-batch replicas run under a pipeline in both runners: a stage keeps several
microbatches in flight, and its `ReplicaExchange` keys copies and chains by microbatch
(`routepack.torch.replicate`); `MegatronRunner`, whose layers hold one set of replica
buffers, also puts each microbatch's copies back into them before its experts' backward
(`routepack.integrations.megatron.layer`).
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import numpy as np

from routepack.errors import InvalidPlanError, RoutepackError
from routepack.plan import Placement, Plan
from routepack.torch.broadcast import check_same_plan, default_device, gather_ints, raise_shared_failure


def stage_plan(plan: Plan, layers: Sequence[int]) -> Plan:
    """``plan`` restricted to its MoE layers ``layers`` (ascending, each once): their placement
    rows, and the migration and replica rows of those layers with ``layer`` renumbered to the
    position in ``layers``; the layout (samples, microbatches) unchanged. ``plan`` itself when
    ``layers`` is every layer of the plan. Raises `RoutepackError` naming ``layers`` otherwise
    (a layer out of range, out of order or twice)."""
    total = plan.placement.num_layers
    idx = [int(x) for x in layers]
    if idx == list(range(total)):
        return plan
    if not idx or idx[0] < 0 or idx[-1] >= total or any(b <= a for a, b in zip(idx, idx[1:])):
        raise RoutepackError(f"layers: {idx} are not ascending, distinct MoE layers of the plan's {total}")
    pos = np.full(total, -1, dtype=np.int64)
    pos[idx] = np.arange(len(idx))
    mig = plan.migration[pos[plan.migration["layer"]] >= 0].copy()
    mig["layer"] = pos[mig["layer"]]
    rep = plan.replicas[pos[plan.replicas["layer"]] >= 0].copy()
    rep["layer"] = pos[rep["layer"]]
    p = plan.placement
    placement = Placement(p.phy2log[idx], p.num_experts, p.slots_per_rank)
    return Plan(
        placement,
        plan.sample_rank,
        plan.sample_micro,
        plan.num_micro,
        replicas=rep,
        migration=mig,
        policy=plan.policy,
        replica_timing=plan.replica_timing,
    )


def agree_stages(
    err: Optional[BaseException],
    digest: int,
    group: Any,
    pipeline_group: Any,
    device: Any,
    timeout: Optional[datetime.timedelta],
) -> None:
    """Shares this rank's verdict on a plan (``err``: its refusal or None) and the plan's
    `digest_int` over the EP ``group`` and then, with ``pipeline_group`` (None: no pipeline),
    each stage's over the pipeline group, so the ranks of every stage carry out one plan or
    all raise: every rank takes part in both exchanges before any raises. Raises this rank's
    own ``err``, else `InvalidPlanError` naming the EP ranks or stages that refused the plan
    or hold another one. ``device``: where the EP group's collectives take tensors."""
    got = gather_ints([int(err is None), digest], group, device, timeout)
    same = np.unique(got[:, 1]).size == 1
    stages = None
    if pipeline_group is not None:
        mine = [int(bool(got[:, 0].all())), int(same), int(got[0, 1]) if same else -1]
        stages = gather_ints(mine, pipeline_group, default_device(pipeline_group), timeout)
    raise_shared_failure(
        err, got[:, 0], lambda bad: f"EP rank(s) {bad} refused the plan; nothing moved", InvalidPlanError
    )
    check_same_plan(got[:, 1], "EP ranks")
    if stages is None:
        return
    raise_shared_failure(
        None, stages[:, 0], lambda bad: f"pipeline stage(s) {bad} refused the plan; nothing moved", InvalidPlanError
    )
    bad = np.flatnonzero(stages[:, 1] == 0).tolist()
    if bad:
        raise InvalidPlanError(f"the EP ranks of pipeline stage(s) {bad} hold different plans; nothing moved")
    check_same_plan(stages[:, 2], "pipeline stages")
