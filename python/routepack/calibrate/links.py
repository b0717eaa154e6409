"""Link timing: point-to-point and all-to-all between local processes (gloo on CPU, NCCL on
CUDA), over a sweep of message sizes.

The ranks are spawned the way the project's self-checks spawn them
(`routepack.torch.spawn.run_ranks`: ``spawn`` start method, a file store, one
thread per rank, stragglers killed). Local processes share one node, so what is measured is
the intra-node link (``bw_intra``); ``bw_inter`` cannot be measured here.

* ``p2p``: rank 0 sends ``bytes`` to rank 1, which sends them back; half the round trip is
  the one-way time (the other ranks wait at the barrier).
* ``all_to_all``: every rank sends ``bytes`` in all, split evenly over the other ranks
  (``all_to_all_single`` with equal splits; the rank's own chunk stays), as an exchange's
  dispatch does; the cost model prices this as ``max(sent, received) / bw_intra``.
* ``all_reduce``: every rank sums a buffer of ``bytes`` over the ranks (``all_reduce``), as
  the glue sums redundant experts' gradients once a step; the cost model prices it as a
  ring's ``2·(ranks−1)/ranks·bytes / bw_reduce``.

Every rank runs the same number of timed calls (a collective must be entered by all), each
between a barrier and a device synchronisation, on the wall clock (waiting for the other
rank is part of a link's time); a call's time is the slowest rank's (all-reduced max), the
median over calls is kept. ``clock="cpu"`` (CPU only) times each call by the process's CPU
time instead (gloo's threads and the kernel's TCP work included, waiting not): what
`routepack.measure` judges its run by, so its links are calibrated on the same clock (on this
machine a gloo all-to-all's CPU time is about half its wall time at a few MB).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Sequence

from routepack.calibrate.sweeps import Sweeps
from routepack.errors import RoutepackError
from routepack.calibrate.timing import require_torch, synchronizer


def _timed(
    fn: Any, sync: Any, dist: Any, torch: Any, device: Any, warmup: int, repeats: int, now: Any = time.perf_counter
) -> float:
    times: List[float] = []
    for k in range(warmup + repeats):
        dist.barrier()
        sync()
        t0 = now()
        fn()
        sync()
        if k >= warmup:
            times.append(now() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(statistics.median(slowest.cpu().tolist()))


def _rank_main(
    rank: int, world: int, device: Any, sizes: Sequence[int], warmup: int, repeats: int, clock: str = "wall"
) -> Dict[str, Any]:
    """Runs on every spawned rank; returns the sweep and the times (the same on every rank)."""
    torch = require_torch()
    import torch.distributed as dist

    sync = synchronizer(device)
    now = time.process_time if clock == "cpu" else time.perf_counter
    sweep: List[Dict[str, Any]] = []
    measured: List[float] = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)

        def pingpong() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        sweep.append({"op": "p2p", "bytes": buf.numel() * 4})
        measured.append(0.5 * _timed(pingpong, sync, dist, torch, device, warmup, repeats, now))
    for nbytes in sizes:
        chunk = max(1, nbytes // 4 // (world - 1))
        send = torch.zeros(chunk * world, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        sweep.append({"op": "all_to_all", "bytes": chunk * 4 * (world - 1)})
        measured.append(
            _timed(lambda: dist.all_to_all_single(recv, send), sync, dist, torch, device, warmup, repeats, now)
        )
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        sweep.append({"op": "all_reduce", "bytes": buf.numel() * 4})
        measured.append(_timed(lambda: dist.all_reduce(buf), sync, dist, torch, device, warmup, repeats, now))
    return {"sweep": sweep, "measured_s": measured}


def check_clock(clock: object, device: str) -> str:
    """``clock`` as `measure` takes it: "wall", or "cpu" on a CPU device (a GPU's kernels run
    outside the process's CPU time); anything else is a `RoutepackError` naming it."""
    if clock not in ("wall", "cpu") or (clock == "cpu" and device == "cuda"):
        raise RoutepackError(f"links_clock: expected 'wall' (or 'cpu' on a CPU device), got {clock!r} on {device}")
    return str(clock)


def spawn(fn: Any, device: str, ranks: int, clock: str, timeout_s: float, *args: Any) -> Dict[str, Any]:
    """Runs ``fn(rank, world, device, *args, clock)`` on ``ranks`` spawned local processes
    (gloo on CPU, NCCL on CUDA: one GPU per rank) and returns rank 0's result with
    ``ranks``, ``backend`` and ``clock`` added, or ``{"skipped": why}`` where it cannot run
    (CUDA with fewer GPUs than ranks). The links and the exchange measure this way."""
    torch = require_torch()
    clock = check_clock(clock, device)
    if device == "cuda":
        if torch.cuda.device_count() < ranks:
            return {
                "skipped": f"NCCL needs one GPU per rank: {ranks} ranks, {torch.cuda.device_count()} GPU(s) visible"
            }
        backend = "nccl"
    else:
        backend = "gloo"
    from routepack.torch.spawn import run_ranks

    out = run_ranks(
        fn, ranks, *args, clock, backend=backend, join_timeout_s=timeout_s, pg_timeout_s=min(timeout_s, 300)
    )
    return {**out[0], "ranks": ranks, "backend": backend, "clock": clock}


def measure(sweeps: Sweeps, device: str, ranks: int = 2, timeout_s: float = 600, clock: str = "wall") -> Dict[str, Any]:
    """Spawns ``ranks`` local processes and times both ops at every ``sweeps.message_bytes``
    on ``clock`` ("wall", or "cpu": the process's CPU time, CPU devices only). Returns
    ``{"skipped": why}`` where it cannot run (CUDA with fewer GPUs than ranks)."""
    # more calls than a compute point: small messages are cheap and their times scatter most
    return spawn(
        _rank_main, device, ranks, clock, timeout_s, list(sweeps.message_bytes), sweeps.warmup, 3 * sweeps.repeats
    )
