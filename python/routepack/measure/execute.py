"""Executes a plan's MoE layers for real on one rank (`run_plan`, run in every spawned
process): `routepack.torch.EPMoE` layers holding the plan's placement, driven by a
`PlanRunner` (replica copies and their gradients included), forward and backward of each of
this rank's microbatches with the window's recorded routing, between barriers; the plans
take turns step by step, so that a change of the machine's load falls on all of them.

Each microbatch is timed twice: by the rank's CPU time (``time.process_time``: user + system
time of all its threads, gloo's included) and by the wall clock. On a machine shared with
other work (this project's CPU runners, where a dozen processes share two cores) the wall
clock measures the other processes; the CPU time is what the rank itself spent, which is the
wall time it would take with a core to itself, minus its waits for the other rank. The
cost model prices the slowest rank (max over ranks), and the caller takes the max of the
ranks' CPU times, the same figure when the slowest rank is the same in every layer of the
microbatch (it is the rank that waits least). On CUDA the figure is the wall clock after a
device synchronisation (the CPU time would miss the kernels).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List

import numpy as np


def _layers(work: Any, plan: Any, weights: Any, device: Any) -> List[Any]:
    from routepack.torch.moe import EPMoE

    topo = work.topology()
    layers = [
        EPMoE(l, work.experts, work.hidden, work.ffn, topo, plan.placement.phy2log[l], device=device)
        for l in range(work.layers)
    ]
    for l, mod in enumerate(layers):
        mod.load_logical(weights[0][l], weights[1][l])
    return layers


def _pin(rank: int, world: int) -> Any:
    """Pins this rank's process to one core of its own (rank r to the r-th core this process
    may use), where the machine has a core per rank: two ranks the scheduler puts on one core,
    or moves between cores, share or refill its caches, which changed a microbatch's CPU time
    by up to 40% from one run to the next. Returns the core, or None where it did not pin."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return None
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]


def run_plan(
    rank: int,
    world: int,
    device: Any,
    work: Any,
    plans: Dict[str, Any],
    window: Any,
    routed: np.ndarray,
    cu: np.ndarray,
    warmup: int,
    repeats: int,
) -> Dict[str, Any]:
    """``{"policies": …, "pinned": …}``. ``policies``: policy → {"micro_s": the median CPU seconds
    over the timed steps of each microbatch on this rank (forward + backward of every MoE
    layer, replica weights posted at its start), "wall_s": the median by the wall clock,
    "finish_s": the median CPU seconds of ``finish_step`` (replica gradients back to their
    owners), "drift": each timed round's factor, "steps_s": every timed step's CPU seconds per
    microbatch, ``[repeats][M]``, as measured}. A round runs one step of every plan; its
    factor (the machine's drift, common to all their microbatches) is divided out before the
    median, as the calibration divides it out of its rounds
    (`routepack.calibrate.timing.AGGREGATE`), so the prediction and the run are figures of
    the same, median, machine. ``pinned``: the core this rank was pinned to (`_pin`), or
    None."""
    import torch
    import torch.distributed as dist

    from routepack.calibrate.timing import polish, steady_heap
    from routepack.torch.replay import rank_microbatches
    from routepack.torch.runner import PlanRunner

    cuda = torch.device(device).type == "cuda"
    pinned = _pin(rank, world) if not cuda else None
    # on a GPU the wall clock between synchronised barriers (the CPU time would miss the kernels)
    now = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(work.seed)
    L, E, H, I = work.layers, work.experts, work.hidden, work.ffn
    weights = ((torch.randn(L, E, H, 2 * I, generator=g) / H**0.5), (torch.randn(L, E, I, H, generator=g) / I**0.5))
    setups = {}
    for name, plan in plans.items():
        layers = _layers(work, plan, weights, device)
        runner = PlanRunner(layers, work.topology(), timeout=datetime.timedelta(seconds=120))
        gm = torch.Generator().manual_seed(work.seed * 1000 + rank)
        data = []
        for mb in rank_microbatches(plan, routed, rank, cu, dp=work.ranks):
            t = int(mb.routed.shape[0])
            data.append(
                (
                    torch.randn(t, H, generator=gm).to(device),
                    torch.randn(t, H, generator=gm).to(device),
                    torch.softmax(torch.randn(t, L, work.top_k, generator=gm), dim=-1).to(device),
                    mb.routed.long().to(device),
                )
            )
        setups[name] = (plan, layers, runner, data)

    def step(name: str) -> Any:
        """One training step of plan ``name``: (per microbatch (CPU, wall) seconds, finish)."""
        plan, layers, runner, data = setups[name]
        runner.begin_window(plan, window)
        times = []
        for m, (x, cot, gates, ids) in enumerate(data):
            sync()
            dist.barrier()
            t0, c0 = time.perf_counter(), now()
            runner.start_micro(m)
            h = x
            for l, mod in enumerate(layers):
                h = h + mod(h, ids[:, l], gates[:, l])
            (h * cot).sum().backward()
            sync()
            c1 = now()
            dist.barrier()
            times.append((c1 - c0, time.perf_counter() - t0))
        dist.barrier()
        c0 = now()
        runner.finish_step()
        sync()
        fin = now() - c0
        dist.barrier()
        for mod in layers:
            mod.w1.grad = mod.w2.grad = None
        return times, fin

    # the plans take turns, step by step, in alternating order: a change in the machine's load
    # (other processes come and go) then falls on every plan alike, not on the one measured last
    got: Dict[str, List[Any]] = {name: [] for name in plans}
    names = list(plans)
    # freed blocks stay in the heap, as under a GPU's caching allocator and as the calibration
    # measured the kernels (`calibrate.timing.steady_heap`): no page faults on fresh gradients
    with steady_heap(device):
        for rep in range(warmup + repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                res = step(name)
                if rep >= warmup:
                    got[name].append(res)
    # each step pair's common factor (the machine's drift, every plan's microbatches alike) is
    # divided out, as the calibration does (`calibrate.timing.polish`)
    cpu = {name: np.array([[t for t, _ in times] for times, _ in runs]) for name, runs in got.items()}  # [repeats, M]
    drift = polish(np.concatenate(list(cpu.values()), axis=1)[:, :, None]).drift
    out: Dict[str, Any] = {}
    for name, runs in got.items():
        wall = np.array([[w for _, w in times] for times, _ in runs])
        out[name] = {
            "micro_s": np.median(cpu[name] / drift[:, None], axis=0).tolist(),
            "wall_s": np.median(wall, axis=0).tolist(),
            "finish_s": float(np.median(np.array([f for _, f in runs]) / drift)),
            "drift": drift.tolist(),
            "steps_s": cpu[name].tolist(),
        }
    return {"policies": out, "pinned": pinned}
