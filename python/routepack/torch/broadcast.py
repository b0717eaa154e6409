"""Plans across ranks: one rank's plan sent to all, digests, and agreement before any move.

A plan computed without a wall-clock cap is a pure function of its inputs, so every rank can
compute it and `agree_on_plan` just confirms they did. Under a cap (``time_budget_s``) plans
may differ between machines: compute on one rank and `broadcast_plan` it; a plan saved to a
file is read by one rank and sent to all with `load_plan`.

Every agreement goes through `gather_ints`. When its exchange cannot complete (a rank was
killed, stalled past ``timeout`` or waits in another collective) every rank that takes part
raises `AgreementError` with one message, nothing applied; the process group is unusable
after that (as after any backend timeout) and the job restarts from its last checkpoint
(docs/faults.md).
"""

from __future__ import annotations

import datetime
import hashlib
import io
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from routepack._checks import positive_int, sequence
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackFileError, RoutepackTypeError
from routepack.plan import Plan
from routepack.torch import _args

#: The int64 range, which `gather_ints` carries.
_I64 = (-(2**63), 2**63 - 1)
#: `broadcast_plan`'s header kinds: plan bytes follow, rank src passed no plan, src could not read a file
_PLAN, _NOT_A_PLAN, _UNREADABLE = 0, -1, -2


class AgreementError(RuntimeError):
    """An agreement exchange between the ranks of a group (`gather_ints`: plan digests,
    migration and commit status) did not complete within its timeout: a rank is gone
    (killed, crashed), stalled, or waiting in another collective. Every rank that takes part
    raises it with the same message; what the caller had under way is not applied (a plan
    agreement applies nothing, `migrate` restores its slots). The backend's error is the
    ``__cause__``; the process group is unusable afterwards (as after any backend timeout):
    restart the job from its last checkpoint."""


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


def check_same_plan(digests: np.ndarray, who: str = "ranks") -> None:
    """Raises `InvalidPlanError` unless every entry of ``digests`` (one `digest_int` per rank
    of a group, group order) is the same; the message lists each distinct digest (hex) with
    the ranks holding it, so both sides of a disagreement are named."""
    values = [int(d) for d in np.asarray(digests).reshape(-1)]
    if len(set(values)) <= 1:
        return
    held: dict = {}
    for r, d in enumerate(values):
        held.setdefault(d, []).append(r)
    parts = "; ".join(f"digest {d:016x} on rank(s) {ranks}" for d, ranks in held.items())
    raise InvalidPlanError(
        f"{who} hold different plans ({parts}); nothing moved: compute the plan on every rank from the same "
        "inputs, or on one rank and send it with routepack.torch.broadcast_plan"
    )


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
    head = _agreed(torch.tensor([int(err is None), len(mine)], dtype=torch.int64, device=device), group, timeout)
    raise_shared_failure(
        err,
        head[:, 0],
        lambda bad: f"values: rank(s) {bad} of the group passed invalid values (each raised its own error)",
    )
    if np.unique(head[:, 1]).size != 1:
        raise RoutepackError(
            f"values: ranks passed different counts {head[:, 1].tolist()}; every rank must pass as many"
        )
    return _agreed(torch.tensor(mine, dtype=torch.int64, device=device), group, timeout)


def _agreed(mine: torch.Tensor, group: Optional[Any], timeout: Optional[datetime.timedelta]) -> np.ndarray:
    """`_all_gather`, its backend failure (a timeout, a peer gone) raised as `AgreementError`
    with the same text on every rank (which rank is missing differs by rank, so it is left to
    the backend's error, the ``__cause__``)."""
    try:
        return _all_gather(mine, group, timeout)
    except torch.cuda.OutOfMemoryError:  # a RuntimeError, not a failed exchange (torch.cuda.: torch 2.1 too)
        raise
    except RuntimeError as e:
        raise _no_answer(group, timeout) from e


def _no_answer(group: Optional[Any], timeout: Optional[datetime.timedelta]) -> AgreementError:
    within = f"within {timeout.total_seconds():g} s" if timeout is not None else "within the group's timeout"
    return AgreementError(
        f"the {dist.get_world_size(group)} ranks of the group did not all answer an agreement exchange {within} "
        "(a rank is gone, stalled or in another collective); the process group is unusable now: restart the job "
        "from its last checkpoint"
    )


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


def broadcast_plan(
    plan: Optional[Plan],
    src: int,
    group: Optional[Any] = None,
    device: Any = None,
    timeout: Optional[datetime.timedelta] = None,
) -> Plan:
    """Every rank of ``group`` returns the plan held by global rank ``src`` (others pass None
    or anything). The plan travels as its ``.npz`` bytes, so it arrives identical
    (`Plan.same_as` and the report); every rank then confirms that it read them and holds
    the same digest (one small all-gather), so bytes damaged on the way make every rank
    raise `RoutepackFileError`. ``src`` must be a rank of ``group`` (every rank passes the
    same); when rank ``src`` holds no `Plan`, every rank raises. ``timeout`` bounds every
    wait (None: the group's own; a peer gone or stalled raises `AgreementError`)."""
    src = _check_src(src, group)
    _args.timeout(timeout)
    if dist.get_rank() == src and not isinstance(plan, Plan):
        return _share_plan(None, (_NOT_A_PLAN, type(plan).__name__), None, src, group, device, timeout)
    return _share_plan(plan, (_PLAN, ""), None, src, group, device, timeout)


