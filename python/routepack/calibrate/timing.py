"""What every measurement shares: the lazy torch import, the timer, and the facts about the
machine the report records.

The timer (`run_rounds`) measures a whole sweep in rounds: ``warmup`` untimed rounds, then
``repeats`` timed ones, each visiting every point once in a fresh random order. A visit
calls the point ``calls`` times back to back (as many as fill ``visit_s`` seconds, at most
``visit_calls``, from the warm-up's time of the point; one without a warm-up) and keeps the
median of its calls; a point's figure is the *least* of its visits' medians over the timed
rounds (`AGGREGATE`). On a shared machine interference only ever adds time (another job
evicts the caches or takes the memory bandwidth the kernel needs), so the quietest visit is
the reproducible figure: on this 2-core machine at load 2-3, two runs of the small expert
points (one expert, 1-64 tokens, 9 rounds of 3 calls) differed by up to 21-25% as medians and
16% as the least visit median. The median inside a visit drops a single outlier call either
way. Interleaving spreads a spell of interference (and a drift of the load) over all points
instead of biasing the few measured during it, and it runs every point with cold caches, as
training does (other layers run between two calls of one layer's kernel). Each point's
``spread`` (the median visit over the least, minus 1) and the 1-minute load average over
the rounds go into the report, so a reader sees how loaded the machine was. On CUDA every
timed region is closed by ``torch.cuda.synchronize()``: kernels are launched asynchronously
and the clock must stop when they finish, not when they are queued.

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
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

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


#: How `run_rounds` turns a point's timed calls into its figure (the report's ``settings``).
AGGREGATE = "least over the timed rounds of each visit's median call"


@dataclass
class Rounds:
    """What `run_rounds` measured, one entry per step: ``figures`` (the step's figures from
    its quietest visit, see `AGGREGATE`), ``spread`` (the median visit's first figure over
    the quietest's, minus 1: how much the load moved the point), ``calls`` (calls per
    visit); ``loadavg``: the least and the largest 1-minute load average seen over the
    rounds (None where the platform has none)."""

    figures: List[Tuple[float, ...]]
    spread: List[float]
    calls: List[int]
    loadavg: Optional[Tuple[float, float]]


def load_averages() -> Optional[List[float]]:
    """The 1-, 5- and 15-minute load averages (None where the platform has none)."""
    try:
        return [float(v) for v in os.getloadavg()]
    except (OSError, AttributeError):  # not on this platform
        return None


def _load() -> Optional[float]:
    got = load_averages()
    return None if got is None else got[0]


def _calls(seconds: float, visit_s: float, visit_calls: int) -> int:
    """Calls that fill ``visit_s`` at ``seconds`` a call: 1 to ``visit_calls``."""
    if seconds <= 0 or not math.isfinite(seconds):
        return visit_calls
    return max(1, min(visit_calls, math.ceil(visit_s / seconds)))


def run_rounds(steps: Sequence[Callable[[], Tuple[float, ...]]], warmup: int, repeats: int,
               tick: Callable[[], None] = lambda: None, seed: int = 0, visit_s: float = 0.0,
               visit_calls: int = 1) -> Rounds:
    """Times every step in ``warmup`` untimed and ``repeats`` timed rounds, each visiting the
    steps in a fresh random order (see the module's docstring). A step times itself and
    returns its figures, the first being the one the visits are ranked by (e.g. forward +
    backward, then forward alone); a visit's figures are the medians of its calls' figures.
    ``visit_s`` / ``visit_calls``: a visit calls a step as many times as fill ``visit_s``
    seconds at the step's last warm-up time, at most ``visit_calls`` (once without a
    warm-up). ``tick`` is called after every timed visit (the progress bar)."""
    rng = random.Random(seed)
    visits: List[List[Tuple[float, ...]]] = [[] for _ in steps]
    calls = [1] * len(steps)
    loads: List[float] = []
    for r in range(warmup + repeats):
        order = list(range(len(steps)))
        rng.shuffle(order)
        for i in order:
            if r < warmup:
                calls[i] = _calls(float(steps[i]()[0]), visit_s, visit_calls)
                continue
            got = [tuple(steps[i]()) for _ in range(calls[i])]
            visits[i].append(tuple(statistics.median(col) for col in zip(*got)))
            tick()
        load = _load()
        if load is not None:
            loads.append(load)
    figures, spread = [], []
    for per in visits:
        best = min(per, key=lambda v: v[0])
        figures.append(best)
        mid = statistics.median(v[0] for v in per)
        spread.append(mid / best[0] - 1.0 if best[0] > 0 else 0.0)
    return Rounds(figures, spread, calls, (min(loads), max(loads)) if loads else None)


def timed(rounds: Rounds) -> Dict[str, Any]:
    """A kernel measurement's timing entries from `run_rounds` of steps returning (forward +
    backward, forward) seconds: ``measured_s`` and ``forward_s`` (float ``[points]``),
    ``spread`` (float ``[points]``), ``calls_per_visit`` (int ``[points]``) and ``loadavg``
    ([least, largest] 1-minute load average, or None)."""
    return {"measured_s": [float(f[0]) for f in rounds.figures], "forward_s": [float(f[1]) for f in rounds.figures],
            "spread": list(map(float, rounds.spread)), "calls_per_visit": list(rounds.calls),
            "loadavg": None if rounds.loadavg is None else list(rounds.loadavg)}


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
