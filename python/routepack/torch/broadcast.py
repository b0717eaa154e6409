"""Plans across ranks: one rank's plan sent to all, digests, and agreement before any move.

A plan computed without a wall-clock cap is a pure function of its inputs, so every rank can
compute it and `agree_on_plan` just confirms they did. Under a cap (``time_budget_s``) plans
may differ between machines: compute on one rank and `broadcast_plan` it.
"""

from __future__ import annotations

import datetime
import hashlib
import io
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from routepack.errors import InvalidPlanError, RoutepackTypeError
from routepack.plan import Plan


def plan_digest(plan: Plan) -> bytes:
    """SHA-256 of the plan's decisions (placement, layout, replicas, migration; not the report)."""
    h = hashlib.sha256()
    p = plan.placement
    for part in (np.int64(p.num_experts), np.int64(p.slots_per_rank), np.asarray(p.phy2log.shape, np.int64),
                 p.phy2log, plan.sample_rank, plan.sample_micro, np.int64(plan.num_micro),
                 plan.replicas, plan.migration):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.digest()


def digest_int(plan: Plan) -> int:
    """The first 63 bits of `plan_digest` as a non-negative int (fits an int64 tensor)."""
    return int.from_bytes(plan_digest(plan)[:8], "little") & ((1 << 63) - 1)


def default_device(group: Optional[Any] = None) -> torch.device:
    """Where collectives of ``group`` need their tensors: the current CUDA device under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_ints(values: Sequence[int], group: Optional[Any] = None, device: Any = None,
                timeout: Optional[datetime.timedelta] = None) -> np.ndarray:
    """All-gathers a few int64 values from every rank of ``group``: int64 ``[ranks, n]``.
    ``timeout`` bounds the wait (the call raises instead of hanging)."""
    device = device if device is not None else default_device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    bufs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(bufs, mine, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
    return torch.stack(bufs).cpu().numpy()


def broadcast_plan(plan: Optional[Plan], src: int, group: Optional[Any] = None, device: Any = None) -> Plan:
    """Every rank of ``group`` returns the plan held by global rank ``src`` (others pass None
    or anything). The plan travels as its ``.npz`` bytes, so it arrives identical
    (`Plan.same_as` and the report)."""
    device = device if device is not None else default_device(group)
    if dist.get_rank() == src:
        if not isinstance(plan, Plan):
            raise RoutepackTypeError(f"plan: rank {src} must pass a routepack.Plan, got {type(plan).__name__}")
        raw = io.BytesIO()
        plan.save(raw)
        data = torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    if dist.get_rank() == src:
        return plan
    return Plan.load(io.BytesIO(data.cpu().numpy().tobytes()))


def agree_on_plan(plan: Plan, group: Optional[Any] = None, device: Any = None,
                  timeout: Optional[datetime.timedelta] = None) -> None:
    """Raises `InvalidPlanError` on every rank unless all ranks of ``group`` hold the same plan."""
    got = gather_ints([digest_int(plan)], group, device, timeout)[:, 0]
    if np.unique(got).size != 1:
        raise InvalidPlanError(f"ranks hold different plans (digests {[hex(int(x)) for x in got]})")
