"""`gather_payloads`: every rank's few header ints and byte payload to every rank, in one
header all-gather and one padded byte all-gather, with a rank's failure shared so that no
peer waits for it (what `plan_window_distributed` and `gather_window` build on)."""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from routepack.torch.broadcast import all_gather_tensors, default_device, gather_ints, raise_shared_failure


def gather_payloads(
    header: Sequence[int],
    payload: Optional[np.ndarray],
    error: Optional[BaseException],
    what: str,
    group: Optional[Any] = None,
    device: Any = None,
    timeout: Optional[datetime.timedelta] = None,
) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Collective over ``group``: returns (int64 ``[ranks, len(header)]``, one uint8 ``[n_r]``
    array per rank in group-rank order), the headers and payloads every rank passed.

    A rank that failed before the call passes its ``error`` (then ``header`` and ``payload``
    are ignored, any ints of the same count will do): it still takes part, then re-raises
    its error, and every peer raises `RoutepackError` naming the failed ranks and ``what``.
    The payloads travel as one all-gather padded to the longest payload (so each rank sends
    that many bytes; the arrays returned are trimmed to what each rank passed). ``timeout``
    bounds each wait."""
    ok = error is None
    mine = np.ascontiguousarray(payload if ok and payload is not None else np.empty(0, np.uint8)).view(np.uint8).ravel()
    ints = [int(v) for v in header] if ok else [0] * len(header)
    got = gather_ints([int(ok), mine.size] + ints, group, device, timeout)
    raise_shared_failure(
        error, got[:, 0], lambda bad: f"{what}: rank(s) {bad} of the group failed (each raised its own error)"
    )
    sizes = got[:, 1]
    longest = int(sizes.max())
    device = device if device is not None else default_device(group)
    if longest == 0:
        return got[:, 2:], [np.empty(0, np.uint8) for _ in sizes]
    padded = mine
    if mine.size < longest or not mine.flags.writeable:
        padded = np.zeros(longest, np.uint8)
        padded[: mine.size] = mine
    bufs = all_gather_tensors(torch.from_numpy(padded).to(device), group, timeout)
    return got[:, 2:], [b.cpu().numpy()[: int(n)] for b, n in zip(bufs, sizes)]


__all__ = ["gather_payloads"]
