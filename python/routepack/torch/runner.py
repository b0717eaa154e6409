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
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack import _core
from routepack._checks import positive_int
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.plan import Plan, empty_replicas
from routepack.window import Window
from routepack.torch import _args
from routepack.torch.broadcast import digest_int, gather_ints
from routepack.torch.grads import sync_redundant_grads
from routepack.torch.migrate import MigrationReport, migrate
from routepack.torch.moe import check_layers
from routepack.torch.replicate import ReplicaExchange

#: token cap used when the caller gives none: validation then checks everything but the cap
NO_CAP = 1 << 62


class PlanRunner:
    """Ties a plan to this rank's MoE layers.

    Args:
        layers:    this rank's `EPMoE` layers, index = MoE layer of the plan.
        topo:      the `routepack.Topology` the job runs on.
        group:     the EP process group (None: default group; its size must be ``topo.ep``).
        edp_group: ranks holding the same EP-local rank in every EP group (needed when
                   ``topo.dp > topo.ep``, for the expert-data-parallel gradient sum).
        dp_rank:   this rank's DP rank (default: global rank).
        timeout:   bound on every wait of migration and replication.
    """

    def __init__(self, layers: Sequence[Any], topo: Any, group: Optional[Any] = None,
                 edp_group: Optional[Any] = None, dp_rank: Optional[int] = None,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        self.layers = check_layers(layers)
        _args.topology(topo)
        _args.group(group)
        _args.group(edp_group, "edp_group")
        _args.timeout(timeout, optional=False)
        for i, mod in enumerate(self.layers):
            if mod.layer != i:
                raise RoutepackError(f"layers[{i}] is MoE layer {mod.layer}; pass them in layer order")
            if mod.topo != topo:
                raise RoutepackError(f"layers[{i}] was built for {mod.topo}, runner for {topo}")
        if dist.get_world_size(group) != topo.ep:
            raise RoutepackError(f"group: has {dist.get_world_size(group)} ranks but topo.ep = {topo.ep}")
        if topo.num_groups > 1 and edp_group is None:
            raise RoutepackError(f"edp_group: required when dp={topo.dp} > ep={topo.ep}")
        self.topo, self.group, self.edp_group, self.timeout = topo, group, edp_group, timeout
        self.dp_rank = dist.get_rank() if dp_rank is None else positive_int(dp_rank, "dp_rank", minimum=0)
        if not 0 <= self.dp_rank < topo.dp or self.dp_rank % topo.ep != dist.get_rank(group):
            raise RoutepackError(f"dp_rank: {self.dp_rank} does not match EP-local rank {dist.get_rank(group)} "
                                 f"under {topo}")
        self.ep_group_index = self.dp_rank // topo.ep
        self.plan: Optional[Plan] = None
        self.micro = 0
        self._cells: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
        self.exchange = ReplicaExchange(self.layers, self._cells, timeout)
        #: int64 ``[M, L]``: rows this rank received per (micro, layer) in the current window
        self.received = np.zeros((0, len(self.layers)), dtype=np.int64)
        #: int64 ``[G, M, L, ep]``: the plan's prediction of the same (`_core.rank_tokens`)
        self.predicted = np.zeros((0, 0, 0, 0), dtype=np.int64)
        self.last_migration: Optional[MigrationReport] = None
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
        if token_cap is not None:
            positive_int(token_cap, "token_cap")
        mod0 = self.layers[0]
        if window.num_layers != len(self.layers) or window.num_experts != mod0.num_experts:
            raise InvalidPlanError(f"window has L={window.num_layers}, E={window.num_experts}; the model has "
                                   f"L={len(self.layers)}, E={mod0.num_experts}")
        plan.validate(window, self.topo, NO_CAP if token_cap is None else token_cap)
        if plan.migration.size == 0:
            for l, mod in enumerate(self.layers):
                diff = np.flatnonzero((plan.placement.phy2log[l] >= 0) & (plan.placement.phy2log[l] != mod.phy2log))
                if diff.size:
                    s = int(diff[0])
                    raise InvalidPlanError(f"plan puts expert {plan.placement.phy2log[l, s]} in slot {s} of layer {l}, "
                                           f"which holds {mod.phy2log[s]} now, and has no migration")

    # ----------------------------------------------------------- window
    def begin_window(self, plan: Plan, window: Any, optimizer: Optional[torch.optim.Optimizer] = None,
                     token_cap: Optional[int] = None,
                     extra_state: Optional[Dict[int, Sequence[torch.Tensor]]] = None,
                     fault: Any = None, max_bytes_in_flight: Optional[int] = None) -> Optional[MigrationReport]:
        """Checks ``plan`` against ``window`` and this job, agrees on it with every EP rank, then
        migrates (with ``optimizer`` state and ``extra_state``, staged under
        ``max_bytes_in_flight``, see `migrate`) if it has migration rows. Collective over the
        EP group. Returns the migration report (None without moves)."""
        err: Optional[BaseException] = None
        try:
            self.check_plan(plan, window, token_cap)
            digest = digest_int(plan)
        except Exception as e:  # noqa: BLE001 (shared with every EP rank, then re-raised)
            err, digest = e, 0
        device = self.layers[0].w1.device
        got = gather_ints([int(err is None), digest], self.group, device, self.timeout)
        if err is not None:
            raise err
        if not got[:, 0].all():
            raise InvalidPlanError(f"EP rank(s) {np.flatnonzero(got[:, 0] == 0).tolist()} refused the plan; nothing moved")
        if np.unique(got[:, 1]).size != 1:
            raise InvalidPlanError("EP ranks hold different plans; nothing moved (use broadcast_plan)")
        report = None
        if plan.migration.size:
            report = migrate(self.layers, plan, optimizer, group=self.group, timeout=self.timeout,
                             extra_state=extra_state, fault=fault, max_bytes_in_flight=max_bytes_in_flight)
        self.last_migration = report
        self.plan = plan
        self._cells = self._bucket(plan)
        self.exchange = ReplicaExchange(self.layers, self._cells, self.timeout)
        self.received = np.zeros((plan.num_micro, len(self.layers)), dtype=np.int64)
        self.predicted = _core.rank_tokens(plan, window.seq_lens, window.expert_tokens, self.topo)
        return report

    def _bucket(self, plan: Plan) -> Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]]:
        """This EP group's replicas per (micro, layer), table order, with their row indices."""
        rows = plan.replicas
        idx = np.flatnonzero(rows["group"] == self.ep_group_index)
        cells: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
        for i in idx.tolist():
            key = (int(rows[i]["micro"]), int(rows[i]["layer"]))
            cells.setdefault(key, ([], None))[0].append(i)
        return {k: (np.asarray(v[0], dtype=np.int64), rows[np.asarray(v[0])]) for k, v in cells.items()}

    def start_micro(self, micro: int, prefetch: bool = True) -> None:
        """Makes ``micro`` current; with ``prefetch`` posts its replica weight transfers now so
        they overlap the attention before each MoE layer (every rank must choose alike)."""
        if self.plan is None:
            raise RuntimeError("start_micro: call begin_window first")
        self.micro = _args.rank(micro, "micro", self.plan.num_micro)
        self.exchange.micro = self.micro
        if prefetch:
            self.exchange.prefetch(self.micro)

    def finish_step(self, reduce_edp: bool = True) -> None:
        """Before the optimizer step: every slot without a gradient gets zeros and, with
        ``reduce_edp``, expert gradients are summed over EP groups (``edp_group``). Replica and
        redundant-slot gradients need nothing here: the layers' backward delivered them
        (`routepack.torch.slot_link`). A trainer whose own DP reduction covers the experts
        (DDP over ``edp_group``, Megatron) passes ``reduce_edp=False`` or skips the call."""
        self.exchange.finish()
        sync_redundant_grads(self.layers, self.group, self.edp_group if reduce_edp else None)

    # ------------------------------------------------- hooks for EPMoE
    def cell_rows(self, layer: int) -> np.ndarray:
        """Replicas (`REPLICA_DTYPE`) of (this group, current micro, ``layer``), table order."""
        cell = self._cells.get((self.micro, layer))
        return cell[1] if cell is not None else empty_replicas()

    def record_received(self, layer: int, rows: int) -> None:
        if self.received.shape[0] > self.micro:
            self.received[self.micro, layer] = rows

    def predicted_received(self) -> np.ndarray:
        """int64 ``[M, L]``: rows the plan says this rank receives (its slice of ``predicted``)."""
        return self.predicted[self.ep_group_index, :, :, self.dp_rank % self.topo.ep]
