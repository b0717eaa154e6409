"""Migration timing: what moving experts between EP ranks costs, with their Adam state, as
`routepack.torch.migrate` moves them between local processes (gloo on CPU, NCCL on CUDA),
over a sweep of experts moved.

Why: the cost model priced a window's migration by its bytes over the link alone, and on the
measured run's CPU ranks (`routepack.measure`) migrations cost 2–5 ms an expert where it
priced under 1: `migrate` packs each slot with its optimizer state, checksums it on both
sides, backs up the slot it overwrites and unpacks it, and agrees with the other ranks in
rounds whatever it moves.

Each of two ranks holds ``max(sweeps.migration_moves)`` experts (one per slot) of one MoE
layer in `routepack.torch.EPMoE`'s layout, with Adam's two moments, and at every point the
first ``moves`` slots of ranks 0 and 1 swap their experts and swap them back (both timed:
each rank sends and receives ``moves`` experts each time), round-robin over the points, on
``clock``. A point's figure is the median over its timed migrations of the slowest rank's
`migrate` call, with the bytes each rank sent and received from its `MigrationReport`.
``routepack.calibrate.fit.migration.fit_migration`` fits the fixed cost of a migration and
the per-byte cost beyond the link's time.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import numpy as np

from routepack.calibrate.links import spawn
from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import require_torch, steady_heap, synchronizer
from routepack.model import ModelShape, Topology


def _rank_main(
    rank: int,
    world: int,
    device: Any,
    shape: Dict[str, int],
    moves: Sequence[int],
    warmup: int,
    repeats: int,
    dtype: str,
    clock: str,
) -> Dict[str, Any]:
    """Runs on every spawned rank; returns the sweep and the figures (the same on every rank)."""
    torch = require_torch()
    import datetime

    import torch.distributed as dist

    from routepack import _core
    from routepack.plan import MIGRATION_DTYPE, MIGRATION_FIELDS, Placement, Plan
    from routepack.torch.migrate import migrate
    from routepack.torch.moe import EPMoE

    H, I = shape["hidden"], shape["expert_ffn"]
    spr = max(moves)
    experts = world * spr
    topo = Topology(world, world, world, spr)
    sync = synchronizer(device)
    now = time.process_time if clock == "cpu" else time.perf_counter
    base = np.arange(experts, dtype=np.int32)
    layer = EPMoE(0, experts, H, I, topo, base, dtype=getattr(torch, dtype), device=device)
    gen = torch.Generator().manual_seed(99 + rank)
    with torch.no_grad():
        layer.w1.copy_(torch.randn(layer.w1.shape, generator=gen) * H**-0.5)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=gen) * I**-0.5)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-6)
    layer.w1.grad, layer.w2.grad = torch.ones_like(layer.w1), torch.ones_like(layer.w2)
    opt.step()  # Adam's moments exist: they move with their experts
    opt.zero_grad(set_to_none=True)
    timeout = datetime.timedelta(seconds=300)

    def plan(before: np.ndarray, after: np.ndarray) -> Plan:
        cols = _core.migration_diff(before[None, :], after[None, :], experts, spr, 1.0)
        rows = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
        for name, col in zip(MIGRATION_FIELDS, cols):
            rows[name] = col
        layout = np.arange(world, dtype=np.int32)
        return Plan(Placement(after[None, :], experts, spr), layout, np.zeros(world, np.int32), 1, migration=rows)

    pairs = []
    for k in moves:
        swapped = base.copy()
        swapped[:k], swapped[spr : spr + k] = base[spr : spr + k], base[:k]
        pairs.append((plan(base, swapped), plan(swapped, base)))
    times: List[List[float]] = [[] for _ in moves]
    staged = np.zeros(len(moves))
    link = np.zeros(len(moves))
    # freed blocks stay in the heap, as `routepack.measure`'s run keeps them (and a GPU's
    # caching allocator does): the staging buffers' pages are not faulted in anew each time
    with steady_heap(device):
        for r in range(warmup + repeats):
            for i, there_and_back in enumerate(pairs):
                for p in there_and_back:
                    sync()
                    dist.barrier()
                    t0 = now()
                    report = migrate([layer], p, opt, timeout=timeout)
                    sync()
                    spent = now() - t0
                    if r >= warmup:
                        times[i].append(spent)
                        staged[i] = report.sent_bytes + report.received_bytes
                        link[i] = max(report.sent_bytes, report.received_bytes)
    # the slowest rank of every timed migration, then each point's median
    flat = torch.tensor([t for ts in times for t in ts] + staged.tolist() + link.tolist(), dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    got = flat.numpy()
    n = repeats * 2
    per_point = got[: n * len(moves)].reshape(len(moves), n)
    staged, link = got[n * len(moves) : n * len(moves) + len(moves)], got[n * len(moves) + len(moves) :]
    state = sum(t.numel() * t.element_size() for t in (layer.w1[0], layer.w2[0]))
    return {
        "sweep": [
            {"moves": int(k), "staged_bytes": float(s), "link_bytes": float(b)} for k, s, b in zip(moves, staged, link)
        ],
        "measured_s": np.median(per_point, axis=1).tolist(),
        "weight_bytes_per_expert": int(state),
        "state_bytes_per_expert": float(link[0] / moves[0]) if moves[0] else 0.0,
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
    """Spawns ``ranks`` local processes and times `routepack.torch.migrate` at every
    ``sweeps.migration_moves`` (see the module's docstring) on ``clock``. Returns
    ``{"skipped": why}`` where it cannot run (CUDA with fewer GPUs than ranks)."""
    shape = {k: int(getattr(model, k)) for k in ("hidden", "expert_ffn")}
    name = str(dtype).replace("torch.", "")
    got = spawn(
        _rank_main,
        device,
        ranks,
        clock,
        timeout_s,
        shape,
        list(sweeps.migration_moves),
        sweeps.warmup,
        sweeps.repeats,
        name,
    )
    return got if "skipped" in got else {**got, "dtype": name}
