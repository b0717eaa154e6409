"""`plan_window_distributed`: `routepack.plan_window` computed by every rank of a process
group together, each rank planning its block of the replication exchanges, and returning on
every rank the very plan `plan_window` returns (docs/design.md, "Distributed planning").

Placement and packing run on every rank (they are deterministic, so every rank gets the same
bytes); the replication stage's exchanges (EP group, microbatch, layer), which the core plans
independently, are split into contiguous blocks of the flattened exchange index, rank i of n
plans block i (`routepack.stages.replication.Block`), and the replica rows are all-gathered
and concatenated in block order: exactly the full run's rows. Every rank then validates,
simulates and reports as `plan_window` does, through the same code: the arguments checked
once (`planner.plan_request`), then `planner.plan_stages`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch.distributed as dist

from routepack.errors import RoutepackError
from routepack.model import CostModel
from routepack.plan import REPLICA_DTYPE, Placement, Plan
from routepack.planner import PlanRequest, plan_request, plan_stages
from routepack.stages.context import DEFAULT_POLICY, DEFAULT_SEED, DEFAULT_TOKEN_CAP, PlanContext
from routepack.stages.registry import Stage
from routepack.stages.replication import hot_n_replication, relibra_replication, routepack_replication
from routepack.torch import _args
from routepack.torch.broadcast import gather_ints, raise_shared_failure
from routepack.torch.gather import gather_payloads
from routepack.window import Window

#: The replication choices that plan one exchange at a time and take ``block=``; any other
#: (``none``, a registered one) runs whole on every rank.
PER_EXCHANGE: frozenset = frozenset({hot_n_replication, relibra_replication, routepack_replication})

#: The arguments every rank must pass alike, in the order their fingerprints travel.
_AGREED = (
    "window",
    "topo",
    "cost",
    "token_cap",
    "policy",
    "previous",
    "previous_window",
    "seed",
    "anneal_moves",
    "oversize",
    "options",
)

#: Bytes per hashed chunk: chunks are hashed in parallel threads (hashlib releases the GIL).
_CHUNK = 1 << 24


def plan_window_distributed(
    window: Any,
    topo: Any,
    cost: Any,
    token_cap: int = DEFAULT_TOKEN_CAP,
    policy: Any = DEFAULT_POLICY,
    group: Optional[Any] = None,
    previous: Optional[Placement] = None,
    previous_window: Any = None,
    seed: int = DEFAULT_SEED,
    anneal_moves: Optional[int] = None,
    time_budget_s: Optional[float] = None,
    timeout: Optional[datetime.timedelta] = None,
    oversize: Optional[str] = None,
    **options: Any,
) -> Plan:
    """`routepack.plan_window` planned by every rank of ``group`` together (collective): each
    rank returns the plan ``plan_window`` returns for the same arguments, byte for byte
    (`Plan.digest`, `Plan.same_as`).

    Args:
        window, topo, cost, token_cap, policy, previous, previous_window, seed, anneal_moves,
            oversize, options: as `routepack.plan_window`, and the same on every rank (checked first by
            a fingerprint of each; a rank that differs makes every rank raise
            `RoutepackError` naming the argument).
        group: the torch.distributed process group (None: the default group). Every rank of
            it must call; a process that is not a member raises at once.
        time_budget_s: must be None: a wall-clock cap makes a plan depend on each rank's
            clock, so ranks could disagree (plan on one rank with ``time_budget_s`` and
            `routepack.torch.broadcast_plan` it instead). Anything else raises
            `RoutepackError` on every rank.
        timeout: optional `datetime.timedelta` bounding each collective's wait.

    Spread: the exchanges of the ``hot_n``, ``relibra`` and ``routepack`` replications
    (`PER_EXCHANGE`), one contiguous block per rank. Placement, packing, validation and the
    final simulate run on every rank; so does any other replication. An error in any stage
    raises on every rank (the inputs agree, so the redundant stages fail alike; a rank whose
    replication block fails tells its peers, which raise naming it).

    Returns:
        The `Plan`; ``report`` as `plan_window`'s plus ``distributed``: ``ranks``, ``rank``
        (in the group), ``spread`` (whether replication was split), ``exchanges`` ``[start,
        end)`` of this rank's block, ``replica_rows`` per rank, ``gathered_bytes`` (this
        rank's replica bytes sent) and ``agree_seconds`` (fingerprinting + agreement).
    """
    if not dist.is_initialized():
        raise RoutepackError("group: torch.distributed is not initialized (call init_process_group first)")
    # dist.new_group hands the processes outside the group this marker, not a group
    non_member = group is dist.GroupMember.NON_GROUP_MEMBER
    if not non_member:
        _args.group(group)
    _args.timeout(timeout)
    me = -1 if non_member else dist.get_rank(group)
    if me < 0:
        raise RoutepackError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    n = dist.get_world_size(group)
    t0 = time.perf_counter()
    err: Optional[BaseException] = None
    prints: List[int] = [0] * len(_AGREED)
    request: Optional[PlanRequest] = None
    try:
        if time_budget_s is not None:
            raise RoutepackError(
                f"time_budget_s: plan_window_distributed plans without a wall-clock cap (got {time_budget_s!r}): a "
                "deadline makes the plan depend on each rank's clock, so ranks could disagree; plan on one rank "
                "with time_budget_s and routepack.torch.broadcast_plan it"
            )
        # every argument checked here, before the ranks agree, so that a rank's bad argument
        # raises its own error there (its peers: that it failed), not a disagreement
        request = plan_request(
            window,
            topo,
            cost,
            token_cap,
            policy,
            previous,
            previous_window,
            seed,
            anneal_moves,
            None,
            oversize,
            options,
            stacklevel=3,
        )
        prints = _fingerprints(request)
    except Exception as e:  # noqa: BLE001 (shared with the peers, then re-raised)
        err = e
    got = gather_ints([int(err is None)] + prints, group, timeout=timeout)
    raise_shared_failure(
        err,
        got[:, 0],
        lambda bad: (
            f"plan_window_distributed: rank(s) {bad} of the group passed invalid arguments (each raised its own error)"
        ),
    )
    for i, name in enumerate(_AGREED):
        col = got[:, 1 + i]
        if np.unique(col).size != 1:
            odd = np.flatnonzero(col != col[0]).tolist()
            raise RoutepackError(
                f"{name}: differs between the ranks of the group (rank(s) {odd} passed another "
                f"{name} than rank 0); every rank must pass the same arguments"
            )
    report: Dict[str, Any] = {
        "ranks": n,
        "rank": me,
        "spread": False,
        "exchanges": None,
        "replica_rows": None,
        "gathered_bytes": 0,
        "agree_seconds": time.perf_counter() - t0,
    }
    if request is None:  # not reached: a rank whose arguments failed raised above, with its peers
        raise RoutepackError("plan_window_distributed: this rank's arguments were not checked")
    plan = plan_stages(request, _spread(me, n, group, timeout, report))
    plan.report["distributed"] = report
    return plan


def _spread(
    me: int, n: int, group: Optional[Any], timeout: Optional[datetime.timedelta], report: Dict[str, Any]
) -> Callable[..., np.ndarray]:
    """The `planner.ReplicationRunner` of rank ``me`` of ``n``: its block, then every block."""

    def run(
        stage: Stage,
        ctx: PlanContext,
        options: Any,
        placement: Placement,
        sample_rank: np.ndarray,
        sample_micro: np.ndarray,
        num_micro: int,
    ) -> np.ndarray:
        if stage.run not in PER_EXCHANGE or n == 1:
            return stage.run(ctx, options, placement, sample_rank, sample_micro, num_micro)
        err: Optional[BaseException] = None
        mine = np.empty(0, REPLICA_DTYPE)
        try:
            mine = stage.run(ctx, options, placement, sample_rank, sample_micro, num_micro, block=(me, n))
        except Exception as e:  # noqa: BLE001 (shared with the peers, then re-raised)
            err = e
        rows, parts = gather_payloads([len(mine)], mine.view(np.uint8), err, "replication", group, timeout=timeout)
        total = ctx.topo.num_groups * num_micro * ctx.window.num_layers
        report.update(
            spread=True,
            exchanges=[total * me // n, total * (me + 1) // n],
            replica_rows=rows[:, 0].tolist(),
            gathered_bytes=int(mine.nbytes),
        )
        return np.concatenate([p.view(REPLICA_DTYPE) for p in parts])

    return run


def _fingerprints(request: PlanRequest) -> List[int]:
    """Per argument of `_AGREED`, 63 bits of a SHA-256 of its checked value in ``request``
    (arrays by dtype, shape and bytes; the rest by an exact text): equal arguments, equal ints.
    The policy counts by its name and stages, ``oversize`` by its mode (None and "refuse"
    agree), the options under their current names."""
    ctx = request.ctx
    args = {name: getattr(ctx, name) for name in _AGREED}
    args["policy"] = (request.name, ctx.policy)
    out = []
    for name in _AGREED:
        v = args[name]
        if isinstance(v, Window):
            parts = [_array_digest(v.seq_lens), _array_digest(v.counts), repr(v.top_k).encode()]
        elif isinstance(v, CostModel):
            parts = [v.to_json().encode()]
        elif isinstance(v, Placement):
            parts = [_array_digest(v.phy2log), repr((v.num_experts, v.slots_per_rank)).encode()]
        elif isinstance(v, dict):
            parts = [repr(sorted((k, _text(x)) for k, x in v.items())).encode()]
        else:
            parts = [_text(v).encode()]
        h = hashlib.sha256()
        for p in parts:
            h.update(hashlib.sha256(p).digest())
        out.append(int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1))
    return out


def _text(v: Any) -> str:
    """An exact text of a scalar argument: numbers by value (``np.int64(2)`` as ``2``, so
    ranks passing equal numbers of other types agree), anything else by type and repr."""
    if isinstance(v, (bool, np.bool_)):
        return f"bool:{bool(v)}"
    if isinstance(v, (int, np.integer)):
        return f"int:{int(v)}"
    if isinstance(v, (float, np.floating)):
        return f"float:{float(v)!r}"
    return f"{type(v).__module__}.{type(v).__qualname__}:{v!r}"


def _array_digest(arr: np.ndarray) -> bytes:
    """SHA-256 of an array's dtype, shape and bytes, its chunks hashed in parallel threads."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    chunks = [flat[i : i + _CHUNK] for i in range(0, flat.size, _CHUNK)] or [flat]
    with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda c: hashlib.sha256(memoryview(c)).digest(), chunks))
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    for d in digests:
        h.update(d)
    return h.digest()


__all__ = ["PER_EXCHANGE", "plan_window_distributed"]
