"""A small Megatron-Core GPT model trained under routepack plans and under Megatron's static
placement, on identical data and logical weights (torch, Megatron). The tests' harness, not
part of the package: shared by the tests (CPU, gloo) and ``tools/gpu_megatron.py`` (CUDA),
which puts ``tests/`` on its path to import it (``examples/megatron_train.py`` holds its own
copy of the simple case, so that it runs from the installed package alone).

`MegatronCase` holds the sizes. `train` builds the model (``get_gpt_layer_local_spec``:
local spec, no Transformer Engine; with ``plan=True`` through `plan_layer_spec`), wraps it in
Megatron's ``DistributedDataParallel`` and optimizer (``get_megatron_optimizer``: Adam,
``DistributedOptimizer`` on request), and trains ``windows`` windows of one optimizer step:
each window's plan or the static plan with the same layout (``plans(w, previous)``; by
default `planned`: routepack's planner on `synthetic_window`'s skewed, drifting routes; the
tests pass hand-made plans that migrate, hold redundant experts and replicate in every
window), every microbatch run by Megatron's own ``forward_backward_func`` with the replayed
top-k of its samples (``RouterReplay``, REPLAY_FORWARD). Every parameter starts from the same
seed-derived logical value in both models (`init_weights`). The caller initialises
Megatron's model-parallel state.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import routepack as rp
from routepack.plan import Placement, Plan
from routepack.torch.replay import rank_microbatches


@dataclass(frozen=True)
class MegatronCase:
    """Sizes: ``dp`` ranks, ``ep`` per EP group; ``slots_per_rank`` placement slots and
    ``replica_slots`` replica buffers a rank; E experts, top-k; GPT sizes; ``pp`` pipeline
    stages (each holding ``layers // pp`` layers, all MoE; ``dp`` ranks a stage) of ``vpp``
    model chunks each (vpp > 1: Megatron's interleaved schedule; chunk v of stage s holds
    layers ``(v * pp + s) * n`` onwards, n = ``layers // (pp * vpp)``)."""

    dp: int = 2
    ep: int = 2
    gpus_per_node: int = 2
    slots_per_rank: int = 5
    replica_slots: int = 2
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 16
    ffn: int = 8
    vocab: int = 64
    micro: int = 2
    samples: int = 8
    windows: int = 3
    seed: int = 0
    lr: float = 1e-2
    distributed_optimizer: bool = False
    replicas: bool = True
    token_cap: int = 64
    pp: int = 1
    vpp: int = 1


def synthetic_window(case: MegatronCase, w: int) -> Tuple[rp.Window, np.ndarray, np.ndarray]:
    """Window ``w``: (Window, routed int32 ``[T, L, k]``, cu ``[S+1]``): ``samples`` samples of
    4-24 tokens, each layer's experts drawn from a skewed popularity that drifts between
    windows (so placements change)."""
    rng = np.random.default_rng([case.seed, 7, w])
    lens = rng.integers(4, 24, size=case.samples)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    routed = np.zeros((int(cu[-1]), case.layers, case.top_k), dtype=np.int32)
    for l in range(case.layers):
        pop = rng.dirichlet(np.full(case.experts, 0.2))
        for t in range(routed.shape[0]):
            routed[t, l] = rng.choice(case.experts, size=case.top_k, replace=False, p=pop)
    return rp.Window.from_routed_experts(routed, cu, case.experts), routed, cu


def planned(case: MegatronCase, policy: Any = "routepack") -> Callable[[int, Placement], tuple]:
    """``plans(w, previous)`` → (routepack's plan, the static plan with its layout, window,
    routed, cu): `routepack.plan_window` (``policy``) on `synthetic_window`; both validated."""
    shape = rp.ModelShape(
        num_layers=case.layers,
        num_experts=case.experts,
        top_k=case.top_k,
        hidden=case.hidden,
        expert_ffn=case.ffn,
        attention=["full"] * case.layers,
    )
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    topo = topology(case)

    def plans(w: int, previous: Placement) -> tuple:
        window, routed, cu = synthetic_window(case, w)
        plan = rp.plan_window(
            window,
            topo,
            cost,
            token_cap=case.token_cap,
            previous=previous,
            seed=w,
            policy=policy,
            **({"replication_slots": case.replica_slots} if case.replica_slots else {}),  # what the buffers hold
        )
        plan.validate(window, topo, case.token_cap)
        static = Plan(
            Placement.static(case.layers, case.experts, topo), plan.sample_rank, plan.sample_micro, plan.num_micro
        )
        return plan, static.validate(window, topo, case.token_cap), window, routed, cu

    return plans


def config(case: MegatronCase, **kw: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped]

    base = dict(
        num_layers=case.layers,
        hidden_size=case.hidden,
        num_attention_heads=2,
        ffn_hidden_size=2 * case.hidden,
        num_moe_experts=case.experts,
        moe_router_topk=case.top_k,
        moe_token_dispatcher_type="alltoall",
        moe_ffn_hidden_size=case.ffn,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        expert_model_parallel_size=case.ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    if case.pp > 1:  # microbatches of different lengths cross the stages: shapes are sent first
        base.update(pipeline_model_parallel_size=case.pp, pipeline_dtype=torch.float32, variable_seq_lengths=True)
    if case.vpp > 1:
        base.update(virtual_pipeline_model_parallel_size=case.vpp)
    base.update(kw)
    return TransformerConfig(**base)


def build_model(case: MegatronCase, plan: bool, device: Any = "cpu", **kw: Any) -> Any:
    """The GPT model (no DDP), every parameter from `init_weights`; under vpp > 1 the list of
    this rank's model chunks."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]
    from megatron.core.models.gpt.gpt_model import GPTModel  # type: ignore[import-untyped]

    from routepack.integrations import megatron as rm

    spec = get_gpt_layer_local_spec(num_experts=case.experts)
    if plan:
        spec = rm.plan_layer_spec(spec, topology(case), replica_slots=case.replica_slots)
    cfg = config(case, **kw)
    chunks = []
    for v in range(case.vpp):
        stages: Dict[str, Any] = {}
        if case.pp > 1:  # this rank's stage; untied output layer (tying under PP syncs on CUDA at build)
            from megatron.core import parallel_state  # type: ignore[import-untyped]

            vp = dict(ignore_virtual=False, vp_stage=v) if case.vpp > 1 else {}
            stages = dict(
                pre_process=parallel_state.is_pipeline_first_stage(**vp),
                post_process=parallel_state.is_pipeline_last_stage(**vp),
                share_embeddings_and_output_weights=False,
                **({"vp_stage": v} if case.vpp > 1 else {}),
            )
        model = GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=case.vocab, max_sequence_length=512, **stages
        )
        init_weights(model, case, f"chunk{v}." if case.vpp > 1 else "")
        chunks.append(model.to(device))
    return chunks if case.vpp > 1 else chunks[0]


def topology(case: MegatronCase) -> Any:
    import routepack as rp

    return rp.Topology(case.dp, case.ep, case.gpus_per_node, case.slots_per_rank, pp=case.pp, vpp=case.vpp)


def _value(name: str, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    if name.endswith("layer_norm_weight") or name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    if "norm" in name and name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=g) * 0.1


@torch.no_grad()
def init_weights(model: Any, case: MegatronCase, prefix: str = "") -> None:
    """Every parameter from the seed and ``prefix`` + its logical name: dense ones by their own name,
    experts by ``...experts.local_experts.{e}...`` with e the logical expert a slot holds
    (empty slots and replica buffers from expert 0)."""
    from routepack.integrations.megatron.checkpoint import slot_experts

    experts = {n: m for n, m in model.named_modules() if any(c.__name__ == "MoELayer" for c in type(m).__mro__)}
    for name, p in model.named_parameters():
        owner = next((k for k in experts if name.startswith(k + ".experts.local_experts.")), None)
        if owner is None:
            p.copy_(_value(prefix + name, tuple(p.shape), case.seed))
            continue
        rest = name[len(owner) + len(".experts.local_experts.") :]
        i, tail = rest.split(".", 1)
        e = max(int(slot_experts(experts[owner])[int(i)]), 0)
        logical = f"{owner}.experts.local_experts.{e}.{tail}"
        p.copy_(_value(prefix + logical, tuple(p.shape), case.seed))


def wrap(model: Any, case: MegatronCase) -> tuple:
    """(DDP model, Megatron optimizer): Adam, ``clip_grad=1``, fp32 grads; ``model`` a list of
    chunks: (the list of DDP chunks, one optimizer over them)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # type: ignore[import-untyped]
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # type: ignore[import-untyped]

    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed_optimizer, overlap_grad_reduce=False, grad_reduce_in_fp32=True
    )
    chunks = model if isinstance(model, list) else [model]
    ddps = [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in chunks]
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=case.lr,
        weight_decay=0.01,
        clip_grad=1.0,
        use_distributed_optimizer=case.distributed_optimizer,
        params_dtype=torch.float32,
    )
    opt = get_megatron_optimizer(opt_cfg, ddps)
    for c in chunks:
        c.config.finalize_model_grads_func = finalize_model_grads
        c.config.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
    return (ddps if isinstance(model, list) else ddps[0]), opt


def _tokens(case: MegatronCase, w: int, sample: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.seed}:{w}:{sample}".encode()))
    return torch.randint(0, case.vocab, (n,), generator=g)


def routers(model: Any) -> List[Any]:
    """The model's routers in layer order (the replay entries to feed; a pipeline stage's own)."""
    chunks = model if isinstance(model, list) else [model]
    return [m for c in chunks for m in c.modules() if hasattr(m, "router_replay") and m.router_replay is not None]


def _forward_step(case: MegatronCase, w: int, cu: np.ndarray, rs: List[Any], device: Any) -> Callable:
    """Megatron's ``forward_step_func`` for window ``w``'s microbatches (replayed top-k)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction  # type: ignore[import-untyped]

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        mb = next(data_iterator)
        ids = torch.cat([_tokens(case, w, int(s), int(cu[s + 1] - cu[s])) for s in mb.samples]).to(device)
        t = ids.numel()
        for r in rs:  # every layer is an MoE layer: layer_number (global, 1-based) - 1 is its routed column
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(mb.routed[:, r.layer_number - 1].to(torch.int64).to(device))
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        pos = torch.arange(t, device=device).unsqueeze(0)
        mask = torch.triu(torch.ones(t, t, device=device), diagonal=1).bool()[None, None]
        out = model(ids.unsqueeze(0), pos, mask, labels=torch.roll(ids, -1).unsqueeze(0))

        def loss_func(output: torch.Tensor) -> tuple:
            loss = output.float().sum()
            return loss, torch.tensor(t, dtype=torch.int, device=device), {"loss": (loss.detach() / t).item()}

        return out, loss_func

    return forward_step


def _schedule(case, w, ddp, mbs, cu, runner, device, forward_only: bool) -> List[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]

    it: Any = iter(mbs)
    if isinstance(ddp, list):  # vpp > 1: one iterator a chunk, as given (the runner's hooks read the microbatch)
        it = [iter(mbs) for _ in ddp]
    elif runner is not None:
        it = runner.microbatches(it)
    out = get_forward_backward_func()(
        forward_step_func=_forward_step(case, w, cu, routers(ddp), device),
        data_iterator=it,
        model=ddp if isinstance(ddp, list) else [ddp],
        num_microbatches=len(mbs),
        seq_length=0,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return [o["loss"] for o in out]


def run_step(case: MegatronCase, w: int, ddp: Any, opt: Any, mbs: List[Any], cu: np.ndarray, runner: Any, device: Any):
    """One optimizer step over this rank's microbatches ``mbs`` (Megatron's own
    ``forward_backward_func``); returns this rank's losses per microbatch (sum of token losses
    / tokens) and the step's grad norm."""
    for d in ddp if isinstance(ddp, list) else [ddp]:
        d.zero_grad_buffer()
    opt.zero_grad()
    losses = _schedule(case, w, ddp, mbs, cu, runner, device, False)
    if runner is not None:
        runner.finish_step()
    _, grad_norm, _ = opt.step()
    return losses, float(grad_norm)


