"""Executes a sequence of windows' plans for real on one rank (`run_plan`, run in every spawned
process): `routepack.torch.EPMoE` layers starting from Megatron's static placement, driven by
a `PlanRunner` (migration with the Adam state at each window's start, replica copies and
their gradients, redundant experts' gradient sums), forward and backward of each of this
rank's microbatches with the window's recorded routing, between barriers; the plans take
turns step by step, so that a change of the machine's load falls on all of them.

Each microbatch is timed twice: by the rank's CPU time (``time.process_time``: user + system
time of all its threads, gloo's included) and by the wall clock. On a machine shared with
other work (this project's CPU runners, where a dozen processes share two cores) the wall
clock measures the other processes; the CPU time is what the rank itself spent, which is the
wall time it would take with a core to itself, minus its waits for the other rank. The
cost model prices the slowest rank (max over ranks), and the caller takes the max of the
ranks' CPU times, the same figure when the slowest rank is the same in every layer of the
microbatch (it is the rank that waits least). On CUDA the figure is the wall clock after a
device synchronisation (the CPU time would miss the kernels).

With ``profile`` each microbatch is also cut into its parts (`routepack.torch.profile`: route,
gather, all-to-all, replica fill, expert kernels, combine, replica gradients, slot gradients,
the redundant experts' sum), on the same clock, in the same timed steps.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any, Dict, List, Sequence

import numpy as np


def _layers(work: Any, placement: Any, weights: Any, device: Any) -> List[Any]:
    from routepack.torch.moe import EPMoE

    topo = work.topology()
    layers = [
        EPMoE(l, work.experts, work.hidden, work.ffn, topo, placement.phy2log[l], device=device)
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


def spread(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Median absolute deviation over ``axis`` divided by the median (0 where the median is 0):
    how much a figure moves from one timed step to the next, robust to one slow step."""
    med = np.median(values, axis=axis)
    mad = np.median(np.abs(values - np.expand_dims(med, axis)), axis=axis)
    return np.where(med > 0, mad / np.where(med > 0, med, 1.0), 0.0)


