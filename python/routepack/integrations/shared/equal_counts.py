"""Equal sample counts per DP rank, for trainers that dispatch equal chunks.

verl hands every DP rank ``len(batch) / dp`` samples (``DataProto.chunk`` asserts it), so a
plan whose ranks hold different numbers of samples cannot be carried out there as it is.
routepack's packing balances tokens and cost, not counts; this module moves samples from
ranks above ``S / dp`` to ranks below it, keeping every microbatch under the cap and none
empty, and keeping the step count. Deterministic: each move takes the shortest movable
sample of the fullest rank (ties: lowest index) into the emptiest step (by tokens; ties:
lowest step) of the rank furthest below, the first such rank whose step takes it.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np

from routepack._checks import instance_of, positive_int
from routepack.errors import InfeasibleError, RoutepackError
from routepack.model import CostModel, Topology
from routepack.plan import Plan
from routepack.simulate import simulate
from routepack.window import Window


def equal_count_plan(plan: Any, window: Any, topo: Any, token_cap: int, cost: Optional[Any] = None) -> Plan:
    """``plan`` with the same number of samples on every DP rank.

    Args:
        plan:      a `Plan` for ``window`` (``sample_rank``/``sample_micro`` int32 ``[S]``).
        window:    the `Window` it was planned for (``seq_lens`` int64 ``[S]``).
        topo:      the `Topology` (``topo.dp`` ranks); ``token_cap``: the plan's cap.
        cost:      optional `CostModel`: when given, ``report["predicted"]`` is simulated
                   again for the moved layout (else it is dropped, being stale).

    Returns:
        ``plan`` itself when its counts are already equal, else a new `Plan` (placement,
        replicas and migration unchanged, ``report["equal_counts"] = {"moved": n}``) that
        passed `Plan.validate`. Raises `RoutepackError` when ``S`` is not a multiple of
        ``dp`` and `InfeasibleError` when a rank would need fewer samples than steps or no
        sample fits anywhere under the cap (raise the cap, or plan with ``policy="eplb"``,
        whose Karmarkar–Karp packing has equal counts).
    """
    instance_of(plan, Plan, "plan")
    instance_of(window, Window, "window")
    instance_of(topo, Topology, "topo")
    token_cap = positive_int(token_cap, "token_cap")
    if cost is not None:
        instance_of(cost, CostModel, "cost")
    plan.validate(window, topo, token_cap)
    dp, n = topo.dp, plan.num_samples
    if n % dp:
        raise RoutepackError(
            f"plan: its {n} samples do not split into {dp} equal DP shares (verl's DataProto.chunk needs "
            f"len(batch) % dp == 0)"
        )
    target, steps = n // dp, plan.num_micro
    if target < steps:
        raise InfeasibleError(
            f"plan: {steps} microbatch steps per rank but only {target} samples per rank; equal counts would "
            f"leave a microbatch empty (raise token_cap or plan with policy='eplb')"
        )
    rank = plan.sample_rank.astype(np.int64)
    micro = plan.sample_micro.astype(np.int64)
    lens = window.seq_lens
    tokens = np.zeros((dp, steps), dtype=np.int64)
    members = np.zeros((dp, steps), dtype=np.int64)
    np.add.at(tokens, (rank, micro), lens)
    np.add.at(members, (rank, micro), 1)
    counts = np.bincount(rank, minlength=dp)
    moved = 0
    while counts.max() > target:
        src, s, dst, step = _next_move(rank, micro, lens, tokens, members, counts, target, token_cap)
        tokens[src, micro[s]] -= lens[s]
        members[src, micro[s]] -= 1
        counts[src] -= 1
        rank[s], micro[s] = dst, step
        tokens[dst, step] += lens[s]
        members[dst, step] += 1
        counts[dst] += 1
        moved += 1
    if moved == 0:
        return plan
    report = {k: copy.deepcopy(v) for k, v in plan.report.items() if k != "predicted"}
    report["equal_counts"] = {"moved": moved}
    out = Plan(
        plan.placement,
        rank.astype(np.int32),
        micro.astype(np.int32),
        steps,
        plan.replicas,
        plan.migration,
        report=report,
        policy=plan.policy,
        replica_timing=plan.replica_timing,
    )
    out.validate(window, topo, token_cap)
    if cost is not None:
        out.report["predicted"] = simulate(out, window, topo, cost, token_cap).summary()
    return out


def plan_equal_counts(
    window: Any, topo: Any, cost: Any, token_cap: int, policy: Any = "routepack", **kwargs: Any
) -> Plan:
    """`routepack.plan_window` with equal sample counts per DP rank (`equal_count_plan`).
    Where the counts cannot be equalised under the cap, the window is planned again with the
    same placement and replication choices and verl's Karmarkar–Karp packing (equal counts by
    construction); ``report["equal_counts"]`` then says ``{"fallback": "kk"}``. Arguments as
    `routepack.plan_window` (``kwargs``: its keyword arguments and stage options). Returns a
    `Plan` that passed `Plan.validate`."""
    from routepack.planner import plan_window
    from routepack.policies import resolve
    from routepack.stages.policy import Policy

    # the caller's window, not the plan made of it, is what cannot be split (before planning)
    S = instance_of(window, Window, "window")._check_fields("window").num_samples
    if S % instance_of(topo, Topology, "topo").dp:
        raise RoutepackError(
            f"window: its {S} samples do not split into topo.dp={topo.dp} equal DP shares (verl's DataProto.chunk "
            "needs len(batch) % dp == 0)"
        )
    plan = plan_window(window, topo, cost, token_cap=token_cap, policy=policy, **kwargs)
    try:
        return equal_count_plan(plan, window, topo, token_cap, cost)
    except InfeasibleError:
        name, pol = resolve(policy)
        if pol.packing == "kk":
            raise
    kk = Policy(pol.placement, "kk", pol.replication, loads=pol.loads)
    plan = plan_window(window, topo, cost, token_cap=token_cap, policy=kk, **kwargs)
    plan.report["equal_counts"] = {"fallback": "kk", "policy": name}
    return equal_count_plan(plan, window, topo, token_cap, cost)


def _next_move(
    rank: np.ndarray,
    micro: np.ndarray,
    lens: np.ndarray,
    tokens: np.ndarray,
    members: np.ndarray,
    counts: np.ndarray,
    target: int,
    token_cap: int,
) -> tuple:
    """(source rank, sample, destination rank, destination step) of the next move: ranks
    above ``target`` fullest first, each offering its shortest sample whose step keeps
    another (if that one fits nowhere, no longer one of the rank does); ranks below
    ``target`` emptiest first, each taking it into its step with the fewest tokens."""
    for src in np.argsort(-counts, kind="stable"):
        if counts[src] <= target:
            break
        movable = np.flatnonzero((rank == src) & (members[src, micro] >= 2))
        if movable.size == 0:
            continue
        s = int(movable[np.lexsort((movable, lens[movable]))[0]])
        for dst in np.argsort(counts, kind="stable"):
            if counts[dst] >= target:
                break
            step = int(np.argmin(tokens[dst]))
            if tokens[dst, step] + lens[s] <= token_cap:
                return int(src), s, int(dst), step
    raise InfeasibleError(
        f"plan: cannot equalise sample counts under token_cap={token_cap}: no rank above {target} samples has a "
        f"sample that fits in a microbatch of a rank below it without emptying its own (raise token_cap or plan "
        f"with policy='eplb')"
    )


__all__ = ["equal_count_plan", "plan_equal_counts"]
