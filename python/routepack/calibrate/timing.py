"""What every measurement shares: the lazy torch import, the timer, and the facts about the
machine the report records.

The timer (`run_rounds`) measures a whole sweep in rounds: ``warmup`` untimed rounds, then
``repeats`` timed ones, each visiting every point once in a fresh random order; a point's
figure is its median over the timed rounds. Interleaving spreads a spell of interference
(another job on a shared machine) over all points instead of biasing the few measured
during it, and it runs every point with cold caches, as training does (other layers run
between two calls of one layer's kernel). On CUDA every timed region is closed by
``torch.cuda.synchronize()``: kernels are launched asynchronously and the clock must stop
when they finish, not when they are queued.

On CPU with one torch thread the clock is the process's CPU time (`clock`), not the wall
clock: on a shared machine the measuring process is descheduled for other work at random,
which the wall clock counts and CPU time does not (on an idle machine the two agree; with
more threads, or on CUDA, the wall clock is the only honest one).

On CPU, `steady_heap` keeps freed memory in the process's heap while measuring. glibc hands
blocks above 32 MB back to the kernel on free, so every backward pass would page-fault its
fresh weight gradients in again (the page faults, not the GEMMs, then set the time of small
points: 8 experts of the tiny profile with 2 tokens each took 0.19 s that way, 0.09 s with
the heap kept). A GPU's caching allocator reuses its blocks, and so does training on CPU
with jemalloc/tcmalloc, which PyTorch recommends for CPU work.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

TORCH_HINT = "routepack.calibrate needs PyTorch >= 2.1: pip install 'routepack[torch]'"


def require_torch() -> Any:
    """The ``torch`` module, or an ImportError that says how to get it."""
    try:
        import torch
        import torch.distributed  # noqa: F401  (the links measurement needs it)
    except ImportError as e:
        raise ImportError(TORCH_HINT) from e
    return torch


def synchronizer(device: Any) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    torch = require_torch()
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def clock(device: Any) -> Tuple[str, Callable[[], float]]:
    """The clock the kernels are timed with, and its name for the report."""
    torch = require_torch()
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return "process_time", time.process_time
    return "wall", time.perf_counter


# glibc's mallopt parameters and their defaults (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


@contextlib.contextmanager
def steady_heap(device: Any) -> Iterator[bool]:
    """While inside, large blocks come from and go back to the heap (glibc on Linux, CPU
    only); yields whether it applied. The defaults are set back on exit (memory the heap
    grew by stays with the process until it is reused)."""
    libc = None
    if sys.platform.startswith("linux") and str(device).startswith("cpu"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
                libc = None
        except (OSError, AttributeError):  # not glibc
            libc = None
    try:
        yield libc is not None
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)


def run_rounds(steps: Sequence[Callable[[], Tuple[float, ...]]], warmup: int, repeats: int,
               tick: Callable[[], None] = lambda: None, seed: int = 0) -> List[Tuple[float, ...]]:
    """Per step, the median over ``repeats`` timed rounds of each figure it returns (a step
    times itself, so it can time its parts, e.g. forward and forward + backward). ``tick``
    is called after every timed call (the progress bar)."""
    rng = random.Random(seed)
    runs: List[List[Tuple[float, ...]]] = [[] for _ in steps]
    for r in range(warmup + repeats):
        order = list(range(len(steps)))
        rng.shuffle(order)
        for i in order:
            got = tuple(steps[i]())
            if r >= warmup:
                runs[i].append(got)
                tick()
    return [tuple(statistics.median(col) for col in zip(*per)) for per in runs]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: Any, dtype: Any) -> Dict[str, Any]:
    """The machine and library facts a reader needs to judge the figures."""
    torch = require_torch()
    dev = torch.device(device)
    info: Dict[str, Any] = {
        "device": dev.type,
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        info.update(gpu=torch.cuda.get_device_name(idx), gpu_count=torch.cuda.device_count(),
                    cuda=torch.version.cuda, capability=".".join(map(str, torch.cuda.get_device_capability(idx))))
    return info
