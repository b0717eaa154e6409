"""`PlanMoELayer`: Megatron-Core's ``MoELayer`` over a plan's physical slots (torch, Megatron).

The layer is the stock ``MoELayer`` built with ``num_moe_experts = ep * (slots_per_rank +
replica_slots)``, so Megatron's own token dispatcher (all-to-all or all-gather) and expert
module (``SequentialMLP``, ``GroupedMLP``, ``TEGroupedMLP``) run unchanged on the physical
experts; local expert ``i < slots_per_rank`` of EP rank r is the plan's slot
``r * slots_per_rank + i``, the ``replica_slots`` after it are buffers for the microbatch's
intra-batch replica copies. Three things differ from the stock layer:

* its router is the stock router class (``TopKRouter``, RouterReplay and verl's patch
  included) built over the E logical experts (the model config's ``num_moe_experts``), so
  its weights, checkpoint key (``router.weight``), aux losses and replay registry entry are
  the stock model's, one per layer, with ``layer_number`` set; its ``forward`` maps the
  logical ``(probs, routing_map)`` to the physical experts on the device
  (`routepack.integrations.megatron.tables.SlotMap`);
* one autograd node (`_SlotLink`) sits on the dispatched tokens in front of the experts: its
  forward fills the replica buffers with the copies' weights (sent along the simulator's
  chains, `routepack.torch.ReplicaExchange`), its backward, which runs after the experts'
  weight gradients have accumulated (``main_grad`` under Megatron's DDP), sends the copies'
  gradients home and, in the step's last microbatch, sums redundant experts over the EP group
  (`MegatronRunner.after_backward`);
* under a pipeline schedule a stage runs the forward of later microbatches before the
  backward of earlier ones (1F1B), and each forward fills the one set of replica buffers with
  its own copies. The experts' backward reads the buffers' weights again (the input
  gradient), and writes through ``.data`` leave autograd's version counters alone, so nothing
  would catch it reading a later microbatch's copies. A second node (`_SlotRestore`) on the
  experts' output therefore has, in its backward (which runs just before the experts', in the
  same thread and stream), the runner put the microbatch's own copies back when another's are
  there (`MegatronRunner.restore_replicas`; the runner keeps each microbatch's received copies
  from its forward to its backward). The microbatch is the one the forward ran, kept in both
  nodes' autograd context, whatever microbatch is current when the backward runs.

Without a `routepack.integrations.megatron.MegatronRunner` the layer routes by its placement
(initially the static one) and computes the logical model's function.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # type: ignore[import-untyped]
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection  # type: ignore[import-untyped]
from megatron.core.transformer.moe.router import TopKRouter  # type: ignore[import-untyped]
from megatron.core.transformer.spec_utils import ModuleSpec  # type: ignore[import-untyped]

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.integrations.megatron.experts import SlotPieces
from routepack.integrations.megatron.tables import SlotMap, default_table
from routepack.model import Topology
from routepack.plan import Placement


class _PlanRouting:
    """Mixed into the layer's router class: the stock routing over the logical experts, then
    the plan's map to physical experts (see the module docstring)."""

    #: set by `PlanMoELayer` (a plain attribute: no submodule, nothing in the state dict)
    slot_map: Optional[SlotMap] = None

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):  # type: ignore[override]
        probs, routing_map = super().forward(input, padding_mask=padding_mask)  # type: ignore[misc]
        if self.slot_map is None:
            return probs, routing_map
        return self.slot_map.physical(probs, routing_map)


_ROUTER_CLASSES: Dict[type, type] = {}


def plan_router_class(router: Any) -> type:
    """The plan's router class for Megatron router class ``router`` (a subclass of both)."""
    if not (isinstance(router, type) and issubclass(router, TopKRouter)):
        raise RoutepackTypeError(
            f"MoESubmodules.router: expected TopKRouter or a subclass of it, got {router!r} "
            "(routepack subclasses the router class to route over the logical experts)"
        )
    if router not in _ROUTER_CLASSES:
        _ROUTER_CLASSES[router] = type(f"Plan{router.__name__}", (_PlanRouting, router), {})
    return _ROUTER_CLASSES[router]