def evaluate(case: MegatronCase, w: int, ddp: Any, mbs: List[Any], cu: np.ndarray, runner: Any, device: Any):
    """This rank's losses per microbatch of window ``w``, forward only."""
    with torch.no_grad():
        losses = _schedule(case, w, ddp, mbs, cu, runner, device, True)
    if runner is not None:
        runner.end_micro()
    return losses


def train(
    case: MegatronCase,
    plan: bool,
    rank: int,
    device: Any = "cpu",
    plans: Optional[Callable[[int, Placement], tuple]] = None,
    after_window: Any = None,
    before_step: Any = None,
    groups: Any = None,
) -> Dict[str, Any]:
    """Trains ``case.windows`` windows (module docstring). Returns this rank's ``losses``
    (per window, per microbatch), ``grad_norms``, the final logical ``weights`` (name →
    tensor, `export_weights`), and the plan's totals ``migrated`` (rows) and ``replicated``
    (rows). ``before_step(w, model, opt, runner)`` runs after ``begin_window``,
    ``after_window(w, model, opt, runner)`` after each window's step. ``groups``: the
    runner's `MegatronGroups` (None: Megatron's ``parallel_state``'s)."""
    from routepack.integrations import megatron as rm

    plans = plans or planned(case)
    model = build_model(case, plan, device)
    ddp, opt = wrap(model, case)
    runner = rm.MegatronRunner(ddp, topology(case), groups=groups) if plan else None
    previous = Placement.static(case.layers, case.experts, topology(case))
    out: Dict[str, Any] = {"losses": [], "grad_norms": [], "migrated": 0, "replicated": 0, "migrations": []}
    for w in range(case.windows):
        rebalanced, static, window, routed, cu = plans(w, previous)
        if not case.replicas:
            rebalanced = _without_replicas(rebalanced)
        previous = rebalanced.placement
        use = rebalanced if plan else static
        mbs = rank_microbatches(use, routed, rank, cu, dp=case.dp)
        if runner is not None:
            report = runner.begin_window(use, window, opt)
            out["migrations"].append(None if report is None else report.rows)
            out["migrated"] += int(use.migration.size)
            out["replicated"] += int(use.replicas.size)
        if before_step is not None:
            before_step(w, ddp, opt, runner)
        losses, norm = run_step(case, w, ddp, opt, mbs, cu, runner, device)
        out["losses"].append(losses)
        out["grad_norms"].append(norm)
        if after_window is not None:
            after_window(w, ddp, opt, runner)
    out["weights"] = logical_weights(ddp)
    return out