def load_plan(
    path: Any,
    src: int = 0,
    group: Optional[Any] = None,
    device: Any = None,
    timeout: Optional[datetime.timedelta] = None,
) -> Plan:
    """Collective: global rank ``src`` reads the plan file ``path`` (`Plan.load`) and every rank
    of ``group`` returns that plan (`broadcast_plan`: the same bytes, confirmed on every rank).
    A file rank ``src`` cannot read (missing, damaged) raises there as `Plan.load` raises
    (`RoutepackFileError` naming the path and the fault, ``OSError`` for a missing file), and
    `RoutepackFileError` with that message on every other rank: no rank is left waiting and
    no rank goes on with a plan. Every rank passes the same arguments; only ``src`` reads."""
    src = _check_src(src, group)
    _args.timeout(timeout)
    if dist.get_rank() != src:
        return _share_plan(None, (_PLAN, ""), None, src, group, device, timeout)
    try:
        plan = Plan.load(path)
    except (OSError, RoutepackError) as e:
        return _share_plan(None, (_UNREADABLE, f"{type(e).__name__}: {e}"), e, src, group, device, timeout)
    return _share_plan(plan, (_PLAN, ""), None, src, group, device, timeout)


def _check_src(src: Any, group: Optional[Any]) -> int:
    _args.group(group)
    peers = group_peers(group)
    src = positive_int(src, "src", minimum=0)
    if src not in peers:
        raise RoutepackError(
            f"src: {src} is not a rank of the group (global ranks {_ranks_text(peers)}, "
            f"world size {dist.get_world_size()})"
        )
    return src


def _share_plan(
    plan: Optional[Plan],
    why: Tuple[int, str],
    own_error: Optional[BaseException],
    src: int,
    group: Optional[Any],
    device: Any,
    timeout: Optional[datetime.timedelta],
) -> Plan:
    """Rank ``src`` sends ``plan`` (kind `_PLAN`), or when it has none the kind and text of
    ``why`` and then raises ``own_error`` (or the peers' error); the others receive, read and
    confirm (`broadcast_plan`)."""
    device = device if device is not None else default_device(group)
    me = dist.get_rank()
    data = torch.empty(0, dtype=torch.uint8, device=device)
    if me == src:
        raw = io.BytesIO()
        if plan is not None:
            plan.save(raw)
        payload = raw.getvalue() if plan is not None else why[1].encode()
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload else data
        head = torch.tensor([why[0] if plan is None else _PLAN, data.numel()], dtype=torch.int64, device=device)
    else:
        head = torch.zeros(2, dtype=torch.int64, device=device)
    _bounded(lambda: dist.broadcast(head, src, group=group, async_op=True), group, timeout)
    kind, n = (int(v) for v in head.cpu().tolist())
    if me != src:
        data = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        _bounded(lambda: dist.broadcast(data, src, group=group, async_op=True), group, timeout)
    if kind != _PLAN:
        text = data.cpu().numpy().tobytes().decode(errors="replace")
        if own_error is not None:
            raise own_error
        if kind == _NOT_A_PLAN:
            raise RoutepackTypeError(f"plan: rank {src} must pass a routepack.Plan, got {text}")
        raise RoutepackFileError(f"plan file: rank {src} could not read it ({text}); no rank has a plan")
    err: Optional[BaseException] = None
    digest = 0
    try:
        if me != src:
            plan = Plan.load(io.BytesIO(data.cpu().numpy().tobytes()))
        digest = digest_int(plan)  # type: ignore[arg-type]
    except RoutepackError as e:
        err = e
    got = gather_ints([int(err is None), digest], group, device, timeout)
    raise_shared_failure(
        err,
        got[:, 0],
        lambda bad: f"plan: rank(s) {bad} could not read the plan rank {src} sent (each raised its own error)",
        RoutepackFileError,
    )
    check_same_plan(got[:, 1], "plan: the ranks")
    return plan  # type: ignore[return-value]


def _bounded(start: Callable[[], Any], group: Optional[Any], timeout: Optional[datetime.timedelta]) -> None:
    """Waits for the collective ``start()`` posts, at most ``timeout``; `AgreementError` if it fails."""
    try:
        work = start()
        work.wait() if timeout is None else work.wait(timeout)
    except torch.cuda.OutOfMemoryError:  # a RuntimeError, not a failed exchange (torch.cuda.: torch 2.1 too)
        raise
    except RuntimeError as e:
        raise _no_answer(group, timeout) from e


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
    check_same_plan(got[:, 1], "plan: the ranks")
