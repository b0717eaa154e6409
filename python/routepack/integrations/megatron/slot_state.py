"""What moves with a Megatron expert slot: weights, ``main_grad`` and optimizer state (torch).

`MegatronSlotState` is the `routepack.torch.slot_state.SlotState` of one `PlanMoELayer`: per
placement slot, for every piece of its parameters (`routepack.integrations.megatron.experts.SlotPieces`), in order:

* the weights (the parameter's own elements, which under Megatron's DDP live in its param
  buffer) and ``main_grad`` where DDP gave the parameter one;
* the optimizer's state, found through the optimizer that owns the parameter
  (``ChainedOptimizer``'s parts are searched):

  - a plain ``torch.optim`` optimizer or Megatron's ``FP32Optimizer``: the state keyed by the
    parameter, each tensor of the parameter's size (Adam's ``exp_avg`` / ``exp_avg_sq``);
    scalars (``step``) belong to every slot alike and stay;
  - ``Float16OptimizerWithFloat16Params``: the fp32 master (``param.main_param``) and its state;
  - ``DistributedOptimizer``: the fp32 master shard and Adam's moments live in flat buffers
    sharded over the (expert-)data-parallel group; this rank holds elements ``[start, end)``
    of the parameter (``_get_model_param_range_map(param)["param"]``). Before packing, the
    ranks of that group assemble each slot they send by one all-reduce of their pieces (every
    piece is some rank's; the others add zeros); a received slot writes back only this
    rank's range. The master of an fp32 parameter is a view of the parameter itself (moved
    with the weights).

Anything else is refused before anything moves, naming the optimizer class, parameter and
state key: an optimizer without a known owner of the parameter, a state tensor of another
size, Megatron's precision-aware optimizer (TE's FusedAdam keeps scaled state), an offloaded
(``HybridDeviceOptimizer``) state.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.integrations.megatron.experts import Piece, flat
from routepack.torch.slot_state import SlotState


def flat_optimizers(optimizer: Any) -> List[Any]:
    """The optimizers inside ``optimizer`` (``ChainedOptimizer``'s parts, or itself)."""
    parts = getattr(optimizer, "chained_optimizers", None)
    return list(parts) if parts is not None else [optimizer]


def _is(obj: Any, name: str) -> bool:
    return any(c.__name__ == name for c in type(obj).__mro__)


def _owner_of(optimizers: List[Any], param: torch.nn.Parameter) -> Tuple[str, Any, Any]:
    """(kind, optimizer, key): how ``param``'s state is held. kind: "keyed" (state keyed by
    ``key``, a full-size tensor), "dist" (Megatron's DistributedOptimizer), "none" (no optimizer
    holds it: frozen)."""
    for opt in optimizers:
        if _is(opt, "HybridDeviceOptimizer") or _is(getattr(opt, "optimizer", None), "HybridDeviceOptimizer"):
            raise RoutepackError(f"optimizer: {type(opt).__name__} offloads state to the host; not supported")
        if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
            raise RoutepackError(
                f"optimizer: {type(opt).__name__} with use_precision_aware_optimizer (TE FusedAdam's scaled "
                "state) is not supported"
            )
        if _is(opt, "DistributedOptimizer"):
            if any(param in buf.param_index_map for buf in getattr(opt, "buffers", [])):
                return "dist", opt, None
            continue
        groups16 = getattr(opt, "float16_groups", None)
        if groups16 is not None:  # Float16OptimizerWithFloat16Params
            for gi, group in enumerate(groups16):
                for pi, p in enumerate(group):
                    if p is param:
                        return "keyed", opt.optimizer, opt.fp32_from_float16_groups[gi][pi]
        inner = getattr(opt, "optimizer", opt)  # FP32Optimizer wraps a torch optimizer
        for g in getattr(inner, "param_groups", []):
            if any(p is param for p in g["params"]):
                return "keyed", inner, param
    return "none", None, None


class _Sharded:
    """One DistributedOptimizer tensor of a piece (master shard or a moment): this rank's
    elements ``[lo, hi)`` of the piece (piece-relative) in ``local``, or none."""

    def __init__(self, local: Optional[torch.Tensor], lo: int, hi: int, n: int, dtype: torch.dtype) -> None:
        self.local, self.lo, self.hi, self.n, self.dtype = local, lo, hi, n, dtype


class MegatronSlotState(SlotState):
    """See the module docstring. ``layer``: a `PlanMoELayer`; ``optimizer``: Megatron's
    optimizer (or a torch one, or None: no optimizer state); ``num_slots``: the placement
    slots (replica buffers never move)."""

    def __init__(self, layer: Any, optimizer: Any, num_slots: int) -> None:
        self.layer = layer
        self.pieces = layer.pieces
        self.device = self.pieces.device
        opts = flat_optimizers(optimizer) if optimizer is not None else []
        self.local: List[List[torch.Tensor]] = []
        self.sharded: List[List[_Sharded]] = []
        self.group: Any = None
        for s in range(num_slots):
            loc: List[torch.Tensor] = []
            sh: List[_Sharded] = []
            for p in self.pieces.slots[s]:
                self._components(p, opts, loc, sh)
            self.local.append(loc)
            self.sharded.append(sh)
        sizes = {
            (sum(t.numel() * t.element_size() for t in loc), tuple((c.n, c.dtype) for c in sh))
            for loc, sh in zip(self.local, self.sharded)
        }
        if len(sizes) != 1:
            raise RoutepackError(f"optimizer: the slots of MoE layer {layer.moe_index} hold state of different sizes")
        local_bytes, shard_spec = sizes.pop()
        self.nbytes = local_bytes + sum(n * torch.empty(0, dtype=dt).element_size() for n, dt in shard_spec)
        self._assembled: Dict[int, torch.Tensor] = {}

    def _components(self, p: Piece, opts: List[Any], loc: list, sh: list) -> None:
        a, n = p.start, p.length
        where = f"MoE layer {self.layer.moe_index} {p.name}"
        loc.append(flat(p.param.data)[a : a + n])
        g = getattr(p.param, "main_grad", None)
        if g is not None:
            loc.append(flat(g)[a : a + n])
        kind, opt, key = _owner_of(opts, p.param) if opts else ("none", None, None)
        if kind == "keyed" and key is not None and opt is not None:
            if key is not p.param:  # an fp32 master of a low-precision parameter
                loc.append(flat(key.data)[a : a + n])
            for k in sorted(opt.state.get(key, {}), key=str):
                v = opt.state[key][k]
                if not torch.is_tensor(v) or v.dim() == 0:
                    continue  # step counts and other per-parameter scalars stay
                if v.numel() != key.numel():
                    raise RoutepackError(
                        f"optimizer.state[{where}][{k!r}]: {tuple(v.shape)} is not the parameter's size "
                        f"{tuple(key.shape)}; routepack cannot move it with the expert"
                    )
                loc.append(flat(v)[a : a + n])
        elif kind == "dist":
            self._dist_components(p, opt, where, sh)

    def _dist_components(self, p: Piece, opt: Any, where: str, sh: list) -> None:
        a, n = p.start, p.length
        self.group = opt.data_parallel_group
        try:
            rng = opt._get_model_param_range_map(p.param)["param"]
            gi, go = opt.model_param_group_index_map[p.param]
            main = opt.optimizer.param_groups[gi]["params"][go]
        except KeyError:
            rng, main = None, None  # this rank holds no element of the parameter
        keys = _state_keys(opt.optimizer)
        lo = hi = 0
        if rng is not None:
            lo, hi = max(rng.start, a) - a, min(rng.end, a + n) - a
        tensors = []
        if p.param.dtype != torch.float32:  # an fp32 parameter's master is a view of itself
            tensors.append(("main", main))
        state = opt.optimizer.state.get(main, {}) if main is not None else {}
        for k in keys:
            v = state.get(k) if main is not None else None
            if main is not None and v is None:
                raise RoutepackError(f"optimizer.state[{where}]: no {k!r} on this rank, other parameters have it")
            tensors.append((k, v))
        dtype = torch.float32
        for k, t in tensors:
            if t is not None:
                dtype = t.dtype
            local = None
            if t is not None and hi > lo and rng is not None:
                off = max(rng.start, a) - rng.start
                local = flat(t.data if k == "main" else t)[off : off + hi - lo]
            sh.append(_Sharded(local, lo, hi, n, t.dtype if t is not None else dtype))

    # ------------------------------------------------------------------- protocol
    def prepare(self, slots: List[int]) -> None:
        """Assembles the sharded part of each slot in ``slots`` over the data-parallel group:
        each tensor is this rank's piece and zeros elsewhere, all-reduced (a piece plus zeros
        is exact). Every rank of the group packs the same slots (the same plan rows)."""
        self._assembled = {}
        if self.group is None or not self.sharded[0]:
            return
        for s in slots:
            parts = []
            for c in self.sharded[s]:
                full = torch.zeros(c.n, dtype=c.dtype, device=self.device)
                if c.local is not None:
                    full[c.lo : c.hi] = c.local
                dist.all_reduce(full, group=self.group)
                parts.append(full.view(torch.uint8))
            self._assembled[s] = torch.cat(parts)

    def pack(self, slot: int) -> torch.Tensor:
        parts = [t.reshape(-1).view(torch.uint8) for t in self.local[slot]]
        if self.sharded[slot]:
            parts.append(self._assembled[slot])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=self.device)

    @torch.no_grad()
    def unpack(self, slot: int, buf: torch.Tensor) -> None:
        off = 0
        for t in self.local[slot]:
            dst = t.reshape(-1).view(torch.uint8)
            dst.copy_(buf[off : off + dst.numel()])
            off += dst.numel()
        for c in self.sharded[slot]:
            size = c.n * torch.empty(0, dtype=c.dtype).element_size()
            if c.local is not None:
                vals = buf[off : off + size].view(c.dtype)
                c.local.copy_(vals[c.lo : c.hi])
            off += size

    def backup(self, slot: int) -> Any:
        return [t.clone() for t in self.local[slot]], [
            c.local.clone() if c.local is not None else None for c in self.sharded[slot]
        ]

    @torch.no_grad()
    def restore(self, slot: int, saved: Any) -> None:
        loc, sh = saved
        for t, v in zip(self.local[slot], loc):
            t.copy_(v)
        for c, v in zip(self.sharded[slot], sh):
            if c.local is not None:
                c.local.copy_(v)


def _state_keys(inner: Any) -> List[str]:
    """The per-element state keys the inner optimizer keeps (from any entry: Adam keeps the
    same keys for every parameter), sorted; [] before its first step."""
    for v in inner.state.values():
        keys = sorted(k for k, t in v.items() if torch.is_tensor(t) and t.dim() > 0)
        if keys:
            return keys
    return []


def optimizer_tensors(optimizer: Any, param: torch.nn.Parameter) -> List[torch.Tensor]:
    """The tensors ``optimizer`` steps for ``param`` (what its grad norm reads): the parameter,
    its fp32 master or its DistributedOptimizer shard ([] where this rank holds none)."""
    if optimizer is None:
        return []
    kind, opt, key = _owner_of(flat_optimizers(optimizer), param)
    if kind == "keyed":
        return [key]
    if kind == "dist":
        try:
            gi, go = opt.model_param_group_index_map[param]
        except KeyError:
            return []
        return [opt.optimizer.param_groups[gi]["params"][go]]
    return []


__all__ = ["MegatronSlotState", "flat_optimizers", "optimizer_tensors"]
