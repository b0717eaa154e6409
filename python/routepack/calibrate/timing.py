"""What every measurement shares: the lazy torch import, the timer, and the facts about the
machine the report records.

The timer runs ``warmup`` untimed calls, then up to ``repeats`` timed ones and takes the
median (robust to the odd descheduled run on a shared machine). A call that is slow on its
own stops early, after ``min_repeats``, once ``budget_s`` has been spent on the point, so
the large end of a sweep does not dominate the run. On CUDA every timed region is closed by
``torch.cuda.synchronize()``: kernels are launched asynchronously and the clock must stop
when they finish, not when they are queued.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

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


def median_time(fn: Callable[[], Tuple[float, ...]], warmup: int, repeats: int, min_repeats: int = 3,
                budget_s: float = 2.0) -> Tuple[float, ...]:
    """Median over timed calls of each figure ``fn`` returns (``fn`` times itself, so it can
    time its parts, e.g. forward and forward + backward)."""
    for _ in range(warmup):
        fn()
    runs: List[Tuple[float, ...]] = []
    spent = 0.0
    while len(runs) < max(1, repeats):
        t0 = time.perf_counter()
        runs.append(tuple(fn()))
        spent += time.perf_counter() - t0
        if len(runs) >= min(min_repeats, repeats) and spent > budget_s:
            break
    return tuple(statistics.median(col) for col in zip(*runs))


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
