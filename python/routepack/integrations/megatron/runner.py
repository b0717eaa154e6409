"""`MegatronRunner`: carries one plan per window out in a Megatron-Core model built with
`plan_layer_spec` (torch, Megatron).

Per window::

    runner.begin_window(plan, window, optimizer)   # check + agree, migrate, upload tables
    it = runner.microbatches(data_iterator)        # start_micro(m) at each next()
    forward_backward_func(..., data_iterator=it)   # stock Megatron schedule
    runner.finish_step()                           # every layer's step complete
    optimizer.step()

What the runner does at each point, and what it moves, is in `begin_window`, `fill_replicas`
and `after_backward`; nothing runs per forward but the device-side slot map and, for cells
with replicas, the copies' point-to-point transfers.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack._checks import positive_int
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.integrations.megatron.groups import MegatronGroups, groups_from_parallel_state
from routepack.integrations.megatron.layer import PlanMoELayer
from routepack.integrations.megatron.microbatch import MicrobatchState
from routepack.integrations.megatron.slot_state import MegatronSlotState, optimizer_tensors
from routepack.integrations.megatron.tables import buffer_of, cell_rows, layer_tables
from routepack.model import Topology
from routepack.oversize import refuse_split
from routepack.plan import Plan
from routepack.torch import _args
from routepack.torch.broadcast import default_device, digest_int, group_peers
from routepack.torch.migrate import MigrationReport, migrate_slots
from routepack.torch.pipeline import agree_stages, stage_plan
from routepack.torch.replicate import ReplicaExchange
from routepack.torch.routes import cell_origins
from routepack.torch.slot_link import redundant_experts
from routepack.torch.step_metrics import StepTimer, runner_metrics
from routepack.torch.slot_state import stateful_owner
from routepack.window import Window

#: token cap for `Plan.validate` when the caller gives none (every check but the cap)
_NO_CAP = 1 << 62


class LayerView:
    """One `PlanMoELayer` as the migration protocol and `ReplicaExchange` read a layer:
    ``layer`` (index among this rank's MoE layers), ``phy2log`` (the placement row), ``topo``,
    ``slots_per_rank``, ``num_experts``, ``ep_rank``, ``peers``, ``group``."""

    def __init__(self, mod: PlanMoELayer, index: int, peers: List[int], group: Any) -> None:
        self.mod, self.layer, self.peers, self.group = mod, index, peers, group
        self.topo, self.ep_rank = mod.topo, mod.ep_rank
        self.slots_per_rank, self.num_experts = mod.slots_per_rank, mod.num_logical

    @property
    def phy2log(self) -> np.ndarray:
        return self.mod.phy2log

    @phy2log.setter
    def phy2log(self, row: np.ndarray) -> None:
        self.mod.phy2log = np.ascontiguousarray(row, dtype=np.int32)

    def local_slot_of(self, expert: int) -> int:
        hit = np.flatnonzero(self.mod.local_experts() == expert)
        if hit.size == 0:
            raise RoutepackError(f"expert {expert} is not on EP rank {self.ep_rank} in MoE layer {self.mod.moe_index}")
        return int(hit[0])


class _Exchange(ReplicaExchange):
    """`ReplicaExchange` over Megatron's expert modules: one flat buffer per expert
    (`SlotPieces`); copies land in the layer's replica buffers."""

    def slot_flat(self, mod: Any, slot: int) -> torch.Tensor:
        return mod.mod.pieces.weights(slot)

    def flat_spec(self, mod: Any) -> Tuple[int, torch.dtype, torch.device]:
        p = mod.mod.pieces
        return p.numel, p.dtype, p.device

    def unflatten(self, mod: Any, copies: List[torch.Tensor]) -> Any:
        return copies

    def copy_grad(self, grads: Any, copy: int) -> torch.Tensor:
        return grads.mod.pieces.grad(grads.slots_per_rank + copy)


def _moe_layer_index(config: Any, layer_number: int) -> int:
    """The plan's MoE layer index of Megatron layer ``layer_number`` (1-based, global)."""
    freq = getattr(config, "moe_layer_freq", 1)
    idx = layer_number - 1
    if isinstance(freq, int):
        return sum(1 for i in range(idx) if i % freq == 0)
    return int(sum(freq[:idx]))


def _num_moe_layers(config: Any) -> int:
    freq = getattr(config, "moe_layer_freq", 1)
    return sum(1 for i in range(config.num_layers) if i % freq == 0) if isinstance(freq, int) else int(sum(freq))


def _recomputes_moe(config: Any) -> bool:
    """Whether Megatron reruns the MoE layers' forward in backward (full recompute, or
    selective recompute of ``"moe"``)."""
    granularity = getattr(config, "recompute_granularity", None)
    return granularity == "full" or (
        granularity == "selective" and "moe" in (getattr(config, "recompute_modules", None) or [])
    )


def _check_groups(chunks: List[Any]) -> None:
    """Megatron's ``TransformerLayer`` hands its ``pg_collection`` only to ``MoELayer`` itself,
    so a `PlanMoELayer` takes the default groups: refuse a layer whose own groups differ."""
    for c in chunks:
        named = dict(c.named_modules())
        for name, m in named.items():
            if not isinstance(m, PlanMoELayer):
                continue
            parent = named.get(name.rpartition(".")[0])
            pg = getattr(parent, "pg_collection", None)
            ep = getattr(pg, "ep", None)
            if ep is not None and dist.get_process_group_ranks(ep) != dist.get_process_group_ranks(m.ep_group):
                raise RoutepackError(
                    f"model: {name} uses the default expert-parallel group, its TransformerLayer a custom "
                    "pg_collection; build the model with the default process groups"
                )


class _ReadMicro(int):
    """A ``current_microbatch`` the runner has read (`MegatronRunner._chunk_forward`)."""


def _chunk_holders(chunk: Any) -> List[Any]:
    """The modules of ``chunk`` that hold a `PlanMoELayer` (its ``TransformerLayer`` modules, where
    Megatron's schedules set ``current_microbatch`` before each forward step)."""
    named = dict(chunk.named_modules())
    return [named[n.rpartition(".")[0]] for n, m in named.items() if isinstance(m, PlanMoELayer)]


class MegatronRunner:
    """Ties plans to the `PlanMoELayer` layers of ``model`` (a module, a DDP-wrapped module,
    or the list of this rank's model chunks). ``topo``: the plan's `routepack.Topology` (``ep``
    = the expert-parallel size, ``dp`` = the data-parallel size of a stage, ``pp`` and ``vpp``
    = Megatron's pipeline and virtual pipeline sizes; this stage must hold the MoE layers
    ``topo.stage_layers`` gives it). ``timeout`` bounds every wait of migration and replication.
    ``groups``: the process groups and ranks it runs over (`MegatronGroups`: expert-parallel,
    pipeline, data-parallel rank and size); None: the layers' own expert-parallel group and the
    rest from Megatron's ``parallel_state`` (`groups_from_parallel_state`).

    Under a pipeline (pp > 1) each stage carries out the plan's rows of its own layers,
    intra-batch replicas included: with several microbatches in flight the runner keeps each
    one's copies from its forward to its backward and puts them back into the replica buffers
    before its experts' backward (`restore_replicas`). Under 1F1B (vpp = 1) every stage's
    ``forward_step_func`` must take its microbatch from the data iterator (``next()``), the
    middle stages' too. Under the interleaved schedule (vpp > 1: ``model`` is the list of the
    rank's vpp chunks) the microbatch of each chunk's forward is the one Megatron's schedule
    sets on the chunk's ``TransformerLayer`` modules (``current_microbatch``, set by
    ``forward_step`` before ``forward_step_func``): a forward pre-hook on each chunk reads it
    (and marks it read, so a forward outside the schedule finds no new one) and calls `start_micro`;
    the data iterators need no wrapping. Either way `finish_step` raises when a stage ran no
    planned microbatch."""

    def __init__(
        self,
        model: Any,
        topo: Any,
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        groups: Optional[MegatronGroups] = None,
    ) -> None:
        if not isinstance(topo, Topology):
            raise RoutepackTypeError(f"topo: expected routepack.Topology, got {type(topo).__name__}")
        _args.timeout(timeout, optional=False)
        if groups is not None and not isinstance(groups, MegatronGroups):
            raise RoutepackTypeError(f"groups: expected MegatronGroups, got {type(groups).__name__}")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        mods = [m for c in chunks for m in c.modules() if isinstance(m, PlanMoELayer)]
        if not mods:
            raise RoutepackError(
                "model: has no PlanMoELayer (build it with routepack's plan_layer_spec; under a pipeline "
                "every stage must hold at least one MoE layer)"
            )
        _check_groups(chunks)
        for m in mods:
            if m.topo != topo:
                raise RoutepackError(f"model: a PlanMoELayer was built for {m.topo}, the runner for {topo}")
            if m.layer_number is None:
                raise RoutepackError("model: a PlanMoELayer has no layer_number (build it inside a TransformerLayer)")
            m.moe_index = _moe_layer_index(m.logical_config, m.layer_number)
        mods.sort(key=lambda m: m.moe_index)
        self.layers = mods
        if groups is None:  # the layers' own EP group object: no second communicator over the same ranks
            groups = dataclasses.replace(groups_from_parallel_state(), ep=mods[0].ep_group)
        #: the process groups and ranks this runner works over
        self.groups = groups.check()
        self.topo, self.timeout = topo, timeout
        self.config = mods[0].logical_config
        self.num_moe_layers = _num_moe_layers(self.config)
        self.group = groups.ep
        if dist.get_world_size(self.group) != topo.ep:
            raise RoutepackError(f"topo: ep={topo.ep}, the expert-parallel group has {dist.get_world_size(self.group)}")
        ranks = dist.get_process_group_ranks(self.group)
        if any(dist.get_process_group_ranks(m.ep_group) != ranks for m in mods):
            raise RoutepackError(
                f"groups.ep: ranks {ranks}, but the model's PlanMoELayer layers run over another expert-parallel "
                "group (pass the group the model was built with)"
            )
        self.ep_rank = dist.get_rank(self.group)
        peers = group_peers(self.group)
        self.views = [LayerView(m, i, peers, self.group) for i, m in enumerate(mods)]
        #: this rank's pipeline stage and the group of its peers in the other stages (None: pp = 1)
        self.stage, self.pp_group = groups.pipeline_stage(topo, self.num_moe_layers, [m.moe_index for m in mods])
        if topo.vpp > 1 and len(chunks) != topo.vpp:
            raise RoutepackError(f"model: {len(chunks)} model chunk(s); topo.vpp={topo.vpp} needs the list of them")
        self._hooks = [
            c.register_forward_pre_hook(lambda mod, args, held=_chunk_holders(c): self._chunk_forward(held))
            for c in (chunks if topo.vpp > 1 else [])
        ]
        self.dp_rank = groups.dp_rank
        #: this rank's EP group among the plan's (DP ranks ``ep * g ..``)
        self.group_index = groups.ep_group_index(topo, self.ep_rank)
        self.ddp_configs = [getattr(c, "ddp_config", None) for c in chunks]
        #: the window's plan and window (`begin_window`), its replica exchange (None: no
        #: replicas on this stage), the last migration's report
        self.plan: Optional[Plan] = None
        self._window: Optional[Window] = None
        self.exchange: Optional[_Exchange] = None
        self.last_migration: Optional[MigrationReport] = None
        #: the step's wall time, first `start_micro` to `finish_step` (`metrics`)
        self.timer = StepTimer()
        #: the step's microbatches (`MicrobatchState`: current one, kept copies, backwards run)
        self.state = MicrobatchState(len(mods))
        #: with ``recording``, `received` holds the tokens each local expert received (tests)
        self.recording = False
        for m in mods:
            m.runner = self

    @property
    def micro(self) -> Optional[int]:
        """This step's current microbatch (None: outside planned microbatches)."""
        return self.state.micro

    @property
    def received(self) -> Dict[Tuple[int, int], List[int]]:
        """With ``recording``: (micro, moe layer) → the tokens each local Megatron expert received
        in the last forward of that cell (a host copy per layer: tests)."""
        return self.state.received

    @property
    def restores(self) -> int:
        """How often a backward put its microbatch's copies back into the replica buffers (tests)."""
        return self.state.restores

    @restores.setter
    def restores(self, value: int) -> None:
        self.state.restores = value

    @property
    def _moe_indices(self) -> List[int]:
        return [m.moe_index for m in self.layers]

    # ------------------------------------------------------------------ checks
    def _local_plan(self, plan: Plan) -> Plan:
        """The plan restricted to this rank's MoE layers (a pipeline stage holds a part)."""
        return stage_plan(plan, [m.moe_index for m in self.layers])

    def check_plan(self, plan: Any, window: Any, optimizer: Any, token_cap: Optional[int]) -> None:
        """Local refusal, before anything moves, of a plan this job cannot carry out."""
        if not isinstance(plan, Plan):
            raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
        if not isinstance(window, Window):
            raise RoutepackTypeError(f"window: expected routepack.Window, got {type(window).__name__}")
        refuse_split(plan, "the Megatron runner")
        E = self.layers[0].num_logical
        if window.num_layers != self.num_moe_layers or window.num_experts != E:
            raise InvalidPlanError(
                f"window has L={window.num_layers}, E={window.num_experts}; the model has "
                f"{self.num_moe_layers} MoE layers of {E} experts"
            )
        plan.validate(window, self.topo, _NO_CAP if token_cap is None else positive_int(token_cap, "token_cap"))
        local = self._local_plan(plan)
        if local.replicas.size and self.pp_group is not None and _recomputes_moe(self.config):
            raise RoutepackError(
                f"config.recompute_granularity={self.config.recompute_granularity!r}: recomputing the MoE layers "
                "in backward under a pipeline reruns a microbatch's routing and replica copies while a later "
                "microbatch is current; plan with replication='none' or recompute other modules"
            )
        for i, m in enumerate(self.layers):
            for micro in range(plan.num_micro):
                where = f"(group {self.group_index}, micro {micro}, layer {m.moe_index})"
                buffer_of(cell_rows(plan, self.group_index, micro, m.moe_index), m.replica_slots, where)
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
        if (redundant or plan.replicas.size) and any(
            getattr(c, "overlap_grad_reduce", False) for c in self.ddp_configs
        ):
            raise RoutepackError(
                "DistributedDataParallelConfig.overlap_grad_reduce: the plan has redundant experts or replicas, "
                "whose gradients are completed in the last microbatch's backward after DDP would have started "
                "reducing them; set overlap_grad_reduce=False"
            )
        if redundant and self.layers[0].pieces.kind == "GroupedMLP":
            clip = getattr(getattr(optimizer, "config", None), "clip_grad", 0.0) or 0.0
            if clip > 0:
                raise RoutepackError(
                    "optimizer.config.clip_grad: GroupedMLP holds every slot in one parameter, so redundant copies "
                    "would count twice in the grad norm; use SequentialMLP/TEGroupedMLP or clip_grad=0"
                )
        if optimizer is None and local.migration.size:
            owner = stateful_owner([p for m in self.layers for p in m.pieces.params()])
            if owner is not None or any(hasattr(p, "main_param") for m in self.layers for p in m.pieces.params()):
                raise RoutepackError(
                    f"optimizer: None, but {owner or 'a Megatron optimizer'} keeps state for the expert parameters; "
                    f"the plan moves {local.migration.size} experts and that state would stay with the old slots"
                )

    # ------------------------------------------------------------------ window
    def begin_window(
        self,
        plan: Plan,
        window: Window,
        optimizer: Any = None,
        token_cap: Optional[int] = None,
        max_bytes_in_flight: Optional[int] = None,
    ) -> Optional[MigrationReport]:
        """Checks ``plan`` on every EP rank (nothing moves unless all accept), migrates the
        experts it moves (weights, ``main_grad`` and ``optimizer``'s state together), uploads
        the window's routing tables, and marks the copies the grad norm must not count twice.
        Collective over the EP group and, under a pipeline, the pipeline group: every stage
        checks the whole plan, the digests of all stages must agree (one plan per window), and
        each stage migrates its own MoE layers only. Returns the migration report (None without
        moves)."""
        self.check_step_finished("begin_window")
        err: Optional[BaseException] = None
        digest = 0
        try:
            self.check_plan(plan, window, optimizer, token_cap)
            digest = digest_int(plan)
        except Exception as e:  # noqa: BLE001 (shared with every EP rank, then re-raised)
            err = e
        device = self._agree(err, digest)
        self.timer.device = device
        local = self._local_plan(plan)
        report = None
        if local.migration.size:
            spr = self.topo.slots_per_rank
            report = migrate_slots(
                self.views,
                local,
                lambda: [MegatronSlotState(m, optimizer, spr) for m in self.layers],
                group=self.group,
                timeout=self.timeout,
                max_bytes_in_flight=max_bytes_in_flight,
                device=device,
            )
        self.last_migration = report
        origins = cell_origins(plan, window, self.group_index, self.topo.ep)  # [M, ep, L, E]
        for i, m in enumerate(self.layers):
            l = m.moe_index
            cells = layer_tables(plan, window, self.topo, l, self.ep_rank, self.group_index, m.replica_slots)
            m.set_placement(local.placement.phy2log[i], origins.sum(axis=0)[:, l], cells)
        self.plan, self._window = plan, window
        self.exchange = self._make_exchange(local) if local.replicas.size else None
        self._mark_copies(optimizer)
        self.state = MicrobatchState(len(self.layers), restores=self.state.restores)
        return report

    def _agree(self, err: Optional[BaseException], digest: int) -> torch.device:
        """Shares every rank's verdict on the plan and its digest over the EP group, then (pp > 1)
        each stage's over the pipeline group (`routepack.torch.pipeline.agree_stages`). Returns
        the device of the EP group's collectives."""
        device = default_device(self.group)  # where the group's collectives take tensors (NCCL: CUDA)
        agree_stages(err, digest, self.group, self.pp_group, device, self.timeout)
        return device

    def _make_exchange(self, local: Plan) -> _Exchange:
        """The exchange of this stage's rows (``local``: `_local_plan`, layer = position in
        ``layers``, as `_Exchange` indexes them)."""
        r = local.replicas
        idx: Dict[Tuple[int, int], List[int]] = {}
        for i in np.flatnonzero(r["group"] == self.group_index).tolist():
            idx.setdefault((int(r[i]["micro"]), int(r[i]["layer"])), []).append(i)
        cells = {k: (np.asarray(v, dtype=np.int64), r[np.asarray(v)]) for k, v in idx.items()}
        return _Exchange(self.views, cells, self.timeout)

    def _mark_copies(self, optimizer: Any) -> None:
        """Every slot but each logical expert's first copy (redundant copies, empty slots,
        replica buffers) gets ``shared = True`` on its parameters and their optimizer tensors,
        so Megatron's grad norm (``param_is_not_shared``) counts each expert once."""
        for m in self.layers:
            if m.pieces.kind == "GroupedMLP":
                continue  # one parameter holds every slot (refused with clip_grad > 0 and redundancy)
            first = np.full(m.num_logical, -1, dtype=np.int64)
            for p in range(m.phy2log.size - 1, -1, -1):
                if m.phy2log[p] >= 0:
                    first[m.phy2log[p]] = p
            local = m.slot_experts()
            for s in range(m.pieces.num_slots):
                e = int(local[s])
                primary = s < m.slots_per_rank and e >= 0 and first[e] == self.ep_rank * m.slots_per_rank + s
                for piece in m.pieces.slots[s]:
                    for t in [piece.param] + optimizer_tensors(optimizer, piece.param):
                        setattr(t, "shared", not primary)

    # ------------------------------------------------------------------ microbatches
    def start_micro(self, micro: int) -> None:
        """Makes ``micro`` (this step's microbatch index, execution order) current on every
        layer and posts its replica weight transfers (asynchronous)."""
        if self.plan is None:
            raise RoutepackError("start_micro: call begin_window first")
        current = _args.rank(micro, "micro", self.plan.num_micro)
        self.timer.start()
        self.state.start(current)
        for m in self.layers:
            m.slot_map.micro = current
        if self.exchange is not None:
            self.exchange.prefetch(current)

    def _chunk_forward(self, holders: List[Any]) -> None:
        """Forward pre-hook of a model chunk (vpp > 1): makes the microbatch Megatron's schedule
        set on the chunk's layers current (`start_micro`); none set since the last forward: the
        default table. The value read is left in place, marked as read (`_ReadMicro`, an int of
        the same value, which Megatron's CUDA-graph code reads as before), so a forward outside
        the schedule, which finds only read values, is told from one the schedule set up."""
        got = []
        for h in holders:
            value = getattr(h, "current_microbatch", None)
            if value is not None and not isinstance(value, _ReadMicro):
                got.append(int(value))
                h.current_microbatch = _ReadMicro(value)
        micro = got[0] if got else None
        if self.plan is not None and micro is not None:
            self.start_micro(int(micro))
        elif self.plan is not None:
            self.state.micro = None
            for m in self.layers:
                m.slot_map.micro = None

    def microbatches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable`` with `start_micro` called before each item is handed on (microbatch
        ``k % num_micro`` for the k-th): pass it as Megatron's ``data_iterator``."""
        for k, item in enumerate(iterable):
            self.start_micro(k % self.plan.num_micro if self.plan is not None else 0)
            yield item

    def end_micro(self) -> None:
        """Leaves planned microbatches: later forwards (evaluation, log-probs) route by the
        window's default table."""
        self.state.leave()
        for m in self.layers:
            m.slot_map.micro = None

    # ------------------------------------------------------------------ hooks of the layer
    def note_received(self, layer: PlanMoELayer, tokens_per_expert: Any) -> None:
        """With ``recording``: the tokens each local expert of ``layer`` received this forward."""
        micro = self.state.micro
        if micro is not None:
            self.state.received[(micro, layer.moe_index)] = [int(x) for x in tokens_per_expert.tolist()]

    def predicted_received(self) -> np.ndarray:
        """int64 ``[M, L]``: the tokens the plan says this rank receives per (micro, MoE layer)
        (`routepack._core.rank_tokens`, what `simulate` prices)."""
        from routepack import _core

        if self.plan is None or self._window is None:
            raise RoutepackError("predicted_received: call begin_window first")
        got = _core.rank_tokens(self.plan, self._window.seq_lens, self._window.counts, self.topo)
        return got[self.group_index, :, :, self.ep_rank]

    def fill_replicas(self, layer: PlanMoELayer, micro: int) -> None:
        """Forward of ``layer`` in ``micro``: its replica buffers receive the cell's copies
        (received once per microbatch: a recomputed forward finds them kept), which are kept
        until the microbatch's backward (`restore_replicas`, `after_backward`)."""
        exchange = self.exchange
        if exchange is None:
            return
        i = self.layers.index(layer)
        self.state.keep(micro, layer.moe_index, i, lambda: list(exchange.weights(i)))
        self._load_copies(layer, i, micro)

    def restore_replicas(self, layer: PlanMoELayer, micro: int) -> None:
        """Backward of ``layer`` in ``micro``, just before its experts' backward (`_SlotRestore`):
        puts ``micro``'s copies back into the replica buffers if a later microbatch's forward
        has filled them since (pipeline schedules), so the experts' backward reads the weights
        its forward computed with."""
        self.state.restores += int(self._load_copies(layer, self.layers.index(layer), micro))

    def _load_copies(self, layer: PlanMoELayer, i: int, micro: int) -> bool:
        """Writes ``micro``'s kept copies into the buffers of ``layer`` (position ``i``) unless
        they hold them now; True when it wrote. Through ``.data``, between autograd's uses of
        the buffers (a forward, or the experts' backward, of one microbatch)."""

        def write(copies: List[torch.Tensor]) -> None:
            for j, buf in enumerate(copies):
                layer.pieces.set_weights(layer.slots_per_rank + j, buf)

        return self.state.load(i, micro, write)

    def after_backward(self, layer: PlanMoELayer, micro: int) -> None:
        """Backward of ``layer`` in ``micro``, after its experts' weight gradients accumulated:
        the copies' gradients go home (fp32, along the chains, added into the owner's slot)
        and the buffers are zeroed; in the step's last microbatch every redundant expert's
        gradient is summed over the EP group (one all-reduce of those experts only)."""
        i = self.layers.index(layer)
        spr = layer.slots_per_rank
        if self.exchange is not None:
            self.state.drop(micro, i)
            view = self.views[i]
            got = self.exchange.exchange_copy_grads(micro, i, view)
            held = sum(len(ch.mine) for ch in self.exchange._chains(micro, i))
            for j in range(held):
                layer.pieces.set_grad(spr + j, None)
            for slot, buf in got:
                layer.pieces.set_grad(slot, buf, add=True)
        if self.state.count_backward(i, self.plan.num_micro if self.plan is not None else 1):
            self._sum_redundant(layer)

    @torch.no_grad()
    def _sum_redundant(self, layer: PlanMoELayer) -> None:
        redundant = redundant_experts(layer.phy2log, layer.num_logical)
        if redundant.size == 0:
            return
        index = {int(e): k for k, e in enumerate(redundant.tolist())}
        mine = [(s, index[int(e)]) for s, e in enumerate(layer.local_experts().tolist()) if int(e) in index]
        buf = torch.zeros(redundant.size, layer.pieces.numel, dtype=torch.float32, device=layer.pieces.device)
        for s, k in mine:
            buf[k] += layer.pieces.grad(s)
        dist.all_reduce(buf, group=self.group)
        for s, k in mine:
            layer.pieces.set_grad(s, buf[k])

    def sum_redundant(self) -> None:
        """Sums every redundant expert's gradient over the EP group, layer by layer (what the
        step's last planned microbatch does): for a step whose microbatches ran outside
        `start_micro` (a trainer's own microbatches), before ``optimizer.step()``. Collective."""
        self.check_step_finished("sum_redundant")
        for m in self.layers:
            self._sum_redundant(m)
        self.end_micro()

    def check_step_finished(self, where: str) -> None:
        """Raises when some layer's backward ran for part of the step's microbatches only (its
        redundant experts are summed in the step's last microbatch, which has not run)."""
        left = self.state.part_way(self._moe_indices)
        if left:
            raise RoutepackError(
                f"{where}: the step is part-way: MoE layer(s) {list(left)} ran backward for "
                f"{sorted(set(left.values()))} of the plan's {self.plan.num_micro if self.plan else '?'} microbatches"
            )

    def finish_step(self) -> None:
        """Before ``optimizer.step()``: checks every layer completed the step's microbatches
        (replica and redundant gradients are already in ``main_grad``), and leaves planned
        microbatches. Under a pipeline it also raises when some layer ran no planned microbatch
        this step (its stage's forwards did not take their microbatches through
        `microbatches`, so they routed by the default table and skipped the redundant sum)."""
        self.check_step_finished("finish_step")
        idle = self.state.take_idle(self._moe_indices)
        if self.pp_group is not None and idle:
            self.end_micro()
            raise RoutepackError(
                f"finish_step: MoE layer(s) {idle} of pipeline stage {self.stage} ran no planned microbatch this "
                + (
                    "step: their model chunk's forwards ran outside Megatron's forward_step (no current_microbatch)"
                    if self.topo.vpp > 1
                    else "step: its forward_step_func must call next() on the data iterator given by "
                    "runner.microbatches, on every stage"
                )
            )
        self.timer.stop()
        self.end_micro()

    def metrics(self, cost: Any = None) -> Dict[str, float]:
        """The window's plan metrics and the last step's measured time (`PlanRunner.metrics`)."""
        return runner_metrics(self, cost)


__all__ = ["LayerView", "MegatronRunner"]
