"""The preset is the best of its own stages: `plan_window`'s choice among candidate stage outputs,
scored by `simulate` (what a policy with ``Policy.choose`` runs; the ``routepack`` preset does).

A stage's own search optimises a proxy of the cost model, and a proxy can misjudge: under a
calibrated cost model, or on a workload where balancing buys nothing, a simpler choice of the
same stage is faster. So after placement and packing the planner scores a few candidates with
the simulator every comparison is judged by, and keeps the fastest:

* **packing**: the policy's own rows and layout, and verl's Karmarkar-Karp packing (`kk`), each
  under the chosen placement;
* **placement** (where the policy's placement is ``routepack``): its placement, and the one in
  force (``previous``; Megatron's static one on a first window), which moves nothing and holds
  no redundant copies, so its step pays no migration and no once-per-step sum of redundant
  experts' gradients. Probed only where those two parts of the first probe's step reach
  `PROBE_PLACEMENT_AT` of it, and where the placement in force's imbalance over the whole
  window (`window_imbalance`, a lower bound of what its microbatches see) costs the first
  probe's expert and all-to-all time less than twice those parts (elsewhere it cannot win).

The probes run without replication (a candidate's copies are planned once it is chosen). Where
the runner-up packing scores within `REPLICATE_BOTH_WITHIN` of the winner, both are replicated
and scored again, since copies can close a gap of that size. Ties keep the policy's own choice.
Every probe is one `simulate` call over the window, of the step time and its parts only (no lower
bound: `score`'s ``step_only``): at ``flash`` about 0.1 CPU-seconds each.
``plan.report["choice"]`` records the candidates' step times and what was kept.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from routepack import _core
from routepack.plan import MIGRATION_DTYPE, MIGRATION_FIELDS, Placement, Plan, empty_migration, empty_replicas
from routepack.oversize import oversize_mode
from routepack.simulate import score

#: A placement candidate other than the policy's own is probed only where the policy
#: placement's migration and redundant-gradient sum reach this fraction of the probe's step.
PROBE_PLACEMENT_AT = 0.0025
#: Where the runner-up packing's probe is within this fraction of the winner's, both are
#: replicated and scored again.
REPLICATE_BOTH_WITHIN = 0.02

#: A packing result: (sample_rank [S], sample_micro [S], num_micro, report).
Packing = Tuple[np.ndarray, np.ndarray, int, Dict[str, Any]]


def migration_rows(previous: Optional[Placement], placement: Placement, topo: Any, cost: Any) -> np.ndarray:
    """The migration table from ``previous`` to ``placement`` (empty without one)."""
    if previous is None:
        return empty_migration()
    cols = _core.migration_diff(
        previous.phy2log,
        placement.phy2log,
        placement.num_experts,
        placement.slots_per_rank,
        cost.expert_state_bytes,
        min(topo.domain, topo.ep),
    )
    rows = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
    for name, col in zip(MIGRATION_FIELDS, cols):
        rows[name] = col
    return rows


def window_imbalance(window: Any, placement: Placement, topo: Any) -> float:
    """Max over EP ranks / mean of the window's expert tokens under ``placement`` (an expert's
    load split evenly over its slots), averaged over layers: the imbalance of the window taken
    as one exchange, at most what its microbatches see."""
    loads = window.counts.sum(axis=0, dtype=np.int64).astype(np.float64)  # [L, E]
    p2l = placement.phy2log  # [L, slots]
    counts = placement.logcnt.astype(np.float64)
    per_slot = np.where(p2l >= 0, np.take_along_axis(loads / np.maximum(counts, 1), np.maximum(p2l, 0), 1), 0.0)
    ranks = per_slot.reshape(p2l.shape[0], topo.ep, -1).sum(-1)
    mean = ranks.mean(-1)
    return float(np.mean(np.where(mean > 0, ranks.max(-1) / np.maximum(mean, 1e-300), 1.0)))


def _score(ctx: Any, placement: Placement, packing: Packing, replicas: np.ndarray, timing: str) -> Any:
    rank, micro, m, _ = packing
    mig = migration_rows(ctx.previous, placement, ctx.topo, ctx.cost)
    plan = Plan(placement, rank, micro, m, replicas, mig, replica_timing=timing)
    # the request's checked arguments: scored without checking them again
    # the step time and its parts are all a probe reads: no lower bound (half a simulate's pass)
    return score(
        plan, ctx.window, ctx.topo, ctx.cost, ctx.token_cap, oversize=oversize_mode(ctx.oversize), step_only=True
    )


def choose(
    ctx: Any,
    policy: Any,
    placement: Placement,
    packing: Packing,
    others: Dict[str, Callable[[Placement], Packing]],
    fallback: Callable[[], Placement],
    replicate: Callable[[Placement, Packing], np.ndarray],
    timing: str,
) -> Tuple[Placement, Packing, Optional[np.ndarray], Dict[str, Any]]:
    """The fastest (placement, packing) of the candidates, and its replicas where they were
    planned here (else None: the caller replicates it).

    ``packing`` is the policy's own packing under ``placement``; ``others`` makes each other
    candidate packing under a placement; ``fallback`` gives the placement in force (or the
    static one); ``replicate`` plans the policy's copies of a candidate."""
    report: Dict[str, Any] = {"probes": {}}
    none = empty_replicas()
    made: Dict[Tuple[str, str], Packing] = {("own", "policy"): packing}
    scores: Dict[Tuple[str, str], float] = {}

    def probe(place_name: str, place: Placement, pack_name: str) -> float:
        key = (pack_name, place_name)
        if key not in made:
            made[key] = others[pack_name](place) if pack_name in others else made[("own", "policy")]
        if key not in scores:
            sim = _score(ctx, place, made[key], none, timing)
            scores[key] = sim.step_time
            report["probes"][f"{place_name}+{pack_name}"] = sim.step_time
            if place_name == "policy" and pack_name == "own":
                report["overheads"] = (sim.migration + sim.redundant_grads) / max(sim.step_time, 1e-300)
                first.update(overhead_s=sim.migration + sim.redundant_grads, balanced_s=sim.expert + sim.all_to_all)
        return scores[key]

    first: Dict[str, float] = {}
    probe("policy", placement, "own")
    chosen_place, place_name = placement, "policy"
    if policy.placement == "routepack" and report["overheads"] >= PROBE_PLACEMENT_AT:
        other = fallback()
        # what the placement in force loses to imbalance, at the window's loads (a lower bound
        # of what each microbatch sees): where it exceeds twice the overheads, it cannot win
        excess = window_imbalance(ctx.window, other, ctx.topo) - 1.0
        report["in_force_imbalance"] = 1.0 + excess
        if other != placement and excess * first["balanced_s"] < 2.0 * first["overhead_s"]:
            # the placement in force is probed with the policy's own rows (valid under any placement)
            if probe("in_force", other, "own") < scores[("own", "policy")]:
                chosen_place, place_name = other, "in_force"
    names: List[str] = ["own", *others]
    for n in names:
        probe(place_name, chosen_place, n)
    ranked = sorted(names, key=lambda n: (scores[(n, place_name)], names.index(n)))
    best = ranked[0]
    report.update(placement=place_name, packing=best)
    replicas: Optional[np.ndarray] = None
    runner = ranked[1] if len(ranked) > 1 else None
    if runner is not None and scores[(runner, place_name)] <= scores[(best, place_name)] * (1 + REPLICATE_BOTH_WITHIN):
        full: Dict[str, Tuple[float, np.ndarray]] = {}
        for n in (best, runner):
            reps = replicate(chosen_place, made[(n, place_name)])
            full[n] = (_score(ctx, chosen_place, made[(n, place_name)], reps, timing).step_time, reps)
            report["probes"][f"{place_name}+{n}+replicated"] = full[n][0]
        best = min((best, runner), key=lambda n: (full[n][0], names.index(n)))
        replicas = full[best][1]
        report["packing"] = best
    rank, micro, m, pack_report = made[(best, place_name)]
    if best != "own":
        # the chosen packing's report, with the row count's lower bound and certificate the
        # policy's own packing computed (they bound every packing's rows)
        own = made[("own", "policy")][3]
        pack_report = {**pack_report, "chosen": best, "own": own}
        bound = own.get("rows_lower_bound")
        if isinstance(bound, dict) and "rows" in bound:
            rows = ctx.topo.dp * m
            pack_report.update(rows_lower_bound=bound, certified=rows == bound["rows"], gap=rows - bound["rows"])
    return chosen_place, (rank, micro, m, pack_report), replicas, report


