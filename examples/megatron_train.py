"""Train a small Megatron-Core GPT model under routepack plans and check it trains like the stock one.

Every rank builds the same GPT model twice (local layer spec, 8 experts top-2, the all-to-all
dispatcher, Megatron's DDP and Adam): once as Megatron builds it (static placement), once
through ``rm.plan_layer_spec``. Both train the same windows on the same data: each window
routepack plans the replayed routes (``routepack.plan_window``), and the planned model carries
the plan out (the runner migrates experts with their optimizer state, redundant copies of hot
experts share their gradient, replicas take a share of hot experts' tokens per microbatch).
The losses and the final logical weights of the two must agree. The change to the training
loop is::

    spec = rm.plan_layer_spec(get_gpt_layer_local_spec(num_experts=E), topo, replica_slots=2)
    runner = rm.MegatronRunner(ddp_model, topo)
    runner.begin_window(plan, window, optimizer)                 # each window
    forward_backward_func(..., data_iterator=runner.microbatches(data_iterator))
    runner.finish_step(); optimizer.step()

Needs megatron-core (``pip install ".[megatron]"``) and CUDA GPUs: one process per GPU, NCCL.
Megatron-Core 0.16 allocates on the current CUDA device, so without one the example stops and
says so (the project's tests run it on CPU with gloo, Megatron's CUDA-only calls stood in).

    python examples/megatron_train.py                 # 2 GPUs, expert parallel 2, 3 windows
    python examples/megatron_train.py --ranks 4 --windows 5
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass

import numpy as np

#: Model and run sizes: E experts top-k, GPT sizes, samples a window, tokens a microbatch.
LAYERS, EXPERTS, TOP_K, HIDDEN, FFN, VOCAB = 2, 8, 2, 16, 8, 64
SLOTS_PER_RANK, REPLICA_SLOTS, SAMPLES, TOKEN_CAP = 5, 2, 16, 64


@dataclass(frozen=True)
class Run:
    ranks: int  # data-parallel ranks (one process each)
    ep: int  # expert-parallel group size
    windows: int
    seed: int = 0


def topology(run: Run):
    import routepack as rp

    return rp.Topology(dp=run.ranks, ep=run.ep, gpus_per_node=run.ranks, slots_per_rank=SLOTS_PER_RANK)


def synthetic_window(run: Run, w: int):
    """Window ``w``: (Window, routed ids int32 ``[T, L, k]``, cu_seqlens ``[S+1]``): samples of
    4-24 tokens, each layer's experts drawn from a skewed popularity that drifts between
    windows (so placements change). A trainer has these from routing replay (R3)."""
    import routepack as rp

    rng = np.random.default_rng([run.seed, 7, w])
    cu = np.concatenate([[0], np.cumsum(rng.integers(4, 24, size=SAMPLES))]).astype(np.int64)
    routed = np.zeros((int(cu[-1]), LAYERS, TOP_K), dtype=np.int32)
    for layer in range(LAYERS):
        pop = rng.dirichlet(np.full(EXPERTS, 0.2))
        for t in range(routed.shape[0]):
            routed[t, layer] = rng.choice(EXPERTS, size=TOP_K, replace=False, p=pop)
    return rp.Window.from_routed_experts(routed, cu, EXPERTS), routed, cu


def build(run: Run, planned: bool, device):
    """(DDP model, optimizer): the GPT model, every parameter from the seed and its logical name."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from routepack.integrations import megatron as rm

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS,  # stays the logical count under a plan
        moe_router_topk=TOP_K,
        moe_token_dispatcher_type="alltoall",
        moe_ffn_hidden_size=FFN,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        expert_model_parallel_size=run.ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS)
    if planned:
        spec = rm.plan_layer_spec(spec, topology(run), replica_slots=REPLICA_SLOTS)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=512)
    init_weights(model, run.seed)
    model.to(device)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False, grad_reduce_in_fp32=True),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, params_dtype=torch.float32), [ddp]
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, opt


