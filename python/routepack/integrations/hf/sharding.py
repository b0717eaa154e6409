"""Expert-parallel training of a Hugging Face transformers MoE model under routepack plans.

`shard` swaps every MoE block's experts module for `EPExperts`, a module with the same call
(``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``) that runs
the experts expert-parallel with `routepack.torch.EPMoE`: this rank's slots of the plan's
placement, all-to-all dispatch and combine over the EP group, the plan's replicas. The
router, the attention, the shared experts and everything else stay as transformers wrote
them. Training then goes::

    sh = hf.shard(model, first_plan, group, topo=topo)       # loads this rank's slots
    opt = torch.optim.Adam(model.parameters())                # owns the slot weights themselves
    for plan, window, routed, cu in windows:                  # one optimizer step per window
        sh.begin_window(plan, window, opt)                    # migration (+ optimizer state), replicas
        for mb in routepack.torch.rank_microbatches(plan, routed, rank, cu, dp=topo.dp):
            ids, mask = ...                                   # this rank's samples of mb, [n, S]
            sh.start_micro(mb.micro, tokens=mask)             # padding is not dispatched
            with hf.replay_routing(model, mb.routed, attention_mask=mask):   # R3
                loss = loss_of(model(input_ids=ids, attention_mask=mask).logits)
            loss.backward()
        sh.finish_step()                                      # replica / redundant / dense grads
        opt.step(); opt.zero_grad()

No hidden copies: the experts' only weights are each `EPMoE`'s ``w1`` ``[slots_per_rank, H,
2I]`` and ``w2`` ``[slots_per_rank, I, H]`` (routepack's grouped-GEMM layout; transformers'
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` transposed per expert), which are
``model.parameters()``; the original expert tensors are dropped. Migration moves slots of
those tensors, with the optimizer state keyed by them (`routepack.torch.migrate`).

Layouts `shard` carries (else `RoutepackError` naming the module): a block whose router is
one of `routepack.integrations.hf`'s families and whose ``experts`` is that family's own
experts class holding ``gate_up_proj`` ``[E, 2I, H]`` (gate then up) and ``down_proj``
``[E, H, I]`` without biases, SiLU-gated: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3,
GLM-4.5. GPT-OSS (transposed experts with biases and a clamped activation) is refused, and
so is Mixtral with ``router_jitter_noise > 0`` (each rank would draw its own noise).
"""

from __future__ import annotations

import datetime
from typing import Any, List, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.integrations.hf.families import family_of
from routepack.model import Topology
from routepack.plan import Placement, Plan
from routepack.torch import EPMoE, MigrationReport, PlanRunner, checksum, gather_ints

#: families whose experts module `shard` can carry (GPT-OSS's is not: see the module doc)
SHARDABLE = ("Qwen3-MoE", "Qwen2-MoE", "OLMoE", "Mixtral", "DeepSeek-V3", "GLM-4.5")


class MoEBlock(NamedTuple):
    """One MoE block: module path, the block, its router, its experts module, family name."""

    name: str
    block: Any
    router: Any
    experts: Any
    family: str


def _is_silu(act: Any) -> bool:
    """True when ``act`` computes SiLU (checked on values, whatever its class)."""
    if not callable(act):
        return False
    t = torch.linspace(-6.0, 6.0, 25)
    try:
        return bool(torch.allclose(act(t), F.silu(t), rtol=0, atol=1e-6))
    except Exception:  # noqa: BLE001 (any failure means: not SiLU)
        return False