def choose_stages(
    ctx: Any,
    policy: Any,
    placement: Placement,
    packing: Packing,
    replicate_on: Callable[[Placement, np.ndarray, np.ndarray, int], np.ndarray],
    timing: str,
) -> Tuple[Placement, Packing, Optional[np.ndarray], Dict[str, Any]]:
    """`choose` with the registered stages: verl's ``kk`` the other packing (where the policy's
    is not it), the placement in force or Megatron's ``static`` the other placement;
    ``replicate_on(placement, sample_rank, sample_micro, num_micro)`` the policy's replication."""
    from routepack.stages.options import NoOptions
    from routepack.stages.registry import PACKINGS, PLACEMENTS

    others: Dict[str, Callable[[Placement], Packing]] = {}
    if policy.packing != "kk":
        others["kk"] = lambda place: PACKINGS["kk"].run(ctx, NoOptions(), place)

    def fallback() -> Placement:
        return ctx.previous if ctx.previous is not None else PLACEMENTS["static"].run(ctx, NoOptions())

    def replicate(place: Placement, p: Packing) -> np.ndarray:
        return replicate_on(place, p[0], p[1], p[2])

    return choose(ctx, policy, placement, packing, others, fallback, replicate, timing)


__all__ = [
    "PROBE_PLACEMENT_AT",
    "REPLICATE_BOTH_WITHIN",
    "choose",
    "choose_stages",
    "migration_rows",
    "window_imbalance",
]