def run_plan(
    rank: int,
    world: int,
    device: Any,
    work: Any,
    plans: Dict[str, Sequence[Any]],
    windows: Sequence[Any],
    warmup: int,
    repeats: int,
    profile: bool = True,
) -> Dict[str, Any]:
    """``{"policies": …, "pinned": …}``. ``plans``: policy → its plan of each window;
    ``windows``: (Window, routed, cu_seqlens) of each. ``policies``: policy → a list, per window,
    of {"micro_s": the median CPU seconds over the timed steps of each microbatch on this rank
    (forward + backward of every MoE layer, replica weights posted at its start), "wall_s":
    the median by the wall clock, "finish_s": the median CPU seconds of ``finish_step``,
    "migration_s": the CPU seconds of the window's migration (`routepack.torch.migrate`, once,
    in ``begin_window``), "opening_s": of the rest of ``begin_window`` (the plan's checks and
    the ranks' agreement),
    "routes_s": of computing the window's routes from the replayed microbatches
    (`PlanRunner.set_microbatches`, once: the layers' forward then routes nothing),
    "drift": each timed round's factor, "steps_s": every timed step's CPU seconds per
    microbatch ``[repeats][M]`` as measured, "micro_spread": each microbatch's `spread`, and
    with ``profile`` "parts": per microbatch, part → median seconds, and "parts_spread"}. A
    round runs one step of every plan; its factor (the machine's drift, common to all their
    microbatches) is divided out before the median, as the calibration divides it out of its
    rounds (`routepack.calibrate.timing.AGGREGATE`), so the prediction and the run are figures
    of the same, median, machine. ``pinned``: the core this rank was pinned to (`_pin`)."""
    import torch
    import torch.distributed as dist

    from routepack.calibrate.timing import polish, steady_heap
    from routepack.torch.profile import PARTS, profiling
    from routepack.torch.replay import rank_microbatches
    from routepack.torch.runner import PlanRunner
    from routepack.plan import Placement

    cuda = torch.device(device).type == "cuda"
    pinned = _pin(rank, world) if not cuda else None
    # on a GPU the wall clock between synchronised barriers (the CPU time would miss the kernels)
    now = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(work.seed)
    L, E, H, I = work.layers, work.experts, work.hidden, work.ffn
    weights = ((torch.randn(L, E, H, 2 * I, generator=g) / H**0.5), (torch.randn(L, E, I, H, generator=g) / I**0.5))
    static = Placement.static(L, E, work.topology())
    setups = {}
    for name in plans:
        layers = _layers(work, static, weights, device)
        opt = torch.optim.Adam([p for mod in layers for p in mod.parameters()], lr=1e-6)
        runner = PlanRunner(layers, work.topology(), timeout=datetime.timedelta(seconds=300))
        setups[name] = (layers, opt, runner)

    def inputs(w: int, mbs: List[Any]) -> List[Any]:
        gm = torch.Generator().manual_seed(work.seed * 1000 + 100 * w + rank)
        data = []
        for mb in mbs:
            t = int(mb.routed.shape[0])
            data.append(
                (
                    torch.randn(t, H, generator=gm).to(device),
                    torch.randn(t, H, generator=gm).to(device),
                    torch.softmax(torch.randn(t, L, work.top_k, generator=gm), dim=-1).to(device),
                    mb.routed.long().to(device),
                )
            )
        return data

    def step(name: str, data: List[Any]) -> Any:
        """One training step: (per microbatch (CPU, wall) seconds, parts, finish seconds)."""
        layers, opt, runner = setups[name]
        times, parts = [], []
        for m, (x, cot, gates, ids) in enumerate(data):
            sync()
            dist.barrier()
            t0, c0 = time.perf_counter(), now()
            with profiling(device) if profile else contextlib.nullcontext() as prof:
                runner.start_micro(m)
                h = x
                for l, mod in enumerate(layers):
                    h = h + mod(h, ids[:, l], gates[:, l])
                (h * cot).sum().backward()
                sync()
                got = prof.take() if prof is not None else {}
                segs = prof.segments() if prof is not None else []
            c1 = now()
            dist.barrier()
            times.append((c1 - c0, time.perf_counter() - t0))
            if segs:  # the profile's own entry and exit in the last segment: they add to c1 - c0
                segs[-1] += (c1 - c0) - sum(segs)
            parts.append((got, segs))
        dist.barrier()
        c0 = now()
        runner.finish_step()
        sync()
        fin = now() - c0
        dist.barrier()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return times, parts, fin

    names = list(plans)
    out: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    # freed blocks stay in the heap, as under a GPU's caching allocator and as the calibration
    # measured the kernels (`calibrate.timing.steady_heap`): no page faults on fresh gradients
    with steady_heap(device):
        for w in range(len(windows)):
            data, migration, opening, routes, units = {}, {}, {}, {}, {}
            for name in names:
                plan = plans[name][w]
                layers, opt, runner = setups[name]
                window, routed, cu = windows[w]
                mbs = rank_microbatches(plan, routed, rank, cu, dp=work.ranks)
                sync()
                dist.barrier()
                # the migration itself (`routepack.torch.migrate`, the region the runner marks)
                # apart from the window's checks and agreement
                with profiling(device) as prof:
                    runner.begin_window(plan, window, opt)
                    sync()
                    start = prof.take()
                migration[name] = start.get("migration", 0.0)
                opening[name] = sum(start.values()) - migration[name]
                dist.barrier()
                # the replayed ids known for the window: every route computed once, here
                c0 = now()
                runner.set_microbatches(mbs)
                routes[name] = now() - c0
                units[name] = runner.unit_tokens()  # tokens per compute unit of every (micro, layer) cell
                data[name] = inputs(w, mbs)
            # the plans take turns, step by step, in alternating order: a change in the machine's
            # load (other processes come and go) then falls on every plan alike
            got: Dict[str, List[Any]] = {name: [] for name in names}
            for rep in range(warmup + repeats):
                for name in names if rep % 2 == 0 else names[::-1]:
                    res = step(name, data[name])
                    if rep >= warmup:
                        got[name].append(res)
            # each round's common factor (the machine's drift, every plan's microbatches alike) is
            # divided out, as the calibration does (`calibrate.timing.polish`)
            cpu = {name: np.array([[t for t, _ in r[0]] for r in runs]) for name, runs in got.items()}  # [R, M]
            drift = polish(np.concatenate(list(cpu.values()), axis=1)[:, :, None]).drift
            for name, runs in got.items():
                wall = np.array([[v for _, v in r[0]] for r in runs])
                rec: Dict[str, Any] = {
                    "micro_s": np.median(cpu[name] / drift[:, None], axis=0).tolist(),
                    "micro_spread": spread(cpu[name] / drift[:, None]).tolist(),
                    "wall_s": np.median(wall, axis=0).tolist(),
                    "finish_s": float(np.median(np.array([r[2] for r in runs]) / drift)),
                    "migration_s": float(migration[name]),
                    "opening_s": float(opening[name]),
                    "routes_s": float(routes[name]),
                    "drift": drift.tolist(),
                    "steps_s": cpu[name].tolist(),
                    "unit_tokens": units[name],
                }
                if profile:
                    # [R, M, parts], the round's drift divided out like the microbatches'
                    table = np.array([[[mp[p] for p in PARTS] for mp, _ in r[1]] for r in runs]) / drift[:, None, None]
                    # [R][M][segments between the group's collectives], drift divided out too
                    rec["segments"] = [[(np.array(seg) / d).tolist() for _, seg in r[1]] for r, d in zip(runs, drift)]
                    med, spr = np.median(table, axis=0), spread(table)
                    rec["parts"] = [dict(zip(PARTS, map(float, row))) for row in med]
                    rec["parts_spread"] = [dict(zip(PARTS, map(float, row))) for row in spr]
                out[name].append(rec)
    return {"policies": out, "pinned": pinned}