def own_groups() -> Any:
    """`MegatronGroups` over communicators of their own (``dist.new_group`` with the ranks of
    Megatron's expert-parallel and pipeline groups, every rank creating every group in one
    order): a runner given them runs its collectives there, not on Megatron's globals."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from routepack.integrations import megatron as rm

    default = rm.groups_from_parallel_state()

    def copy(group: Any) -> Any:
        if group is None:
            return None
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dist.get_process_group_ranks(group))
        made = {tuple(r): dist.new_group(list(r)) for r in sorted({tuple(r) for r in everyone})}
        return made[tuple(dist.get_process_group_ranks(group))]

    ep = copy(parallel_state.get_expert_model_parallel_group())
    pp = copy(default.pp)
    return dataclasses.replace(default, ep=ep, pp=pp)


def logical_weights(ddp: Any) -> Dict[str, torch.Tensor]:
    """`export_weights` as host copies; a list of chunks with ``chunk{v}.`` before each name."""
    from routepack.integrations import megatron as rm

    if not isinstance(ddp, list):
        return {k: v.detach().cpu().clone() for k, v in rm.export_weights(ddp)}
    return {f"chunk{i}.{k}": v.detach().cpu().clone() for i, c in enumerate(ddp) for k, v in rm.export_weights(c)}


def _without_replicas(plan: Any) -> Any:
    from routepack.plan import Plan, empty_replicas

    return Plan(plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, empty_replicas(), plan.migration)


def compare(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, float]:
    """Largest absolute differences between two `train` results: losses and weights."""
    la = np.asarray([x for w in a["losses"] for x in w])
    lb = np.asarray([x for w in b["losses"] for x in w])
    keys = set(a["weights"]) | set(b["weights"])
    missing = sorted(keys - (set(a["weights"]) & set(b["weights"])))
    wd = max((float((a["weights"][k] - b["weights"][k]).abs().max()) for k in keys if k not in missing), default=0.0)
    return {
        # a first pipeline stage has no losses (the last stage computes them)
        "loss": float(np.abs(la - lb).max(initial=0.0)) if la.size == lb.size else float("inf"),
        "weights": wd if not missing else float("inf"),
        "missing": len(missing),
        "grad_norm": float(np.abs(np.asarray(a["grad_norms"]) - np.asarray(b["grad_norms"])).max()),
    }


__all__ = [
    "MegatronCase",
    "build_model",
    "planned",
    "synthetic_window",
    "compare",
    "config",
    "init_weights",
    "logical_weights",
    "routers",
    "run_step",
    "train",
    "wrap",
]
