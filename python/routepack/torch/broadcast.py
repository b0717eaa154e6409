"""Plans across ranks: one rank's plan sent to all, digests, and agreement before any move.

A plan computed without a wall-clock cap is a pure function of its inputs, so every rank can
compute it and `agree_on_plan` just confirms they did. Under a cap (``time_budget_s``) plans
may differ between machines: compute on one rank and `broadcast_plan` it.
"""

from __future__ import annotations

import datetime
import hashlib
import io
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from routepack._checks import positive_int, sequence
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.plan import Plan
from routepack.torch import _args

#: The int64 range, which `gather_ints` carries.
_I64 = (-(2**63), 2**63 - 1)


def plan_digest(plan: Plan) -> bytes:
    """SHA-256 of the plan's decisions (placement, layout, replicas, migration; not the report)."""
    if not isinstance(plan, Plan):
        raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
    # fields can be reassigned after construction: a None or a list there must fail naming the
    # field, not hash an object array's pointers
    plan._check_fields()
    h = hashlib.sha256()
    p = plan.placement
    for part in (
        np.int64(p.num_experts),
        np.int64(p.slots_per_rank),
        np.asarray(p.phy2log.shape, np.int64),
        p.phy2log,
        plan.sample_rank,
        plan.sample_micro,
        np.int64(plan.num_micro),
        plan.replicas,
        plan.migration,
    ):
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


def raise_shared_failure(
    err: Optional[BaseException], ok: np.ndarray, message: Callable[[list], str], error: type = RoutepackError
) -> None:
    """After a collective that carried every rank's ok flag (``ok``: int ``[ranks]``, 0 where
    that rank failed): re-raises this rank's own ``err``, else raises ``error(message(bad))``
    where ``bad`` lists the ranks that failed, so every rank leaves the collective and raises."""
    if err is not None:
        raise err
    bad = np.flatnonzero(ok == 0).tolist()
    if bad:
        raise error(message(bad))


def gather_ints(
    values: Sequence[int], group: Optional[Any] = None, device: Any = None, timeout: Optional[datetime.timedelta] = None
) -> np.ndarray:
    """All-gathers a few int64 values from every rank of ``group``: int64 ``[ranks, n]``.
    ``timeout`` bounds the wait (the call raises instead of hanging).

    Collective, and safe against a bad argument on one rank: every rank first shares whether
    its ``values`` are valid and how many there are, so a rank with bad values (or a count
    that differs from the others') makes every rank raise `RoutepackError` instead of leaving
    its peers waiting in the all-gather."""
    _args.group(group)
    _args.timeout(timeout)
    err: Optional[BaseException] = None
    mine: list = []
    try:
        items = sequence(values, "values", "ints")
        mine = [positive_int(v, f"values[{i}]", minimum=_I64[0], maximum=_I64[1]) for i, v in enumerate(items)]
    except RoutepackError as e:
        err = e
    device = device if device is not None else default_device(group)
    head = _all_gather(torch.tensor([int(err is None), len(mine)], dtype=torch.int64, device=device), group, timeout)
    raise_shared_failure(
        err,
        head[:, 0],
        lambda bad: f"values: rank(s) {bad} of the group passed invalid values (each raised its own error)",
    )
    if np.unique(head[:, 1]).size != 1:
        raise RoutepackError(
            f"values: ranks passed different counts {head[:, 1].tolist()}; every rank must pass as many"
        )
    return _all_gather(torch.tensor(mine, dtype=torch.int64, device=device), group, timeout)


def all_gather_tensors(
    mine: torch.Tensor, group: Optional[Any], timeout: Optional[datetime.timedelta]
) -> "list[torch.Tensor]":
    """Collective: every rank's ``mine`` (same shape and dtype on every rank), in group-rank
    order; ``timeout`` bounds the wait (None: the group's own)."""
    bufs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(bufs, mine, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
    return bufs


def _all_gather(mine: torch.Tensor, group: Optional[Any], timeout: Optional[datetime.timedelta]) -> np.ndarray:
    return torch.stack(all_gather_tensors(mine, group, timeout)).cpu().numpy()


def broadcast_plan(plan: Optional[Plan], src: int, group: Optional[Any] = None, device: Any = None) -> Plan:
    """Every rank of ``group`` returns the plan held by global rank ``src`` (others pass None
    or anything). The plan travels as its ``.npz`` bytes, so it arrives identical
    (`Plan.same_as` and the report). ``src`` must be a rank of ``group`` (every rank passes
    the same); when rank ``src`` holds no `Plan`, every rank raises."""
    _args.group(group)
    peers = group_peers(group)
    src = positive_int(src, "src", minimum=0)
    if src not in peers:
        raise RoutepackError(
            f"src: {src} is not a rank of the group (global ranks {_ranks_text(peers)}, "
            f"world size {dist.get_world_size()})"
        )
    device = device if device is not None else default_device(group)
    me = dist.get_rank()
    data = torch.empty(0, dtype=torch.uint8, device=device)
    if me == src:
        if isinstance(plan, Plan):
            raw = io.BytesIO()
            plan.save(raw)
            data = torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8).to(device)
        # -1 tells the peers there is no plan, so they raise too instead of waiting for bytes
        size = torch.tensor([data.numel() if isinstance(plan, Plan) else -1], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    n = int(size.item())
    if n < 0:
        raise RoutepackTypeError(
            f"plan: rank {src} must pass a routepack.Plan, got {type(plan).__name__ if me == src else 'something else'}"
        )
    if me != src:
        data = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    if me == src:
        return plan  # type: ignore[return-value]
    return Plan.load(io.BytesIO(data.cpu().numpy().tobytes()))


def group_peers(group: Optional[Any]) -> list:
    """Global ranks of ``group`` in group-rank order."""
    n = dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        return list(range(n))
    return [dist.get_global_rank(group, r) for r in range(n)]


def _ranks_text(ranks: Sequence[int]) -> str:
    if list(ranks) == list(range(len(ranks))):
        return f"0..{len(ranks) - 1}"
    return str(list(ranks))


def agree_on_plan(
    plan: Plan, group: Optional[Any] = None, device: Any = None, timeout: Optional[datetime.timedelta] = None
) -> None:
    """Raises `InvalidPlanError` on every rank unless all ranks of ``group`` hold the same plan.
    A rank passing something that is not a `Plan` raises `RoutepackTypeError`, and its peers
    `InvalidPlanError` (it still takes part in the exchange, so nobody waits for it)."""
    err: Optional[BaseException] = None
    try:
        digest = digest_int(plan)
    except RoutepackError as e:
        err, digest = e, 0
    got = gather_ints([int(err is None), digest], group, device, timeout)
    raise_shared_failure(
        err, got[:, 0], lambda bad: f"plan: rank(s) {bad} of the group passed no valid routepack.Plan", InvalidPlanError
    )
    if np.unique(got[:, 1]).size != 1:
        raise InvalidPlanError(f"ranks hold different plans (digests {[hex(int(x)) for x in got[:, 1]]})")
