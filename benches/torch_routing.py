"""Per-layer routing overhead and expert GEMM of `routepack.torch.EPMoE` on this machine (issue 16).

    PYTHONPATH=python python3 benches/torch_routing.py [--repeats 5]

1. routing of one MoE layer on one EP rank, 4k / 8k / 16k tokens x k = 8 on the `tiny`
   topology (ep = 8, E = 128, 17 slots per rank): "in forward" is what `EPMoE.forward` does
   without precomputed routes (ids to the host, per-expert counts, the route and its index
   tensors; the all-gather of counts is left out: one process); "precomputed" is what it
   does with `PlanRunner.begin_window(..., microbatches=)`: compare the ids with the
   replayed ones on the device, no host copy; "per cell at begin_window" is the host work
   moved out of the forward (once per window and cell);
2. the experts of one rank: a Python loop over slots against one `torch._grouped_mm` per
   projection (`routepack.torch.moe.grouped_swiglu`), forward + backward, fp32 on the CPU.
Median wall milliseconds; numbers, not assertions.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import routepack as rp
from routepack.plan import Placement, empty_replicas
from routepack.torch.moe import grouped_swiglu, swiglu
from routepack.torch.remap import _route, expert_counts
from routepack.torch.routes import cell_route


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prof = rp.traces.profile("tiny")
    topo = rp.Topology(prof.ep, prof.ep, prof.gpus_per_node, prof.slots_per_rank)
    row = Placement.static(1, prof.num_experts, topo).phy2log[0]
    rng = np.random.default_rng(0)
    k = prof.top_k
    for t in (4096, 8192, 16384):
        ids = torch.from_numpy(np.argsort(rng.random((t, prof.num_experts)), axis=1)[:, :k].copy())
        origin = np.stack([expert_counts(ids.numpy(), prof.num_experts)] * topo.ep)

        def in_forward():
            h = ids.cpu().numpy().astype(np.int64)
            expert_counts(h, prof.num_experts)
            cell_route(_route(h, origin, row, topo, empty_replicas(), 0), k, topo.slots_per_rank, "cpu")

        def at_begin_window():
            cell_route(
                _route(ids.numpy().astype(np.int64), origin, row, topo, empty_replicas(), 0),
                k,
                topo.slots_per_rank,
                "cpu",
                ids.clone(),
            )

        cell = cell_route(
            _route(ids.numpy().astype(np.int64), origin, row, topo, empty_replicas(), 0),
            k,
            topo.slots_per_rank,
            "cpu",
            ids.clone(),
        )
        flag = [None]

        def precomputed():
            d = (ids != cell.ids).any()
            flag[0] = d if flag[0] is None else flag[0] | d

        print(
            f"routing  T={t:5d} k={k}: in forward {median_ms(in_forward, args.repeats):7.2f} ms per layer, "
            f"precomputed {median_ms(precomputed, args.repeats):6.3f} ms per layer "
            f"(+ {median_ms(at_begin_window, args.repeats):6.2f} ms per cell at begin_window)"
        )

    h_dim, ffn, slots = 256, 128, prof.slots_per_rank
    for n in (2048, 8192):
        x = torch.randn(n, h_dim)
        counts = np.bincount(rng.integers(0, slots, n), minlength=slots)
        w1 = torch.randn(slots, h_dim, 2 * ffn, requires_grad=True)
        w2 = torch.randn(slots, ffn, h_dim, requires_grad=True)

        def loop():
            parts = [swiglu(c, w1[g], w2[g]) for g, c in enumerate(torch.split(x, counts.tolist())) if c.shape[0]]
            torch.cat(parts).sum().backward()

        def grouped():
            grouped_swiglu(x, counts, w1, w2).sum().backward()

        print(
            f"experts  N={n:5d} H={h_dim} I={ffn} slots={slots}: loop {median_ms(loop, args.repeats):7.2f} ms, "
            f"grouped {median_ms(grouped, args.repeats):7.2f} ms (fwd+bwd, fp32 CPU, "
            f"torch._grouped_mm {'present' if hasattr(torch, '_grouped_mm') else 'absent'})"
        )


if __name__ == "__main__":
    main()