def check_config(config: Any) -> None:
    """Refuses (naming the option) what the plan's layer cannot run as the stock one does."""
    bad = []
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        bad.append("moe_expert_capacity_factor (token dropping sizes capacity by physical experts)")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        bad.append("moe_pad_expert_input_to_capacity")
    if getattr(config, "moe_router_padding_for_quantization", False):
        bad.append("moe_router_padding_for_quantization")
    if getattr(config, "delay_wgrad_compute", False):
        bad.append("delay_wgrad_compute (expert weight gradients after the slot link's backward)")
    if getattr(config, "cuda_graph_impl", "none") != "none":
        bad.append("cuda_graph_impl (a captured graph would keep one microbatch's routing tables)")
    if (getattr(config, "expert_tensor_parallel_size", None) or 1) > 1:
        bad.append("expert_tensor_parallel_size > 1 (not supported yet)")
    if getattr(config, "context_parallel_size", 1) > 1:
        bad.append("context_parallel_size > 1 (not supported yet)")
    if getattr(config, "moe_token_dispatcher_type", "alltoall") not in ("alltoall", "allgather"):
        bad.append(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} (alltoall or allgather)")
    if bad:
        raise RoutepackError("config: not supported with a routepack plan: " + "; ".join(bad))


class _SlotLink(torch.autograd.Function):
    """Identity on the dispatched tokens; see the module docstring."""

    @staticmethod
    def forward(ctx, tokens, layer):  # type: ignore[override]
        runner = layer.runner
        micro = layer.slot_map.micro
        ctx.layer, ctx.runner, ctx.micro = layer, runner, micro
        if runner is not None and micro is not None:
            runner.fill_replicas(layer, micro)
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.runner is not None and ctx.micro is not None:
            ctx.runner.after_backward(ctx.layer, ctx.micro)
        return grad, None


class _SlotRestore(torch.autograd.Function):
    """Identity on the experts' output: its backward, which runs just before the experts'
    backward, puts this microbatch's copies back into the replica buffers (module docstring)."""

    @staticmethod
    def forward(ctx, out, layer, micro):  # type: ignore[override]
        ctx.layer, ctx.micro = layer, micro
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.layer.runner.restore_replicas(ctx.layer, ctx.micro)
        return grad, None, None


