"""`PlanRunner`: carries one plan per window out on a rank's `EPMoE` layers.

Per window::

    runner.begin_window(plan, window, optimizer)   # check + agree, migrate experts with state
    for m in range(plan.num_micro):                # this rank's microbatches, execution order
        runner.start_micro(m)                      # posts the replica weight transfers (async)
        loss = model(batch[m]); loss.backward()    # layers remap tokens, use replica copies
    runner.finish_step()                           # sum over EP groups (replica/redundant grads: in backward)
    optimizer.step(); optimizer.zero_grad()

Bad plans (another topology, a placement missing an expert, shares out of range, a
migration that does not fit the placement in force) are refused by `begin_window` on every
rank before any tensor moves.

Under pipeline parallelism (``topo.pp`` > 1) each rank passes its stage's layers and the
``pipeline_group`` (this rank and the ranks holding the other stages of the same model
replica, in stage order). Every stage checks the whole plan, every rank of every stage agrees
on one digest per window, and each stage migrates and routes its own MoE layers only
(`routepack.torch.pipeline`), replicas included: a stage may run the forward of later
microbatches before the backward of earlier ones (GPipe, 1F1B), since each backward returns the
copy gradients of the microbatch its forward ran (`routepack.torch.replicate`). Under the
interleaved schedule (``topo.vpp`` > 1) the stage's layers are its model chunks' and the
trainer calls ``start_micro(m)`` before each chunk's forward of microbatch m.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack import _core
from routepack._checks import positive_int
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.oversize import refuse_split
from routepack.plan import Plan, empty_replicas
from routepack.window import Window
from routepack.torch import _args, profile
from routepack.torch.broadcast import digest_int, gather_ints
from routepack.torch.grads import sync_redundant_grads
from routepack.torch.migrate import MigrationReport, migrate
from routepack.torch.moe import check_layers
from routepack.torch.pipeline import agree_stages, stage_plan
from routepack.torch.replicate import ReplicaExchange
from routepack.torch.routes import window_routes
from routepack.torch.slot_link import StepSums
from routepack.torch.step_metrics import StepTimer, runner_metrics

#: token cap used when the caller gives none: validation then checks everything but the cap
NO_CAP = 1 << 62


class PlanRunner:
    """Ties a plan to this rank's MoE layers.

    Args:
        layers:    this rank's `EPMoE` layers in MoE layer order: every MoE layer of the plan
                   (``layers[i].layer == i``) or, with ``topo.pp`` > 1, its pipeline stage's
                   (`Topology.stage_layers`, checked against each window).
        topo:      the `routepack.Topology` the job runs on (``dp``, ``ep``: a stage's).
        group:     the EP process group (None: default group; its size must be ``topo.ep``).
        edp_group: ranks holding the same EP-local rank in every EP group (needed when
                   ``topo.dp > topo.ep``, for the expert-data-parallel gradient sum).
        dp_rank:   this rank's DP rank (default: global rank; required with ``topo.pp`` > 1).
        timeout:   bound on every wait of migration and replication.
        pipeline_group: with ``topo.pp`` > 1 (required there): the ``pp`` ranks that hold
                   the stages of this rank's model replica, one a stage, group rank = stage
                   (Megatron's pipeline group); the plan is agreed over it too.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        topo: Any,
        group: Optional[Any] = None,
        edp_group: Optional[Any] = None,
        dp_rank: Optional[int] = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        pipeline_group: Optional[Any] = None,
    ) -> None:
        _args.topology(topo)
        self.layers = check_layers(layers)
        _args.group(group)
        _args.group(edp_group, "edp_group")
        _args.group(pipeline_group, "pipeline_group")
        _args.timeout(timeout, optional=False)
        for i, mod in enumerate(self.layers):
            if topo.pp == 1 and mod.layer != i:
                raise RoutepackError(f"layers[{i}] is MoE layer {mod.layer}; pass them in layer order")
            if i and mod.layer <= self.layers[i - 1].layer:
                raise RoutepackError(
                    f"layers[{i}] is MoE layer {mod.layer} after MoE layer {self.layers[i - 1].layer}; pass "
                    "the stage's layers once each, in layer order"
                )
            if mod.topo != topo:
                raise RoutepackError(f"layers[{i}] was built for {mod.topo}, runner for {topo}")
        if dist.get_world_size(group) != topo.ep:
            raise RoutepackError(f"group: has {dist.get_world_size(group)} ranks but topo.ep = {topo.ep}")
        if topo.num_groups > 1 and edp_group is None:
            raise RoutepackError(f"edp_group: required when dp={topo.dp} > ep={topo.ep}")
        #: this rank's pipeline stage (0 without a pipeline)
        self.stage = 0
        if topo.pp > 1:
            if pipeline_group is None:
                raise RoutepackError(
                    f"pipeline_group: required when topo.pp = {topo.pp} > 1: the ranks holding the other stages of "
                    "this rank's model replica (group rank = stage), over which every stage agrees on the plan"
                )
            if dist.get_world_size(pipeline_group) != topo.pp:
                raise RoutepackError(
                    f"pipeline_group: has {dist.get_world_size(pipeline_group)} ranks but topo.pp = {topo.pp} "
                    "(one rank a stage)"
                )
            if dp_rank is None:
                raise RoutepackError(
                    f"dp_rank: required when topo.pp = {topo.pp} > 1 (the global rank is not the DP rank of a stage)"
                )
            self.stage = dist.get_rank(pipeline_group)
        elif pipeline_group is not None and dist.get_world_size(pipeline_group) != 1:
            raise RoutepackError(
                f"pipeline_group: has {dist.get_world_size(pipeline_group)} ranks but topo.pp = 1 (plan with "
                "Topology(..., pp=...) for a pipeline)"
            )
        self.topo, self.group, self.edp_group, self.timeout = topo, group, edp_group, timeout
        self.pipeline_group = pipeline_group if topo.pp > 1 else None
        #: the plan's MoE layer of each of ``layers``, and the position of each such layer among them
        self.moe_layers = [int(mod.layer) for mod in self.layers]
        self._pos = {l: i for i, l in enumerate(self.moe_layers)}
        self.dp_rank = dist.get_rank() if dp_rank is None else positive_int(dp_rank, "dp_rank", minimum=0)
        if not 0 <= self.dp_rank < topo.dp or self.dp_rank % topo.ep != dist.get_rank(group):
            raise RoutepackError(
                f"dp_rank: {self.dp_rank} does not match EP-local rank {dist.get_rank(group)} under {topo}"
            )
        self.ep_group_index = self.dp_rank // topo.ep
        self.plan: Optional[Plan] = None
        self.micro = 0
        self._cells: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
        self.exchange = ReplicaExchange(self.layers, self._cells, timeout)
        #: the redundant slots' gradients of the step so far (`slot_link.StepSums`); None before a window
        self.step_sums: Optional[StepSums] = None
        #: int64 ``[M, L]``: rows this rank received per (micro, layer of ``layers``) in the current window
        self.received = np.zeros((0, len(self.layers)), dtype=np.int64)
        #: int64 ``[G, M, L, ep]``: the plan's prediction of the same (`_core.rank_tokens`)
        self.predicted = np.zeros((0, 0, 0, 0), dtype=np.int64)
        self.last_migration: Optional[MigrationReport] = None
        #: the step's wall time, first `start_micro` to `finish_step` (`metrics`)
        self.timer = StepTimer(self.layers[0].w1.device)
        self._routes: Dict[Tuple[int, int], Any] = {}
        self._window: Optional[Window] = None
        #: device bool, True once a layer was fed ids other than the precomputed ones
        self._mismatch: Optional[torch.Tensor] = None
        for mod in self.layers:
            mod.runner = self

    # ----------------------------------------------------------- checks
    def check_plan(self, plan: Any, window: Any, token_cap: Optional[int] = None) -> None:
        """Local refusal of a plan that this job cannot carry out (raises `InvalidPlanError` or
        `RoutepackError` naming the problem); `begin_window` runs it on every rank and agrees."""
        if not isinstance(plan, Plan):
            raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
        if not isinstance(window, Window):
            raise RoutepackTypeError(f"window: expected routepack.Window, got {type(window).__name__}")
        refuse_split(plan, "routepack.torch")
        if token_cap is not None:
            positive_int(token_cap, "token_cap")
        mod0 = self.layers[0]
        total = window.num_layers  # the plan's MoE layers (validate checks the plan has as many)
        if window.num_experts != mod0.num_experts or (self.topo.pp == 1 and total != len(self.layers)):
            raise InvalidPlanError(
                f"window has L={window.num_layers}, E={window.num_experts}; the model has "
                f"L={len(self.layers)}, E={mod0.num_experts}"
            )
        if self.topo.pp > 1:
            want = self.topo.stage_layers(self.stage, total)
            if self.moe_layers != want:
                raise InvalidPlanError(
                    f"window has L={total} MoE layers, of which topo gives pipeline stage {self.stage} {want} "
                    f"(layers_per_stage={self.topo.layers_per_stage}); this stage holds {self.moe_layers}"
                )
        plan.validate(window, self.topo, NO_CAP if token_cap is None else token_cap)
        local = stage_plan(plan, self.moe_layers)
        if local.migration.size == 0:
            for i, mod in enumerate(self.layers):
                row = local.placement.phy2log[i]
                diff = np.flatnonzero((row >= 0) & (row != mod.phy2log))
                if diff.size:
                    s = int(diff[0])
                    raise InvalidPlanError(
                        f"plan puts expert {row[s]} in slot {s} of layer {mod.layer}, "
                        f"which holds {mod.phy2log[s]} now, and has no migration"
                    )

    # ----------------------------------------------------------- window
    def begin_window(
        self,
        plan: Plan,
        window: Any,
        optimizer: Optional[torch.optim.Optimizer] = None,
        token_cap: Optional[int] = None,
        extra_state: Optional[Dict[int, Sequence[torch.Tensor]]] = None,
        fault: Any = None,
        max_bytes_in_flight: Optional[int] = None,
        microbatches: Optional[Sequence[Any]] = None,
    ) -> Optional[MigrationReport]:
        """Checks ``plan`` against ``window`` and this job, agrees on it with every EP rank (and,
        under a pipeline, over ``pipeline_group`` with every stage: one digest per window),
        then migrates (with ``optimizer`` state and ``extra_state``, MoE layer → tensors,
        staged under ``max_bytes_in_flight``, see `migrate`) if it has migration rows of this
        rank's layers. Collective over the EP group (and the pipeline group). Returns the
        migration report (None without moves).

        ``microbatches``: this rank's replayed microbatches of the window
        (`rank_microbatches`, execution order). With them every (micro, layer) route is
        computed here, once (`routepack.torch.routes`), and the layers' forward does no host
        copy and no all-gather; `finish_step` then checks, once per step, that every rank fed
        exactly these ids. Without them each forward computes its route (one host copy and
        one all-gather of counts per layer)."""
        self.check_step_finished("begin_window")
        err: Optional[BaseException] = None
        try:
            self.check_plan(plan, window, token_cap)
            digest = digest_int(plan)
        except Exception as e:  # noqa: BLE001 (shared with every EP rank, then re-raised)
            err, digest = e, 0
        agree_stages(err, digest, self.group, self.pipeline_group, self.layers[0].w1.device, self.timeout)
        local = stage_plan(plan, self.moe_layers)
        report = None
        if local.migration.size:
            with profile.region("migration"):
                report = migrate(
                    self.layers,
                    plan,
                    optimizer,
                    group=self.group,
                    timeout=self.timeout,
                    extra_state=extra_state,
                    fault=fault,
                    max_bytes_in_flight=max_bytes_in_flight,
                )
        self.last_migration = report
        self.plan = plan
        self._cells = self._bucket(local)
        self.exchange = ReplicaExchange(self.layers, self._cells, self.timeout)
        self.step_sums = StepSums(plan.num_micro)
        self.received = np.zeros((plan.num_micro, len(self.layers)), dtype=np.int64)
        self.predicted = _core.rank_tokens(plan, window.seq_lens, window.counts, self.topo)
        self._routes = {}
        self._mismatch = None
        self._window = window
        if microbatches is not None:
            self.set_microbatches(microbatches)
        return report

    def set_microbatches(self, microbatches: Sequence[Any]) -> None:
        """Computes every (micro, layer) route of the current window from this rank's replayed
        ``microbatches`` (`rank_microbatches`, execution order), as ``begin_window(...,
        microbatches=...)`` does: the layers' forward then does no host copy and no
        all-gather, and `finish_step` checks, once per step, that every rank fed exactly
        these ids. Local (no collective); call it after `begin_window`."""
        if self.plan is None or self._window is None:
            raise RuntimeError("set_microbatches: call begin_window first")
        self._routes = {}
        self._mismatch = None
        self._routes = window_routes(self, self.plan, self._window, microbatches)

    def _bucket(self, plan: Plan) -> Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]]:
        """This EP group's replicas per (micro, layer), table order, with their row indices
        (``plan``: restricted to ``layers``, `stage_plan`: layer = position in ``layers``)."""
        rows = plan.replicas
        idx = np.flatnonzero(rows["group"] == self.ep_group_index)
        cells: Dict[Tuple[int, int], List[int]] = {}
        for i in idx.tolist():
            key = (int(rows[i]["micro"]), int(rows[i]["layer"]))
            cells.setdefault(key, []).append(i)
        return {k: (np.asarray(v, dtype=np.int64), rows[np.asarray(v)]) for k, v in cells.items()}

    def start_micro(self, micro: int, prefetch: bool = True) -> None:
        """Makes ``micro`` current for the layers' forward; with ``prefetch`` posts its replica
        weight transfers now so they overlap the attention before each MoE layer (every rank
        must choose alike). The backward of an earlier microbatch may still follow (a pipeline
        schedule): it uses the microbatch its forward ran, whatever is current. Under the
        interleaved schedule call it before each model chunk's forward: the layers route the
        current microbatch, and the replica transfers of a cell are posted once per pass over
        the microbatch's layers (`ReplicaExchange.prefetch`)."""
        if self.plan is None:
            raise RuntimeError("start_micro: call begin_window first")
        self.micro = _args.rank(micro, "micro", self.plan.num_micro)
        self.timer.start()
        self.exchange.micro = self.micro
        if prefetch:
            with profile.region("replica_fill"):
                self.exchange.prefetch(self.micro)

    def finish_step(self, reduce_edp: bool = True) -> None:
        """Before the optimizer step: every slot without a gradient gets zeros and, with
        ``reduce_edp``, expert gradients are summed over EP groups (``edp_group``). Replica and
        redundant-slot gradients need nothing here: the layers' backward delivered them
        (`routepack.torch.slot_link`; redundant experts in the last microbatch's backward,
        which must have run: otherwise this raises, see `check_step_finished`). A trainer whose own DP reduction covers the experts
        (DDP over ``edp_group``, Megatron) passes ``reduce_edp=False`` or skips the call."""
        self.check_step_finished("finish_step")
        self.exchange.finish()
        self.check_replayed_ids()
        sync_redundant_grads(self.layers, self.group, self.edp_group if reduce_edp else None)
        self.timer.stop()

    def metrics(self, cost: Any = None) -> Dict[str, float]:
        """The window's plan metrics and the last step's measured time, named as
        `routepack.metrics.METRICS` lists them (`routepack.torch.step_metrics.runner_metrics`;
        ``cost`` predicts the step of a plan that records no prediction). Hand them to the
        trainer's logger with `routepack.metrics.log_metrics`."""
        return runner_metrics(self, cost)

    def check_step_finished(self, where: str) -> None:
        """Raises `RoutepackError` when some layer's backward has run for part of the step's
        microbatches only: its redundant experts' gradients are summed in the backward of the
        step's last microbatch (`routepack.torch.slot_link`), so an optimizer step now would
        miss them. `discard_step` drops them (a step abandoned on purpose)."""
        sums = self.step_sums
        left = sums.unfinished() if sums is not None else {}
        if sums is not None and left:
            m = sums.num_micro
            raise RoutepackError(
                f"{where}: the step is part-way: layer(s) {list(left)} ran backward for {sorted(set(left.values()))} "
                f"of the plan's {m} microbatches; their redundant experts' gradients are summed in the backward "
                f"of the step's last microbatch, which has not run (call runner.discard_step() to abandon the step)"
            )

    def discard_step(self) -> None:
        """Forgets the redundant slots' gradients of a step abandoned part-way (the backward of
        some microbatches ran, not of all); the next backward starts a new step."""
        if self.step_sums is not None:
            self.step_sums = StepSums(self.step_sums.num_micro)
        self.timer.abandon()

    def check_replayed_ids(self) -> None:
        """Raises `RoutepackError` on every EP rank when some rank fed a layer ids other than
        the precomputed replay (one host sync and one small all-gather; `finish_step` calls
        it). A no-op without precomputed routes."""
        if not self._routes:
            return
        bad = int(self._mismatch.item()) if self._mismatch is not None else 0
        self._mismatch = None
        device = self.layers[0].w1.device
        got = gather_ints([bad], self.group, device, self.timeout)
        ranks = np.flatnonzero(got[:, 0]).tolist()
        elsewhere = False
        if self.edp_group is not None:
            # every EP group learns it too: the later collectives (the EDP sum) span them all
            elsewhere = bool(gather_ints([int(bool(ranks))], self.edp_group, device, self.timeout)[:, 0].any())
        if ranks or elsewhere:
            who = f"EP rank(s) {ranks}" if ranks else "a rank of another EP group"
            raise RoutepackError(
                f"topk_ids: {who} fed MoE layers ids other than the replayed microbatches "
                "given to begin_window; this step's gradients are wrong: do not step"
            )

    # ------------------------------------------------- hooks for EPMoE
    # (``layer``: the plan's MoE layer, `EPMoE.layer`)
    def cell_rows(self, layer: int) -> np.ndarray:
        """Replicas (`REPLICA_DTYPE`) of (this group, current micro, ``layer``), table order."""
        return self.cell_rows_of(self.micro, layer)

    def cell_rows_of(self, micro: int, layer: int) -> np.ndarray:
        """Replicas (`REPLICA_DTYPE`) of (this group, ``micro``, ``layer``), table order."""
        cell = self._cells.get((micro, self._pos.get(layer, -1)))
        return cell[1] if cell is not None else empty_replicas()

    def route_for(self, layer: int) -> Any:
        """The precomputed `routes.CellRoute` of (current micro, ``layer``), or None."""
        return self._routes.get((self.micro, layer))

    def unit_tokens(self) -> List[List[List[int]]]:
        """``[M][layers]``: per microbatch and MoE layer of ``layers``, the tokens this rank
        computes per compute unit (its slots, then its replica copies), from the routes
        `set_microbatches` computed (empty before it)."""
        micros = sorted({m for m, _ in self._routes})
        return [[self._routes[(m, l)].unit_counts.tolist() for l in self.moe_layers] for m in micros]

    def note_ids(self, cell: Any, topk_ids: torch.Tensor) -> None:
        """Records, on the device and without a sync, whether ``topk_ids`` differ from the ids
        ``cell`` was computed for (checked by `check_replayed_ids`)."""
        diff = (topk_ids != cell.ids.to(topk_ids.dtype)).any() if topk_ids.numel() else None
        if diff is not None:
            self._mismatch = diff if self._mismatch is None else (self._mismatch | diff)

    def record_received(self, layer: int, rows: int) -> None:
        if self.received.shape[0] > self.micro:
            self.received[self.micro, self._pos[layer]] = rows

    def predicted_received(self) -> np.ndarray:
        """int64 ``[M, L]``: rows the plan says this rank receives per (micro, layer of
        ``layers``): its slice of ``predicted``."""
        return self.predicted[self.ep_group_index, :, :, self.dp_rank % self.topo.ep][:, self.moe_layers]
