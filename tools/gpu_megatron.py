#!/usr/bin/env python
"""GPU check of routepack.integrations.megatron: Megatron-Core's own MoE layer (all-to-all
dispatcher, SequentialMLP experts) under a routepack plan computes the logical model.

    torchrun --nproc_per_node=2 tools/gpu_megatron.py      # >= 2 GPUs, NCCL, one rank per GPU
    python tools/gpu_megatron.py --dry-run --world 2        # the CPU part only (no Megatron, no GPU)

What runs (W ranks, every one an EP rank, ``Topology(dp=W, ep=W, gpus_per_node=W,
slots_per_rank=ceil(E/W) + 1)``, so the plan has redundant copies):

1. Every rank builds the same case (seeded): E logical experts' weights, each rank's tokens
   and their replayed logical top-k, the window of those routes and its plan
   (``routepack_no_replication``: placement and packing, no intra-batch replicas).
2. A Megatron ``MoELayer`` with ``num_moe_experts = W * slots_per_rank`` (the plan's slots)
   and the alltoall dispatcher; ``weight{i}`` of rank r's ``local_experts[i]`` loaded from
   logical expert ``local_experts(plan)[0, r, i]``; ``layer.router`` = `PlanRouter` around a
   logical ``TopKRouter`` (E experts) replaying the recorded top-k via ``RouterReplay``.
3. Checks, per rank: the layer's output equals the dense logical reference (same gate
   probabilities, expert e's weights) within ``TOL``; the rows this rank's experts compute
   equal routepack's prediction (``route_tokens(...).received``); the logical experts'
   weight gradients (the sum over their copies, all-reduced) equal the reference's.

``--dry-run`` runs step 1 and the slot routing of step 3 on CPU with numpy in place of the
layer (what the tests import: `build_case`, `slot_weights`, `dense_reference`,
`dry_run`). Exit status 0 iff every check passed; one line per figure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import List

import numpy as np

import routepack as rp
from routepack.integrations import megatron as rm

TOL = 1e-4
EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 8, 2, 16, 32, 24


@dataclass
class Case:
    """One check's inputs, identical on every rank (built from ``seed``)."""

    topo: rp.Topology
    plan: rp.Plan
    fc1: np.ndarray  # float32 [E, FFN, HIDDEN]: logical experts' linear_fc1.weight
    fc2: np.ndarray  # float32 [E, HIDDEN, FFN]: linear_fc2.weight
    gate: np.ndarray  # float32 [E, HIDDEN]: the logical router's weight
    x: List[np.ndarray]  # per rank float32 [TOKENS, HIDDEN]
    topk: List[np.ndarray]  # per rank int64 [TOKENS, k]: replayed logical ids

    @property
    def origin(self) -> np.ndarray:
        """int64 [W, E]: every rank's (token, k) counts per logical expert."""
        return np.stack([np.bincount(t.reshape(-1), minlength=EXPERTS) for t in self.topk]).astype(np.int64)


