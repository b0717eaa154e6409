"""What every measurement shares: the lazy torch import, the timer, and the facts about the
machine the report records.

The timer (`run_rounds`) measures a whole sweep in rounds: ``warmup`` untimed rounds, then
``repeats`` timed ones, each visiting every point once in a fresh random order. A visit
calls the point ``calls`` times back to back (as many as fill ``visit_s`` seconds, at most
``visit_calls``, from the warm-up's time of the point; one without a warm-up) and keeps the
median of its calls. The rounds × points table of visit medians is then taken apart by
Tukey's median polish of its logarithms (`polish`): a factor per round (the machine's
``drift``: how fast it ran while that round ran, the median round's factor 1) and a figure
per point, the median over the rounds of its visits with their round's factor divided out
(`AGGREGATE`). On this 2-core machine the kernels' speed drifts by ±20% over seconds to
minutes, all points alike (another tenant takes the memory bandwidth): 60 rounds of 14 small
expert points (one core, idle machine) ran 0.82-1.33× the median round, and the first 30
rounds' figures differed from the last 30's by up to 20% as least visits or medians, by 5.4%
(median 1.4%) with each round's factor divided out. Interleaving makes the drift common to
the points of a round, which is what lets the polish see it. Each point's ``spread`` (its
figure over its quietest corrected visit, minus 1), the round factors and the 1-minute load
average over the rounds go into the report, so a reader sees how much the machine moved. On
CUDA every timed region is closed by ``torch.cuda.synchronize()``: kernels are launched
asynchronously and the clock must stop when they finish, not when they are queued.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from routepack.errors import RoutepackError

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
AGGREGATE = (
    "median over the timed rounds of each visit's median call, with the round's drift "
    "(median polish of log times, rounds x points) divided out"
)


@dataclass
class Polished:
    """What `polish` found in a table of times ``[rounds, points, figures]``: ``figures``
    (float ``[points, figures]``: each point's median over the rounds with its round's factor
    divided out), ``drift`` (float ``[rounds]``: each round's factor, the median round's 1)
    and ``spread`` (float ``[points]``: the figure over the point's quietest corrected round,
    minus 1)."""

    figures: np.ndarray
    drift: np.ndarray
    spread: np.ndarray


#: The fewest points a round must visit for `polish` to read its drift: with two, each point's
#: own noise would be half of the round's factor and land on the other.
DRIFT_POINTS = 3


def polish(times: Any, sweeps: int = 50) -> Polished:
    """Tukey's median polish of ``log(times[:, :, 0])`` (rounds × points; positive seconds,
    the first figure ranks; NaN where a round did not visit a point): log t[r, p] = overall +
    round[r] + point[p] + residual, column (point) and row (round) medians swept out in turn,
    points first, until they stop moving (at most ``sweeps`` times); the round effects are
    centred on their median. Every figure of a visit is divided by its round's factor
    ``exp(round[r])``. A round that visits fewer than `DRIFT_POINTS` points shows no drift
    apart from its points' own noise, so its factor is 1 (as is a lone round's); then a
    point's figure is the plain median of its visits."""
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 3 or t.shape[0] < 1 or t.shape[1] < 1 or t.shape[2] < 1:
        raise RoutepackError(f"times: expected [rounds, points, figures] with none empty, got shape {t.shape}")
    seen = ~np.isnan(t[:, :, 0])
    if not (seen.any(axis=0).all() and seen.any(axis=1).all()):
        raise RoutepackError(
            "times: every round must visit a point and every point be visited "
            f"(rounds without one: {np.flatnonzero(~seen.any(axis=1)).tolist()}, "
            f"points without one: {np.flatnonzero(~seen.any(axis=0)).tolist()})"
        )
    rounds, points = t.shape[:2]
    first = t[:, :, 0][seen]
    rows = np.zeros(rounds)
    est = seen.sum(axis=1) >= DRIFT_POINTS  # the rounds whose drift is read
    if rounds > 1 and est.any() and bool(np.all(first > 0)) and bool(np.all(np.isfinite(first))):
        resid = np.log(np.where(seen, t[:, :, 0], 1.0))
        resid[~seen] = np.nan
        # points first: they differ by orders of magnitude, the rounds by tens of percent, and
        # a round that visits only some points (the short points' extra rounds) would otherwise
        # take their median for its drift
        for _ in range(sweeps):
            c = np.nanmedian(resid, axis=0)
            resid = resid - c[None, :]
            r = np.where(est, np.nanmedian(resid, axis=1), 0.0)
            resid = resid - r[:, None]
            rows += r
            if max(np.abs(r).max(), np.abs(c).max()) < 1e-12:
                break
        rows[est] -= np.median(rows[est])
    drift = np.exp(rows)
    corrected = t / drift[:, None, None]
    figures = np.nanmedian(corrected, axis=0)
    quietest = np.nanmin(corrected[:, :, 0], axis=0)
    spread = np.where(quietest > 0, figures[:, 0] / np.where(quietest > 0, quietest, 1.0) - 1.0, 0.0)
    return Polished(figures, drift, spread)


