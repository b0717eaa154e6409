"""Per-part profile of `EPMoE` layers: the seconds each part of a microbatch takes on this rank,
forward and backward, beside the cost-model term that prices it.

Inside ``with profiling() as prof:`` the layers charge their work to the parts below (`PARTS`);
outside, they do nothing extra (one global lookup per part). Forward work is timed where it
runs. Backward work runs inside autograd's engine (on CPU, in the thread that called
``backward``): the layers put identity nodes (`mark`) between their parts, and each such
node's backward charges the time since the last mark to the part that ran in between, so the
engine's own order attributes it. Work of the layers' autograd nodes (`SlotLink`, the replica
exchange, the redundant experts' sum) is timed as regions (`region`), exclusive: a region's
seconds are taken out of the part around it.

Each collective over the group (the all-to-alls, the redundant experts' all-reduce) notes the
clock as it returns (`sync`); every rank calls them in the same order, so the segments between
them line up across ranks (`PartProfile.segments`), and the step of ranks that meet at every
collective is the sum over segments of the slowest rank's, on the profile's clock.

The clock is the process's CPU time on CPU (what `routepack.measure` judges a run by: gloo's
threads included, a wait for a peer not) and the wall clock after a device synchronisation on
CUDA (so the profile serialises the GPU: use it to find where time goes, not to time a run).

The parts and the cost-model term that prices each: `routepack.parts`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from routepack.parts import PARTS


class PartProfile:
    """Exclusive seconds per part (`PARTS`) on ``clock`` since the last `take`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: Dict[str, float] = defaultdict(float)
        self.last = clock()
        self.pending = 0.0  # seconds of the segment in progress taken before a region began
        self.start = self.last
        #: the clock as each collective over the EP group returned (`sync`), in call order
        self.syncs: List[float] = []

    def sync(self) -> None:
        """Notes the clock as a collective of the whole group returns (an all-to-all, an
        all-reduce): every rank calls the same collectives in the same order, so the i-th note
        of every rank closes the same segment of the step (`segments`)."""
        self.syncs.append(self.clock())

    def segments(self) -> List[float]:
        """Seconds between consecutive collectives since the profile began or was last taken:
        from the start to the first collective's return, ..., from the last one's to now. On
        each rank its own work only (a wait for a peer is no CPU time); the step of ranks that
        meet at every collective takes the sum over segments of the slowest rank's."""
        now = self.clock()
        marks = [self.start, *self.syncs, now]
        self.start, self.syncs = now, []
        return [b - a for a, b in zip(marks, marks[1:])]

    def charge(self, part: str) -> None:
        """Charges the segment since the last mark (regions taken out) to ``part``."""
        now = self.clock()
        self.seconds[part] += self.pending + (now - self.last)
        self.pending, self.last = 0.0, now

    @contextlib.contextmanager
    def region(self, part: str) -> Iterator[None]:
        now = self.clock()
        self.pending += now - self.last
        self.last = now
        try:
            yield
        finally:
            now = self.clock()
            self.seconds[part] += now - self.last
            self.last = now

    def take(self) -> Dict[str, float]:
        """The seconds so far, every part of `PARTS` listed (the unmarked rest charged to
        ``other``), and a fresh start."""
        self.charge("other")
        out = {p: 0.0 for p in PARTS}
        out.update((p, float(v)) for p, v in self.seconds.items())
        self.seconds = defaultdict(float)
        return out


_active: Optional[PartProfile] = None


def active() -> Optional[PartProfile]:
    """The profile being recorded, or None."""
    return _active


@contextlib.contextmanager
def profiling(device: Any = "cpu") -> Iterator[PartProfile]:
    """Records a `PartProfile` of the layers' work while inside (one at a time per process).
    ``device``: the layers' device (CPU: process CPU time; CUDA: wall clock, synchronised)."""
    global _active
    if torch.device(device).type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

    else:
        clock = time.process_time
    prev, _active = _active, PartProfile(clock)
    try:
        yield _active
    finally:
        _active = prev


def sync() -> None:
    """`PartProfile.sync` where a profile is recorded (else nothing)."""
    if _active is not None:
        _active.sync()


def region(part: str) -> Any:
    """A context timing ``part`` exclusively where a profile is recorded (else a no-op)."""
    return _active.region(part) if _active is not None else contextlib.nullcontext()


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, before, after, prof):  # type: ignore[override]
        prof.charge(before)
        ctx.after, ctx.prof = after, prof
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.prof.charge(ctx.after)
        return grad, None, None, None


def mark(x: torch.Tensor, before: str, after: str) -> torch.Tensor:
    """``x`` itself, where a profile is recorded an identity node: its forward charges the time
    since the last mark to ``before``, its backward (after the backward of what follows it)
    to ``after``."""
    prof = _active
    if prof is None or not torch.is_grad_enabled():
        if prof is not None:
            prof.charge(before)
        return x
    return _Mark.apply(x, before, after, prof)
