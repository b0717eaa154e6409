"""The runners' step timing and ``runner.metrics()``: the plan's metrics (`routepack.metrics`)
with the step the runner measured.

`StepTimer` times a step from its first ``start_micro`` to ``finish_step``: on a CUDA device with
two CUDA events recorded on the current stream (no host sync during the step: the end event is
waited for once, when the time is read), elsewhere with ``time.perf_counter``. Both runners
(`routepack.torch.PlanRunner`, `routepack.integrations.megatron.MegatronRunner`) own one as
``runner.timer``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch

from routepack.errors import RoutepackError
from routepack.metrics import plan_metrics


class StepTimer:
    """Wall time of one step per rank (see the module docs). ``start`` is idempotent within a
    step (every microbatch calls it; the first one counts); ``stop`` ends the step."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        #: where the step runs (CUDA: timed with events); the runner sets it
        self.device = device if device is not None else torch.device("cpu")
        self._running = False
        self._t0 = 0.0
        self._events: Optional[tuple[Any, Any]] = None
        self._seconds: Optional[float] = None
        #: steps timed so far
        self.steps = 0

    def start(self) -> None:
        if self._running:
            return
        self._running = True
        if self.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, end)
        else:
            self._events = None
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self.steps += 1
        if self._events is not None:
            self._events[1].record()
            self._seconds = None  # read (one wait on the end event) by `seconds`
        else:
            self._seconds = time.perf_counter() - self._t0

    def abandon(self) -> None:
        """Forgets a step abandoned part-way (the runner's ``discard_step``)."""
        self._running = False

    def seconds(self) -> Optional[float]:
        """The last finished step's seconds (None before the first)."""
        if self._seconds is None and self._events is not None and self.steps:
            begin, end = self._events
            end.synchronize()
            self._seconds = begin.elapsed_time(end) / 1e3
        return self._seconds


def runner_metrics(runner: Any, cost: Any = None) -> Dict[str, float]:
    """``runner.metrics(cost)``: `routepack.metrics.plan_metrics` of the window in force, with
    the bytes this rank sent migrating it (``runner.last_migration``), and the last step's
    ``routepack/measured_step_s`` (its `StepTimer`) and ``routepack/measured_over_predicted``.
    Raises before the first window and before the window's first finished step."""
    plan, window = getattr(runner, "plan", None), getattr(runner, "_window", None)
    if plan is None or window is None:
        raise RoutepackError("metrics: call begin_window first")
    measured = runner.timer.seconds() if runner.timer.steps else None
    if measured is None:
        raise RoutepackError("metrics: no step finished yet (call finish_step first)")
    report = runner.last_migration
    sent = float(report.sent_bytes) if report is not None else 0.0
    out = plan_metrics(plan, window, runner.topo, cost, migration_bytes=sent)
    out["routepack/measured_step_s"] = float(measured)
    predicted = out["routepack/predicted_step_s"]
    out["routepack/measured_over_predicted"] = measured / predicted if predicted > 0 else float("nan")
    return out