@dataclass
class Rounds:
    """What `run_rounds` measured, one entry per step: ``figures`` (the step's figures, see
    `AGGREGATE`), ``spread`` (the figure over the step's quietest corrected visit, minus 1:
    how much the visits still moved once the drift was out), ``calls`` (calls per visit);
    ``drift``: each timed round's factor (`polish`); ``loadavg``: the least and the largest
    1-minute load average seen over the rounds (None where the platform has none)."""

    figures: List[Tuple[float, ...]]
    spread: List[float]
    calls: List[int]
    loadavg: Optional[Tuple[float, float]]
    drift: List[float] = field(default_factory=list)


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


def run_rounds(
    steps: Sequence[Callable[[], Tuple[float, ...]]],
    warmup: int,
    repeats: int,
    tick: Callable[[], None] = lambda: None,
    seed: int = 0,
    visit_s: float = 0.0,
    visit_calls: int = 1,
    short_repeats: int = 0,
) -> Rounds:
    """Times every step in ``warmup`` untimed and ``repeats`` timed rounds, each visiting the
    steps in a fresh random order (see the module's docstring). A step times itself and
    returns its figures, the first being the one the round's drift is read from (e.g.
    forward + backward, then forward alone); a visit's figures are the medians of its calls'
    figures, and a step's the median over the rounds once each round's drift is divided out
    (`polish`). ``visit_s`` / ``visit_calls``: a visit calls a step as many times as fill
    ``visit_s`` seconds at the step's last warm-up time, at most ``visit_calls`` (once without
    a warm-up; a step called once whose timed visit comes in under ``visit_s`` is called more
    from its next visit on: the warm-up's call paid a one-off set-up). ``short_repeats`` more
    timed rounds then visit only the short steps, those called more than once a visit: they
    are the noisy ones and cost little, so they get more visits for their median. ``tick`` is
    called after every timed visit (the progress bar)."""
    rng = random.Random(seed)
    calls = [1] * len(steps)
    table: List[List[Tuple[float, ...]]] = []
    loads: List[float] = []
    width = 1
    for r in range(warmup + repeats + short_repeats):
        if r == warmup + repeats and not any(c > 1 for c in calls):
            break  # no short step: no extra round
        order = [i for i in range(len(steps)) if r < warmup + repeats or calls[i] > 1]
        rng.shuffle(order)
        row: List[Tuple[float, ...]] = [()] * len(steps)
        for i in order:
            if r < warmup:
                calls[i] = _calls(float(steps[i]()[0]), visit_s, visit_calls)
                continue
            got = [tuple(steps[i]()) for _ in range(calls[i])]
            row[i] = tuple(statistics.median(col) for col in zip(*got))
            width = len(row[i])
            if calls[i] == 1:
                # a point's first call pays one-off set-up (a BLAS kernel's first use: tiny's 1 × 2
                # tokens took over 0.1 s in the warm-up, 10 ms after), which would leave a short
                # point at one call a visit and out of the short rounds: its timed visits decide
                calls[i] = _calls(float(row[i][0]), visit_s, visit_calls)
            tick()
        if r >= warmup:
            table.append(row)
        load = _load()
        if load is not None:
            loads.append(load)
    if not steps:
        return Rounds([], [], [], (min(loads), max(loads)) if loads else None, [1.0] * len(table))
    done = polish([[v if v else (math.nan,) * width for v in row] for row in table])
    return Rounds(
        [tuple(float(v) for v in f) for f in done.figures],
        [float(v) for v in done.spread],
        calls,
        (min(loads), max(loads)) if loads else None,
        [float(v) for v in done.drift],
    )


def timed(rounds: Rounds) -> Dict[str, Any]:
    """A kernel measurement's timing entries from `run_rounds` of steps returning (forward +
    backward, forward) seconds: ``measured_s`` and ``forward_s`` (float ``[points]``),
    ``spread`` (float ``[points]``), ``calls_per_visit`` (int ``[points]``), ``drift`` (float
    ``[rounds]``: each timed round's factor) and ``loadavg``
    ([least, largest] 1-minute load average, or None)."""
    return {
        "measured_s": [float(f[0]) for f in rounds.figures],
        "forward_s": [float(f[1]) for f in rounds.figures],
        "spread": list(map(float, rounds.spread)),
        "calls_per_visit": list(rounds.calls),
        "drift": list(map(float, rounds.drift)),
        "loadavg": None if rounds.loadavg is None else list(rounds.loadavg),
    }


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
        info.update(
            gpu=torch.cuda.get_device_name(idx),
            gpu_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability(idx))),
        )
    return info
