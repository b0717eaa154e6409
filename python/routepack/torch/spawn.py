"""`run_ranks`: runs a function on every rank of a fresh process group of local, spawned
processes (gloo on CPU, NCCL on GPUs), collecting results and tracebacks, never hanging.

`routepack calibrate` (its links and exchange kernels) and `routepack measure` start their
ranks with it; the self-checks of tests/torch and tools/gpu_check.py do too."""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist


def _entry(
    fn: Callable, rank: int, world: int, backend: str, store: str, pg_timeout_s: float, results: Any, args: tuple
) -> None:
    torch.set_num_threads(1)
    try:
        if backend in ("nccl", "nccl_shared"):
            # "nccl_shared": every rank on GPU 0 (NCCL normally refuses; tools/gpu_check.py tries)
            torch.cuda.set_device(0 if backend == "nccl_shared" else rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
            backend = "nccl"
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, "ok", fn(rank, world, device, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable,
    world: int = 4,
    *args: Any,
    backend: str = "gloo",
    join_timeout_s: float = 300,
    pg_timeout_s: float = 60,
    may_die: Sequence[int] = (),
) -> Dict[int, Any]:
    """Runs ``fn(rank, world, device, *args)`` in ``world`` spawned processes (``spawn`` start
    method, file store). Returns rank → result; raises with the tracebacks if a rank failed or
    did not report within ``join_timeout_s`` (stragglers are killed, so nothing hangs).
    Ranks in ``may_die`` may exit without reporting."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="routepack-"), "store")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, backend, store, pg_timeout_s, results, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: Dict[int, Any] = {}
    errors: List[str] = []
    deadline = time.monotonic() + join_timeout_s
    want = world - len(may_die)
    while len(out) + len(errors) < world:
        try:
            r, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                break
            if len(out) + len(errors) >= want and all(not procs[r].is_alive() for r in may_die):
                break
            continue
        if status == "ok":
            out[r] = value
        else:
            errors.append(f"rank {r}:\n{value}")
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stuck:
        procs[r].kill()
    missing = [r for r in range(world) if r not in out and r not in may_die]
    if errors or missing:
        raise RuntimeError(f"ranks {missing} did not finish (stuck: {stuck})\n" + "\n".join(errors))
    return out