class PlanMoELayer(MoELayer):
    """Megatron's ``MoELayer`` over a plan's physical slots (module docstring). Extra
    arguments (a layer spec's ``params``): ``topo``, the plan's `routepack.Topology` (its
    ``ep`` must be the EP group's size; ``slots_per_rank`` placement slots a rank), and
    ``replica_slots``, replica buffers a rank (0: plans without intra-batch replicas)."""

    def __init__(
        self,
        config: Any,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Any = None,
        topo: Optional[Topology] = None,
        replica_slots: int = 0,
    ) -> None:
        if not isinstance(topo, Topology):
            raise RoutepackTypeError(f"topo: expected routepack.Topology in the layer spec's params, got {topo!r}")
        if not isinstance(replica_slots, int) or isinstance(replica_slots, bool) or replica_slots < 0:
            raise RoutepackError(f"replica_slots: expected an int >= 0, got {replica_slots!r}")
        check_config(config)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        ep = pg_collection.ep.size()
        experts = int(config.num_moe_experts)
        if ep != topo.ep:
            raise RoutepackError(f"topo: ep={topo.ep}, but the expert-parallel group has {ep} ranks")
        if experts > topo.num_slots:
            raise RoutepackError(f"topo: {topo.num_slots} slots for num_moe_experts={experts} logical experts")
        per_rank = topo.slots_per_rank + replica_slots
        physical = copy.copy(config)
        physical.num_moe_experts = ep * per_rank
        submodules = submodules if submodules is not None else MoESubmodules()
        router_cls = plan_router_class(submodules.router)
        logical = config

        def build_router(config: Any = None, pg_collection: Any = None) -> Any:
            return router_cls(config=logical, pg_collection=pg_collection)

        super().__init__(physical, dataclasses.replace(submodules, router=build_router), layer_number, pg_collection)
        self.logical_config = logical
        self.topo, self.replica_slots, self.num_logical = topo, replica_slots, experts
        self.ep_rank = pg_collection.ep.rank()
        self.pieces = SlotPieces(self.experts)
        self.slot_map = SlotMap(experts, ep * per_rank)
        self.router.slot_map = self.slot_map
        #: the plan's MoE layer index (set by the runner; -1 before); the runner, when attached
        self.moe_index: int = -1
        self.runner: Any = None
        self.set_placement(Placement.static(1, experts, topo).phy2log[0])
        from routepack.integrations.megatron.checkpoint import sync_local_copies

        self.register_load_state_dict_post_hook(lambda module, keys: sync_local_copies(module))

    # ------------------------------------------------------------------ placement
    @property
    def slots_per_rank(self) -> int:
        return self.topo.slots_per_rank

    def set_placement(self, phy2log_row: np.ndarray, origin: Optional[np.ndarray] = None, cells: Any = None) -> None:
        """Installs a placement row (int32 ``[ep * slots_per_rank]``; the weights must already
        be there) and the routing tables: the default one from ``origin`` (int ``[ep, E]``),
        the per-microbatch ones ``cells`` (`layer_tables`' pair, or None)."""
        row = np.ascontiguousarray(phy2log_row, dtype=np.int32)
        self.phy2log = row
        default = default_table(row, self.topo, self.ep_rank, self.replica_slots, origin)
        self.slot_map.upload(default, cells, self.router.weight.device)

    def local_experts(self) -> np.ndarray:
        """int32 ``[slots_per_rank]``: the logical expert of each local placement slot (-1 empty)."""
        spr = self.slots_per_rank
        return self.phy2log[self.ep_rank * spr : (self.ep_rank + 1) * spr]

    def slot_experts(self) -> np.ndarray:
        """int64 ``[num_local_experts]``: the logical expert each local Megatron expert holds
        for checkpoints and export (-1: an empty slot or a replica buffer)."""
        out = np.full(self.pieces.num_slots, -1, dtype=np.int64)
        out[: self.slots_per_rank] = self.local_experts()
        return out

    # ---------------------------------------------------------------- checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        """Megatron's sharded state dict with the experts in logical ids (stock keys and shapes:
        `routepack.integrations.megatron.checkpoint.logical_sharded_state_dict`)."""
        from routepack.integrations.megatron.checkpoint import logical_sharded_state_dict

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        mine = f"{prefix}experts."
        out = {k: v for k, v in out.items() if not k.startswith(mine)}
        out.update(logical_sharded_state_dict(self, mine, sharded_offsets, metadata))
        return out

    # ------------------------------------------------------------------- forward
    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[Any, Any]:
        """The stock step with `_SlotLink` on the dispatched tokens (module docstring)."""
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        if self.runner is not None and self.runner.recording:
            self.runner.note_received(self, tokens_per_expert)
        dispatched_input = _SlotLink.apply(dispatched_input, self)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        micro = self.slot_map.micro
        if self.runner is not None and self.runner.exchange is not None and micro is not None:
            expert_output = _SlotRestore.apply(expert_output, self, micro)
        assert mlp_bias is None, f"mlp_bias is not supported for {type(self.token_dispatcher)}"
        return self.token_dispatcher.combine_preprocess(expert_output), mlp_bias


def _swap(spec: Any, topo: Topology, replica_slots: int) -> int:
    """Replaces every ``MoELayer`` module spec under ``spec`` (in place) by `PlanMoELayer`;
    returns how many."""
    n = 0
    if isinstance(spec, ModuleSpec):
        if isinstance(spec.module, type) and issubclass(spec.module, MoELayer):
            if spec.module is not MoELayer and not issubclass(spec.module, PlanMoELayer):
                raise RoutepackError(
                    f"layer spec: {spec.module.__name__} subclasses MoELayer; routepack replaces only MoELayer itself"
                )
            spec.module = PlanMoELayer
            spec.params = {**spec.params, "topo": topo, "replica_slots": replica_slots}
            return 1
        return _swap(spec.submodules, topo, replica_slots)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            n += _swap(getattr(spec, f.name), topo, replica_slots)
    elif isinstance(spec, (list, tuple)):
        for s in spec:
            n += _swap(s, topo, replica_slots)
    return n


def plan_layer_spec(spec: Any, topo: Any, replica_slots: int = 0) -> Any:
    """A copy of a Megatron layer or block spec (``get_gpt_layer_local_spec(...)``,
    ``get_gpt_decoder_block_spec(...)``, ...) whose MoE layers are `PlanMoELayer` over
    ``topo``'s slots with ``replica_slots`` replica buffers a rank. The model config keeps
    ``num_moe_experts`` = the logical experts."""
    if not isinstance(topo, Topology):
        raise RoutepackTypeError(f"topo: expected routepack.Topology, got {type(topo).__name__}")
    out = copy.deepcopy(spec)
    if _swap(out, topo, replica_slots) == 0:
        raise RoutepackError("spec: has no MoELayer module spec (build it with num_experts=...)")
    return out


__all__ = ["PlanMoELayer", "check_config", "plan_layer_spec", "plan_router_class"]