def build_case(world: int, seed: int = 0) -> Case:
    """The case for ``world`` EP ranks; a hot expert makes the plan copy it."""
    rng = np.random.default_rng(seed)
    spr = math.ceil(EXPERTS / world) + 1
    topo = rp.Topology(dp=world, ep=world, gpus_per_node=world, slots_per_rank=spr)
    popularity = np.array([6.0] + [1.0] * (EXPERTS - 1))
    popularity /= popularity.sum()
    topk = [
        np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=popularity) for _ in range(TOKENS)]).astype(np.int64)
        for _ in range(world)
    ]
    # the window: each rank's tokens as two samples (routing replay of the batch the layer runs)
    routed = np.concatenate(topk)[:, None, :]
    cu = np.arange(0, world * TOKENS + 1, TOKENS // 2)
    window = rp.Window.from_routed_experts(routed, cu, EXPERTS)
    model = rp.ModelShape(
        num_layers=1,
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden=HIDDEN,
        expert_ffn=FFN,
        attention=["full"],
        expert_groups=1,
    )
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    plan = rp.plan_window(window, topo, cost, token_cap=TOKENS, policy="routepack_no_replication", seed=seed)
    plan.validate(window, topo, TOKENS)
    scale = lambda *shape: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    return Case(
        topo,
        plan,
        scale(EXPERTS, FFN, HIDDEN),
        scale(EXPERTS, HIDDEN, FFN),
        scale(EXPERTS, HIDDEN),
        [scale(TOKENS, HIDDEN) for _ in range(world)],
        topk,
    )


def slot_weights(case: Case, rank: int) -> List[tuple]:
    """(fc1, fc2) of each local expert ``weight{i}`` of EP rank ``rank``: its logical
    expert's (zeros for an empty slot, which receives no token)."""
    out = []
    for e in rm.local_experts(case.plan)[0, rank]:
        if e < 0:
            out.append((np.zeros_like(case.fc1[0]), np.zeros_like(case.fc2[0])))
        else:
            out.append((case.fc1[e], case.fc2[e]))
    return out


def gelu(v: np.ndarray) -> np.ndarray:
    from math import erf

    return v * 0.5 * (1.0 + np.vectorize(erf)(v / math.sqrt(2.0)))


def dense_reference(x: np.ndarray, topk: np.ndarray, probs: np.ndarray, fc1: np.ndarray, fc2: np.ndarray) -> np.ndarray:
    """float64 [T, HIDDEN]: sum_j probs[t, j] * fc2[e] @ gelu(fc1[e] @ x[t]), e = topk[t, j]
    (Megatron's MLP with gelu and no bias)."""
    out = np.zeros((x.shape[0], fc2.shape[1]))
    for t in range(x.shape[0]):
        for j, e in enumerate(topk[t]):
            out[t] += probs[t, j] * (fc2[e].astype(np.float64) @ gelu(fc1[e].astype(np.float64) @ x[t]))
    return out


def dry_run(world: int, seed: int = 0) -> float:
    """The CPU part: every rank's pairs routed to slots (`slot_topk`), each computed with its
    slot's weights, against the dense logical reference. Returns the largest error."""
    case = build_case(world, seed)
    worst = 0.0
    for r in range(world):
        slots = rm.slot_topk(case.topk[r], case.origin, case.plan.placement.phy2log[0], case.topo, r)
        probs = np.full(case.topk[r].shape, 1.0 / TOP_K)
        want = dense_reference(case.x[r], case.topk[r], probs, case.fc1, case.fc2)
        spr = case.topo.slots_per_rank
        weights = [slot_weights(case, q) for q in range(world)]
        got = np.zeros_like(want)
        for t in range(TOKENS):
            for j, p in enumerate(slots[t]):
                w1, w2 = weights[p // spr][p % spr]
                got[t] += probs[t, j] * (w2.astype(np.float64) @ gelu(w1.astype(np.float64) @ case.x[r][t]))
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def gpu_main(seed: int) -> int:  # pragma: no cover - needs >= 2 GPUs and Megatron-Core
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from routepack.torch import route_tokens
    from routepack.plan import REPLICA_DTYPE

    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if world < 2:
        print("gpu_megatron: needs >= 2 ranks (torchrun --nproc_per_node=2)")
        return 2
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    case = build_case(world, seed)
    dev = torch.device("cuda")
    common = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=TOP_K,
        add_bias_linear=False,
        bf16=False,
        params_dtype=torch.float32,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
    )
    phys_cfg = TransformerConfig(
        num_moe_experts=rm.num_moe_experts(case.plan), moe_token_dispatcher_type="alltoall", **common
    )
    logical_cfg = TransformerConfig(num_moe_experts=EXPERTS, moe_enable_routing_replay=True, **common)
    layer = MoELayer(
        phys_cfg, get_moe_module_spec(use_te=False, num_experts=phys_cfg.num_moe_experts).submodules, pg_collection=pgs
    ).to(dev)
    logical = TopKRouter(config=logical_cfg, pg_collection=pgs).to(dev)
    with torch.no_grad():
        logical.weight.copy_(torch.from_numpy(case.gate))
        for expert, (w1, w2) in zip(layer.experts.local_experts, slot_weights(case, rank)):
            expert.linear_fc1.weight.copy_(torch.from_numpy(w1))
            expert.linear_fc2.weight.copy_(torch.from_numpy(w2))
    layer.router = rm.plan_router(logical, case.plan, 0, case.topo, pgs.ep)
    rows = []
    layer.experts.register_forward_pre_hook(lambda mod, args: rows.append(int(args[1].sum())))

    replay = torch.from_numpy(case.topk[rank]).to(dev)
    RouterReplay.set_replay_data([replay])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    x = torch.from_numpy(case.x[rank]).to(dev).view(TOKENS, 1, HIDDEN).requires_grad_()
    out, _ = layer(x)
    probs_logical, map_logical = logical.routing(x.detach().view(TOKENS, 1, HIDDEN) @ logical.weight.detach().T)
    RouterReplay.clear_global_router_replay_action()
    probs = probs_logical.view(TOKENS, EXPERTS).gather(1, replay).detach().cpu().numpy()
    want = dense_reference(case.x[rank], case.topk[rank], probs, case.fc1, case.fc2)
    err = float(np.abs(out.detach().view(TOKENS, HIDDEN).cpu().numpy() - want).max())

    routes = [
        route_tokens(
            case.topk[r], case.origin, case.plan.placement.phy2log[0], case.topo, np.zeros(0, dtype=REPLICA_DTYPE), r
        )
        for r in range(world)
    ]
    received = int(routes[0].received[rank])

    # gradients: the logical experts' (sum over their copies) against the reference's
    out.sum().backward()
    spr = case.topo.slots_per_rank
    g1 = torch.zeros((EXPERTS, FFN, HIDDEN), device=dev, dtype=torch.float64)
    for i, expert in enumerate(layer.experts.local_experts):
        e = int(rm.local_experts(case.plan)[0, rank, i])
        if e >= 0 and expert.linear_fc1.weight.grad is not None:
            g1[e] += expert.linear_fc1.weight.grad.double()
    dist.all_reduce(g1)
    ref_w1 = torch.from_numpy(case.fc1).double().requires_grad_()
    ref_w2 = torch.from_numpy(case.fc2).double()
    xs = torch.from_numpy(case.x[rank]).double()
    pr = torch.from_numpy(probs).double()
    ids = torch.from_numpy(case.topk[rank])
    h = torch.nn.functional.gelu(torch.einsum("tkfh,th->tkf", ref_w1[ids], xs))
    ref = torch.einsum("tk,tkhf,tkf->th", pr, ref_w2[ids], h)
    ref.sum().backward()
    ref_g1 = ref_w1.grad.to(dev)
    dist.all_reduce(ref_g1)
    gerr = float((g1 - ref_g1).abs().max())
    ok = err < TOL and rows == [received] and gerr < TOL * 10
    print(
        f"rank {rank}: output max error {err:.2e}, rows {rows} predicted {received}, fc1 grad max error {gerr:.2e}, "
        f"slots {spr} per rank, {'ok' if ok else 'FAILED'}"
    )
    flag = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if int(flag.item()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only: the plan's slot routing against the reference")
    ap.add_argument("--world", type=int, default=2, help="EP ranks of --dry-run")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.dry_run:
        err = dry_run(a.world, a.seed)
        print(f"dry run, {a.world} EP ranks: max error {err:.2e} ({'ok' if err < TOL else 'FAILED'})")
        return 0 if err < TOL else 1
    return gpu_main(a.seed)


if __name__ == "__main__":
    sys.exit(main())