def _value(name: str, shape: tuple, seed: int):
    import torch

    if name.endswith("layer_norm_weight") or name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=g) * 0.1


def init_weights(model, seed: int) -> None:
    """Both models start from the same logical weights: a dense parameter from its own name, an
    expert's from ``...experts.local_experts.{e}...`` with e the logical expert its slot holds
    (routepack's layer: ``slot_experts()``, -1 for an empty slot or a replica buffer, filled
    from expert 0; Megatron's: ``local_expert_indices``)."""
    import torch

    moe = {n: m for n, m in model.named_modules() if any(c.__name__ == "MoELayer" for c in type(m).__mro__)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = next((k for k in moe if name.startswith(k + ".experts.local_experts.")), None)
            if owner is not None:
                layer = moe[owner]
                slot, tail = name[len(owner) + len(".experts.local_experts.") :].split(".", 1)
                held = layer.slot_experts() if hasattr(layer, "slot_experts") else layer.local_expert_indices
                name = f"{owner}.experts.local_experts.{max(int(held[int(slot)]), 0)}.{tail}"
            p.copy_(_value(name, tuple(p.shape), seed))


def _tokens(run: Run, w: int, sample: int, n: int):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{run.seed}:{w}:{sample}".encode()))
    return torch.randint(0, VOCAB, (n,), generator=g)


def forward_step_func(run: Run, w: int, cu: np.ndarray, model, device):
    """Megatron's ``forward_step_func``: each microbatch's samples as one sequence, every router
    replaying the microbatch's recorded top-k (``RouterReplay``, REPLAY_FORWARD)."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)  # a routepack.torch Microbatch: its samples and routed ids [T, L, k]
        ids = torch.cat([_tokens(run, w, int(s), int(cu[s + 1] - cu[s])) for s in mb.samples]).to(device)
        for r in routers:  # every layer is an MoE layer; layer_number is 1-based
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(mb.routed[:, r.layer_number - 1].to(torch.int64).to(device))
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        t = ids.numel()
        pos = torch.arange(t, device=device).unsqueeze(0)
        mask = torch.triu(torch.ones(t, t, device=device), diagonal=1).bool()[None, None]
        out = model(ids.unsqueeze(0), pos, mask, labels=torch.roll(ids, -1).unsqueeze(0))

        def loss_func(output):
            loss = output.float().sum()
            return loss, torch.tensor(t, dtype=torch.int, device=device), {"loss": (loss.detach() / t).item()}

        return out, loss_func

    return forward_step


def train(run: Run, planned: bool, rank: int, device) -> dict:
    """This rank's losses per window and microbatch, final logical weights (`export_weights`)
    and what the plans moved and copied."""
    import routepack as rp
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from routepack.integrations import megatron as rm
    from routepack.plan import Placement, Plan
    from routepack.torch import rank_microbatches

    topo = topology(run)
    shape = rp.ModelShape(
        num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, expert_ffn=FFN, attention=["full"] * LAYERS
    )
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    ddp, opt = build(run, planned, device)
    runner = rm.MegatronRunner(ddp, topo) if planned else None
    previous = Placement.static(LAYERS, EXPERTS, topo)
    out = {"losses": [], "migrated": 0, "replicated": 0}
    for w in range(run.windows):
        window, routed, cu = synthetic_window(run, w)
        plan = rp.plan_window(window, topo, cost, TOKEN_CAP, previous=previous, seed=w, replication_slots=REPLICA_SLOTS)
        plan.validate(window, topo, TOKEN_CAP)
        previous = plan.placement
        if not planned:  # the same microbatches under Megatron's own placement
            plan = Plan(Placement.static(LAYERS, EXPERTS, topo), plan.sample_rank, plan.sample_micro, plan.num_micro)
        micro = rank_microbatches(plan, routed, rank, cu, dp=run.ranks)
        data = iter(micro)
        if runner is not None:
            runner.begin_window(plan, window, opt)  # migrates experts with main_grad and optimizer state
            data = runner.microbatches(data)
            out["migrated"] += int(plan.migration.size)
            out["replicated"] += int(plan.replicas.size)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step_func(run, w, cu, ddp, device),
            data_iterator=data,
            model=[ddp],
            num_microbatches=len(micro),
            seq_length=0,
            micro_batch_size=1,
            forward_only=False,
        )
        if runner is not None:
            runner.finish_step()  # raises if the step did not run the plan
        opt.step()
        out["losses"].append([o["loss"] for o in losses])
    out["weights"] = {k: v.detach().cpu().clone() for k, v in rm.export_weights(ddp)}
    return out


def rank_main(rank: int, world: int, device, run: Run) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=run.ep)
    static, planned = train(run, False, rank, device), train(run, True, rank, device)
    loss = max((abs(a - b) for sa, pa in zip(static["losses"], planned["losses"]) for a, b in zip(sa, pa)), default=0.0)
    weights = max(float((static["weights"][k] - planned["weights"][k]).abs().max()) for k in static["weights"])
    return {
        "loss": loss,
        "weights": weights,
        "static": [float(np.mean(x)) for x in static["losses"]],
        "planned": [float(np.mean(x)) for x in planned["losses"]],
        "migrated": planned["migrated"],
        "replicated": planned["replicated"],
    }


def backend() -> str:
    """NCCL on CUDA GPUs; gloo only where Megatron's CUDA-only calls are stood in (tests)."""
    import torch

    if torch.cuda.is_available():
        return "nccl"
    try:
        torch.cuda.current_device()  # where Megatron-Core allocates its buffers
    except Exception as e:  # noqa: BLE001 (CPU-only torch asserts, a CUDA build without a GPU raises)
        sys.exit(f"megatron_train.py: Megatron-Core needs a CUDA GPU a rank, and none is available ({e})")
    return "gloo"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks, one process (GPU) each (default 2)")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel size, a divisor of --ranks (default 2)")
    ap.add_argument("--windows", type=int, default=3, help="windows (optimizer steps) to train (default 3)")
    args = ap.parse_args()
    try:
        import megatron.core  # noqa: F401
        import torch
    except ImportError as e:
        sys.exit(f'megatron_train.py needs megatron-core and torch: pip install ".[megatron]" ({e})')
    if args.ranks < 1 or args.ep < 1 or args.ranks % args.ep or args.windows < 1:
        sys.exit(f"--ranks {args.ranks}, --ep {args.ep}, --windows {args.windows}: --ep must divide --ranks, all >= 1")
    how = backend()
    if how == "nccl" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks}: this machine has {torch.cuda.device_count()} GPU(s)")
    from routepack.torch.spawn import run_ranks

    run = Run(args.ranks, args.ep, args.windows)
    out = run_ranks(rank_main, args.ranks, run, backend=how, join_timeout_s=900, pg_timeout_s=300)
    for w in range(run.windows):
        s, p = np.mean([out[r]["static"][w] for r in out]), np.mean([out[r]["planned"][w] for r in out])
        print(f"window {w}: loss static placement {s:.6f}, routepack plan {p:.6f}")
    loss, weights = max(out[r]["loss"] for r in out), max(out[r]["weights"] for r in out)
    print(f"largest loss difference against static placement: {loss:.2e}")
    print(f"largest logical-weight difference after {run.windows} windows: {weights:.2e}")
    print(
        f"experts migrated: {out[0]['migrated']}, replica copies: {out[0]['replicated']} (over {run.windows} windows)"
    )
    if loss > 1e-5 or weights > 1e-5:
        sys.exit("the plan changed what the model computes")
    print("the plan's model trains like the stock one: ok")


if __name__ == "__main__":
    main()