def _check_experts(name: str, experts: Any, router: Any, fam: Any) -> None:
    """Raises `RoutepackError` naming ``name`` unless ``experts`` has the layout `shard` carries."""
    cls = type(experts)
    where = f"model: {name} ({cls.__module__}.{cls.__qualname__})"
    if cls.__module__ != fam.module or not cls.__qualname__.endswith("Experts"):
        raise RoutepackError(
            f"{where}: expected the {fam.name} experts class of {fam.module} (a subclass or "
            "another module may compute something else)"
        )
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    e = int(router.num_experts)
    if not (
        isinstance(gu, torch.nn.Parameter)
        and isinstance(dn, torch.nn.Parameter)
        and gu.dim() == 3
        and dn.dim() == 3
        and gu.shape[0] == e
        and gu.shape[1] % 2 == 0
        and tuple(dn.shape) == (e, gu.shape[2], gu.shape[1] // 2)
    ):
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (gu, dn)]
        raise RoutepackError(
            f"{where}: expected gate_up_proj [E={e}, 2I, H] and down_proj [E, H, I] parameters, "
            f"got {got[0]} and {got[1]}"
        )
    if (
        getattr(experts, "is_transposed", False)
        or not getattr(experts, "is_concatenated", True)
        or not getattr(experts, "has_gate", True)
        or getattr(experts, "has_bias", False)
        or getattr(experts, "has_post_expert_norm", False)
        or any(getattr(experts, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias"))
    ):
        raise RoutepackError(
            f"{where}: transposed, interleaved, biased or post-normed expert weights are not supported by shard"
        )
    if not _is_silu(getattr(experts, "act_fn", None)):
        raise RoutepackError(
            f"{where}: act_fn {type(getattr(experts, 'act_fn', None)).__name__} is not SiLU "
            "(routepack's experts are SwiGLU)"
        )
    if not gu.dtype.is_floating_point or dn.dtype != gu.dtype:
        raise RoutepackError(f"{where}: gate_up_proj {gu.dtype} / down_proj {dn.dtype}: expected one floating dtype")


def moe_blocks(model: Any) -> List[MoEBlock]:
    """The model's MoE blocks in layer order (the order `routepack.integrations.hf` records
    routing in), each checked to have a layout `shard` carries; raises `RoutepackError`
    naming the first module that has not (or the model's class when it has no MoE block)."""
    if not isinstance(model, torch.nn.Module):
        raise RoutepackTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    out: List[MoEBlock] = []
    for name, mod in model.named_modules():
        fam = family_of(mod)
        if fam is None:
            continue
        parent = name.rpartition(".")[0]
        block = model.get_submodule(parent) if parent else model
        if fam.name not in SHARDABLE:
            raise RoutepackError(
                f"model: {parent} ({type(block).__name__}): {fam.name} experts (transposed, with "
                "biases and a clamped activation) are not supported by shard; supported: "
                f"{', '.join(SHARDABLE)}"
            )
        if getattr(block, "gate", None) is not mod or not hasattr(block, "experts"):
            raise RoutepackError(
                f"model: router {name} is not the 'gate' of a block with an 'experts' module "
                f"({type(block).__name__}); shard cannot find its experts"
            )
        if isinstance(block.experts, EPExperts):
            raise RoutepackError(f"model: {parent}.experts is already sharded")
        _check_experts(f"{parent}.experts", block.experts, mod, fam)
        if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0.0:
            raise RoutepackError(
                f"model: {parent} has router_jitter_noise={block.jitter_noise}: every rank would "
                "scale its hidden states by its own noise; set it to 0 to shard"
            )
        out.append(MoEBlock(f"{parent}.experts", block, mod, block.experts, fam.name))
    if not out:
        raise RoutepackError(
            f"model: {type(model).__name__} has no MoE block routepack can shard (supported: {', '.join(SHARDABLE)})"
        )
    e, k = out[0].router.num_experts, out[0].router.top_k
    for b in out[1:]:
        if (b.router.num_experts, b.router.top_k) != (e, k):
            raise RoutepackError(
                f"model: {b.name} has E={b.router.num_experts}, k={b.router.top_k}; {out[0].name} has E={e}, k={k}"
            )
    return out


class EPExperts(torch.nn.Module):
    """Stands in for one block's experts module: same call, run by ``self.ep`` (`EPMoE`).

    ``forward(hidden_states [N, H], top_k_index int [N, k], top_k_weights float [N, k])``
    returns ``[N, H]`` in ``hidden_states``' dtype. Only the rows the current microbatch
    marks as tokens (`ShardedMoE.start_micro`) are dispatched; the others (padding) get 0.
    Collective: every EP rank runs every MoE layer of every microbatch."""

    def __init__(self, ep: EPMoE, owner: "ShardedMoE") -> None:
        super().__init__()
        self.ep = ep
        self._owner = [owner]  # in a list: not a submodule, and no reference cycle through _modules

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        owner = self._owner[0]
        keep = owner._keep
        x, ids, w = hidden_states, top_k_index, top_k_weights
        if keep is not None:
            if owner._mask_size != hidden_states.shape[0]:
                # a local error must not leave the peers waiting in this layer's exchanges: invalid
                # inputs make EPMoE raise on every rank at once
                try:
                    self.ep(x, ids[:0], w)
                except RoutepackError as e:
                    raise RoutepackError(
                        f"tokens: the mask given to start_micro has {owner._mask_size} entries but "
                        f"MoE layer {self.ep.layer} sees {hidden_states.shape[0]} tokens"
                    ) from e
            keep = keep.to(hidden_states.device)
            x, ids, w = x.index_select(0, keep), ids.index_select(0, keep), w.index_select(0, keep)
        if owner.recording:
            owner._seen[self.ep.layer].append(ids.detach().cpu().clone())
        y = self.ep(x.to(self.ep.w1.dtype), ids, w).to(hidden_states.dtype)
        if keep is None:
            return y
        return hidden_states.new_zeros(hidden_states.shape).index_copy(0, keep, y)


def _placement(plan: Any) -> Placement:
    if isinstance(plan, Plan):
        return plan.placement
    if isinstance(plan, Placement):
        return plan
    raise RoutepackTypeError(f"plan: expected routepack.Plan or routepack.Placement, got {type(plan).__name__}")


class ShardedMoE:
    """A model whose MoE blocks run expert-parallel (made by `shard`).

    Attributes: ``model``; ``blocks`` (`MoEBlock`, as found); ``layers`` (this rank's `EPMoE`
    per MoE layer); ``runner`` (`routepack.torch.PlanRunner`); ``topo``; ``group``;
    ``recording`` (when True, every forward's dispatched ids are kept for `take_routed`)."""

    def __init__(
        self,
        model: Any,
        blocks: List[MoEBlock],
        layers: List[EPMoE],
        runner: PlanRunner,
        topo: Topology,
        group: Any,
        dense_group: Any,
    ) -> None:
        self.model, self.blocks, self.layers, self.runner = model, blocks, layers, runner
        self.topo, self.group, self.dense_group = topo, group, dense_group
        self.recording = False
        self._keep: Optional[torch.Tensor] = None
        self._mask_size = 0
        self._seen: List[List[torch.Tensor]] = [[] for _ in layers]

    # ------------------------------------------------------------ parameters
    def expert_parameters(self) -> List[torch.nn.Parameter]:
        """Every layer's ``w1`` and ``w2`` (this rank's slots), layer order."""
        return [p for mod in self.layers for p in (mod.w1, mod.w2)]

    def dense_parameters(self) -> List[torch.nn.Parameter]:
        """Every other parameter of the model (replicated on every DP rank), model order."""
        ids = {id(p) for p in self.expert_parameters()}
        return [p for p in self.model.parameters() if id(p) not in ids]

    # --------------------------------------------------------------- windows
    def begin_window(
        self,
        plan: Plan,
        window: Any,
        optimizer: Optional[torch.optim.Optimizer] = None,
        token_cap: Optional[int] = None,
        extra_state: Optional[dict] = None,
    ) -> Optional[MigrationReport]:
        """Applies the next window's ``plan`` (collective over the EP group): checks it
        against ``window`` and this job on every rank, migrates the experts it moves with
        ``optimizer``'s state for them (and ``extra_state[layer]`` tensors, leading dimension
        slots_per_rank), and arms its replicas. `PlanRunner.begin_window`; returns its report."""
        return self.runner.begin_window(plan, window, optimizer, token_cap=token_cap, extra_state=extra_state)

    def start_micro(self, micro: int, tokens: Any = None, prefetch: bool = True) -> None:
        """Makes ``micro`` the current microbatch (posts its replica transfers). ``tokens``:
        bool or 0/1 ``[B, S]`` (the forward's ``attention_mask``), 1 at the tokens to
        dispatch, rows in the order the router sees them; None dispatches every token. All
        zeros: this rank has no tokens in ``micro`` but still takes part in its exchanges."""
        self.runner.start_micro(micro, prefetch=prefetch)
        if tokens is None:
            self._keep = None
            return
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        mask = np.asarray(tokens)
        if mask.ndim != 2 or not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
            raise RoutepackError(f"tokens: expected a bool or integer [B, S] mask, got {mask.dtype} {mask.shape}")
        if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
            raise RoutepackError(f"tokens: entries must be 0 or 1, got {np.unique(mask)[:8].tolist()}")
        self._keep = torch.from_numpy(np.flatnonzero(mask.reshape(-1)).astype(np.int64))
        self._mask_size = int(mask.size)

    def finish_step(self, sync_dense: bool = True) -> None:
        """Before the optimizer step: replica gradients into their owner slots, every expert's
        gradient summed over its slots (`PlanRunner.finish_step`), and with ``sync_dense``
        every dense parameter's gradient summed over ``dense_group`` (one flat fp32
        all-reduce; pass False when DDP or the trainer does that)."""
        self.runner.finish_step()
        if sync_dense:
            params = self.dense_parameters()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            if grads:
                flat = torch.cat([g.reshape(-1).float() for g in grads])
                dist.all_reduce(flat, group=self.dense_group)
                off = 0
                for p, g in zip(params, grads):
                    n = g.numel()
                    p.grad = flat[off : off + n].view_as(g).to(g.dtype)
                    off += n
        self._keep = None

    # --------------------------------------------------------------- outputs
    def take_routed(self) -> np.ndarray:
        """int64 ``[T, L, k]``: the ids every MoE layer dispatched since the last call (while
        ``recording``), forward passes concatenated in order; clears the record."""
        if not any(self._seen) or any(len(s) != len(self._seen[0]) for s in self._seen):
            raise RoutepackError(
                "take_routed: nothing recorded (set recording = True before the forward passes)"
                if not any(self._seen)
                else "take_routed: MoE layers ran unequal times"
            )
        per_layer = [torch.cat(s) for s in self._seen]
        self._seen = [[] for _ in self.layers]
        return torch.stack(per_layer, dim=1).numpy().astype(np.int64)

    @torch.no_grad()
    def gather_experts(self) -> List[tuple]:
        """Every layer's logical experts in transformers' layout, from whichever rank holds
        each (collective over the EP group; every rank gets them): a list over MoE layers of
        ``(gate_up_proj [E, 2I, H], down_proj [E, H, I])`` on the CPU, the weights' dtype."""
        out = []
        ep = self.topo.ep
        for mod in self.layers:
            w1 = [torch.empty_like(mod.w1) for _ in range(ep)]
            w2 = [torch.empty_like(mod.w2) for _ in range(ep)]
            dist.all_gather(w1, mod.w1.detach().contiguous(), group=self.group)
            dist.all_gather(w2, mod.w2.detach().contiguous(), group=self.group)
            all1, all2 = torch.cat(w1).cpu(), torch.cat(w2).cpu()
            slot = [int(np.flatnonzero(mod.phy2log == e)[0]) for e in range(mod.num_experts)]
            gu = torch.stack([all1[s].transpose(0, 1) for s in slot]).contiguous()
            dn = torch.stack([all2[s].transpose(0, 1) for s in slot]).contiguous()
            out.append((gu, dn))
        return out


def _same_model_everywhere(model: Any, group: Any, device: Any) -> None:
    """Raises on every rank unless every rank of ``group`` holds the same parameters, bit for bit."""
    h = 0
    for p in model.parameters():
        h = (h * 1000003 + checksum(p.detach().contiguous().reshape(-1).view(torch.uint8))) & ((1 << 63) - 1)
    got = gather_ints([h], group, device)
    if np.unique(got[:, 0]).size != 1:
        raise RoutepackError(
            "model: the ranks of the group hold different weights (load the same checkpoint or "
            "seed on every rank before shard)"
        )


def shard(
    model: Any,
    plan: Any,
    group: Optional[Any] = None,
    *,
    topo: Topology,
    dense_group: Optional[Any] = None,
    edp_group: Optional[Any] = None,
    dp_rank: Optional[int] = None,
    check_same: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
) -> ShardedMoE:
    """Makes ``model``'s MoE blocks run expert-parallel on this rank (collective over ``group``).

    Args:
        model: a transformers MoE model of a family in `SHARDABLE` (see the module doc), the
            same weights on every rank (checked with ``check_same``: a checksum of every
            parameter, all-gathered).
        plan: the first window's `routepack.Plan` (or a `routepack.Placement`): its placement,
            int32 ``[L, ep*slots_per_rank]``, is loaded directly from the model's experts
            (migration rows, if any, are not applied).
        group: the EP process group (None: the default group); its size is ``topo.ep``.
        topo: the `routepack.Topology` the plans are for.
        dense_group: ranks that sum the dense parameters' gradients (`ShardedMoE.finish_step`;
            None: the default group, every DP rank).
        edp_group, dp_rank, timeout: as `routepack.torch.PlanRunner` (``edp_group`` needed
            when ``topo.dp > topo.ep``).

    Returns a `ShardedMoE`. The blocks' experts modules are replaced by `EPExperts`; their
    ``gate_up_proj`` / ``down_proj`` are dropped. Build the optimizer afterwards, from
    ``model.parameters()``. Raises `RoutepackError` for a layout it cannot carry, a plan
    for another model or topology, or ranks holding different weights."""
    if not isinstance(topo, Topology):
        raise RoutepackTypeError(f"topo: expected routepack.Topology, got {type(topo).__name__}")
    placement = _placement(plan)
    blocks = moe_blocks(model)
    e = int(blocks[0].router.num_experts)
    if placement.num_layers != len(blocks) or placement.num_experts != e:
        raise RoutepackError(
            f"plan: placement has L={placement.num_layers}, E={placement.num_experts}; the model "
            f"has {len(blocks)} MoE layers of E={e}"
        )
    if placement.slots_per_rank != topo.slots_per_rank or placement.num_slots != topo.num_slots:
        raise RoutepackError(
            f"plan: placement has {placement.num_slots} slots ({placement.slots_per_rank} per rank), "
            f"topo {topo.num_slots} ({topo.slots_per_rank} per rank)"
        )
    device = blocks[0].experts.gate_up_proj.device
    if check_same:
        _same_model_everywhere(model, group, device)
    layers: List[EPMoE] = []
    for l, b in enumerate(blocks):
        gu, dn = b.experts.gate_up_proj, b.experts.down_proj
        mod = EPMoE(
            l,
            e,
            int(gu.shape[2]),
            int(gu.shape[1]) // 2,
            topo,
            placement.phy2log[l],
            group,
            dtype=gu.dtype,
            device=device,
        )
        # routepack's layout: x @ w1 with w1 [H, 2I], i.e. transformers' F.linear(x, gate_up) transposed
        mod.load_logical(gu.detach().transpose(1, 2), dn.detach().transpose(1, 2))
        layers.append(mod)
    runner = PlanRunner(layers, topo, group, edp_group=edp_group, dp_rank=dp_rank, timeout=timeout)
    sharded = ShardedMoE(model, blocks, layers, runner, topo, group, dense_group)
    for b, mod in zip(blocks, layers):
        b.block.experts = EPExperts(mod, sharded)
    # keep no reference to the old experts modules: their E experts' weights go with them
    sharded.blocks = [b._replace(experts=b.block.experts) for b in blocks]
    return sharded


__all__ = ["EPExperts", "MoEBlock", "SHARDABLE", "ShardedMoE", "moe_blocks", "shard"]
