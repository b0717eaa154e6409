"""Replication timing: what a replica's weight copy and gradient return cost the two ranks at
its ends, as `routepack.torch`'s replica exchange runs them between local processes (gloo on
CPU, NCCL on CUDA), over a sweep of copies per rank.

Why: the cost model priced replication by its bytes over the link alone, and on the measured
run's CPU ranks (`routepack.measure`, docs/measure_series.md) a plan's replicas cost every rank
about 3× that: the exchange posts each copy's weights into a buffer, relays them down the
chain, and receives, adds in fp32 and forwards the copy's gradient.

Each of two ranks holds ``max(sweeps.replication_copies)`` experts (one per slot) of one MoE
layer in `routepack.torch.EPMoE`'s layout. At a point of ``copies`` = n, the plan copies rank
0's first n experts to rank 1 and rank 1's first n to rank 0 (share 1/2: each copy computes
half its expert's tokens), so each rank sends and receives n copies' weights and n
gradients. Every rank routes ``tokens`` tokens, each to ``top_k`` of the layer's experts,
through the replayed routes (`PlanRunner.set_microbatches`), forward and backward. A point's
figure is the median over its timed steps of the slowest rank's replica parts
(`routepack.torch.profile`: ``replica_fill`` + ``replica_grads``), with the bytes each rank
staged, on the profile's clock (a CPU rank's CPU time, gloo's threads included; the wall
clock between synchronisations on CUDA). ``routepack.calibrate.fit.replication.fit_replication`` fits the per-byte cost
beyond the link's time (``c_replica``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from routepack.calibrate.links import spawn
from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import require_torch, steady_heap, synchronizer
from routepack.model import ModelShape, Topology

#: tokens each rank routes at every point: enough that every copy computes some
TOKENS = 256


def _rank_main(
    rank: int,
    world: int,
    device: Any,
    shape: Dict[str, int],
    copies: Sequence[int],
    warmup: int,
    repeats: int,
    dtype: str,
    clock: str,
) -> Dict[str, Any]:
    """Runs on every spawned rank; returns the sweep and the figures (the same on every rank)."""
    torch = require_torch()
    import datetime

    import torch.distributed as dist

    from routepack.plan import REPLICA_DTYPE, Placement, Plan
    from routepack.torch.profile import profiling
    from routepack.torch.replay import rank_microbatches
    from routepack.torch.runner import PlanRunner
    from routepack.torch.moe import EPMoE
    from routepack.window import Window

    H, I, K = shape["hidden"], shape["expert_ffn"], min(shape["top_k"], 2)
    spr = max(copies)
    experts = world * spr
    topo = Topology(world, world, world, spr, replica_slots=spr)
    sync = synchronizer(device)
    base = np.arange(experts, dtype=np.int32)
    tdtype = getattr(torch, dtype)
    layer = EPMoE(0, experts, H, I, topo, base, dtype=tdtype, device=device)
    gen = torch.Generator().manual_seed(77 + rank)
    with torch.no_grad():
        layer.w1.copy_(torch.randn(layer.w1.shape, generator=gen) * H**-0.5)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=gen) * I**-0.5)
    ids = torch.rand(TOKENS, experts, generator=gen).topk(K, dim=1).indices
    every: List[Any] = [None] * world
    dist.all_gather_object(every, ids.numpy().astype(np.int32))
    routed = np.concatenate(every)[:, None, :]
    cu = np.concatenate([[0], np.cumsum([len(a) for a in every])]).astype(np.int64)
    window = Window.from_routed_experts(routed, cu, experts)
    placement = Placement(base[None, :], experts, spr)
    timeout = datetime.timedelta(seconds=300)

    def plan(n: int) -> Plan:
        rows = np.zeros(2 * n, dtype=REPLICA_DTYPE)
        for i in range(n):
            # rank 0's expert i to rank 1, rank 1's expert spr + i to rank 0
            rows[2 * i] = (0, 0, 0, i, 0, 1, 0.5)
            rows[2 * i + 1] = (0, 0, 0, spr + i, 1, 0, 0.5)
        return Plan(placement, np.arange(world, dtype=np.int32), np.zeros(world, dtype=np.int32), 1, replicas=rows)

    runners = []
    for n in copies:
        runner = PlanRunner([layer], topo, timeout=timeout)
        runner.begin_window(plan(n), window, optimizer_state="none")
        runner.set_microbatches(rank_microbatches(runner.plan, routed, rank, cu, dp=world))
        runners.append(runner)
    x0 = torch.randn(TOKENS, H, generator=gen).to(device, tdtype)
    gates = torch.softmax(torch.randn(TOKENS, K, generator=gen), dim=-1).to(device, tdtype)
    cot = torch.randn(TOKENS, H, generator=gen).to(device, tdtype)
    ids = ids.to(device)
    times: List[List[float]] = [[] for _ in copies]
    with steady_heap(device):
        for r in range(warmup + repeats):
            for i, runner in enumerate(runners):
                layer.runner = runner
                x = x0.detach().requires_grad_()
                sync()
                dist.barrier()
                with profiling(device) as prof:
                    runner.start_micro(0)
                    ((x + layer(x, ids, gates)) * cot).sum().backward()
                    sync()
                    parts = prof.take()
                runner.finish_step(reduce_edp=False)
                layer.w1.grad = layer.w2.grad = None
                if r >= warmup:
                    times[i].append(parts.get("replica_fill", 0.0) + parts.get("replica_grads", 0.0))
    flat = torch.tensor([t for ts in times for t in ts], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    per_point = flat.numpy().reshape(len(copies), repeats)
    weight = sum(t.numel() * t.element_size() for t in (layer.w1[0], layer.w2[0]))
    grad = sum(t.numel() * 4 for t in (layer.w1[0], layer.w2[0]))  # returned in fp32
    return {
        "sweep": [
            {
                "copies": int(n),
                # each rank sends n copies' weights and n gradients, and receives as many
                "staged_bytes": float(2 * n * (weight + grad)),
                "link_bytes": float(n * (weight + grad)),
            }
            for n in copies
        ],
        "measured_s": np.median(per_point, axis=1).tolist(),
        "weight_bytes_per_expert": int(weight),
        "grad_bytes_per_expert": int(grad),
    }


def measure(
    model: ModelShape,
    sweeps: Sweeps,
    device: str,
    dtype: Any,
    ranks: int = 2,
    timeout_s: float = 600,
    clock: str = "wall",
) -> Dict[str, Any]:
    """Spawns two local processes (``ranks`` is read for the report only: the sweep is
    between a pair) and times the replica exchange at every ``sweeps.replication_copies``
    (see the module's docstring) on ``clock``. Returns ``{"skipped": why}`` where it cannot
    run (CUDA with fewer GPUs than ranks)."""
    shape = {k: int(getattr(model, k)) for k in ("hidden", "expert_ffn", "top_k")}
    name = str(dtype).replace("torch.", "")
    got = spawn(
        _rank_main,
        device,
        2,
        clock,
        timeout_s,
        shape,
        list(sweeps.replication_copies),
        sweeps.warmup + 1,
        sweeps.repeats,
        name,
    )
    return got if "skipped" in got else {**got, "dtype": name}
