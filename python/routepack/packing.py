"""Packing stages: verl's `kk` baseline and routepack's certified rows + annealed layout.

Each function has the packing stage signature ``f(ctx, placement) -> (sample_rank [S] int32,
sample_micro [S] int32, num_micro, report dict)`` and is registered in ``PACKINGS``.
"""

from __future__ import annotations

from typing import Any, Dict

from routepack import _core
from routepack.policies import KNOWN_OPTIONS, PACKINGS, PackingResult, PlanContext

#: Default search budget of routepack's layout, in proposed moves over all chains. Sized so
#: a whole `routepack` plan of a `flash` window (placement, rows, layout, replication, the
#: final simulate) takes under 1 s on the 2-core reference machine: the anneal runs at about
#: 1M moves per CPU-second there (`cargo bench --bench packing`), so this is about 0.15 s of
#: wall time on two cores; `tiny` anneals 3x faster. Deterministic, unlike a wall-clock
#: budget. Quality rises slowly with more (benches/packing_quality.py prints the curve).
DEFAULT_ANNEAL_MOVES = 300_000

#: Options `plan_window(..., **options)` passes to routepack's packing, with their defaults.
ROUTEPACK_OPTIONS: Dict[str, Any] = {
    "anneal_chains": 2,  # population size (a chain per core on the 2-core reference machine)
    "anneal_steps": 24,  # temperature steps (resampling after each)
    "anneal_lambda": 0.1,  # weight of the mean EDP-shard cost next to the slowest one
    "anneal_start_accept": 0.1,  # acceptance of a typical worsening move at the start
    "anneal_cooling": 1e-3,  # final temperature / start temperature
    "anneal_mix": (0.25, 0.0, 0.65, 0.1),  # proposal weights: move, random swap, near-length swap, cell swap
    "exact_nodes": 200_000,  # node limit of the exact row search
}


def kk_packing(ctx: PlanContext, placement: Any) -> PackingResult:
    """verl: Karmarkar–Karp on 24576·n + n² over DP ranks (equal counts), microbatches per
    rank = ceil(tokens / cap) all-reduced to the max, repartitioned with one more on overflow,
    small microbatches at both ends. Report: rows, micro, first_micro, overflow_retries,
    max_row_tokens."""
    rank, micro, m, report = _core.pack_kk(ctx.window.seq_lens, int(ctx.token_cap), ctx.topo.dp)
    return rank, micro, m, dict(report)


def routepack_packing(ctx: PlanContext, placement: Any) -> PackingResult:
    """routepack: the fewest token-capped rows with a certificate, then the (DP rank, step)
    layout that minimises the slowest EDP shard's accumulated attention + expert + all-to-all
    cost under `placement`, by parallel population annealing.

    Report keys: rows, micro, rows_lower_bound {L1, L2, rows}, certified, gap, rows_method,
    bins, exact_nodes, layout_init, initial_cost / annealed_cost (proxy step time, s),
    moves (proposed), moves_evaluated, moves_accepted, chains, steps, stopped_by_time,
    anneal_history {temperature, best_cost, best_energy, mean_energy, accept_rate, moves}
    (one entry per temperature step), seconds {rows, proxy, init, anneal} (wall time).
    """
    opts = dict(ROUTEPACK_OPTIONS)
    opts.update({k: v for k, v in ctx.options.items() if k in ROUTEPACK_OPTIONS})
    moves = DEFAULT_ANNEAL_MOVES if ctx.anneal_moves is None else int(ctx.anneal_moves)
    rank, micro, m, report = _core.pack_routepack(
        ctx.window.seq_lens, ctx.window.expert_tokens, ctx.topo, ctx.cost, placement.phy2log,
        int(ctx.token_cap), seed=int(ctx.seed), anneal_moves=moves, time_budget_s=ctx.time_budget_s,
        chains=int(opts["anneal_chains"]), steps=int(opts["anneal_steps"]),
        exact_nodes=int(opts["exact_nodes"]), lambda_=float(opts["anneal_lambda"]),
        start_accept=float(opts["anneal_start_accept"]), cooling=float(opts["anneal_cooling"]),
        mix=tuple(float(x) for x in opts["anneal_mix"]),
    )
    report = dict(report)
    report["anneal_history"] = dict(report["anneal_history"])
    report["rows_lower_bound"] = dict(report["rows_lower_bound"])
    report["seconds"] = dict(report["seconds"])
    return rank, micro, m, report


KNOWN_OPTIONS.update(ROUTEPACK_OPTIONS)
PACKINGS["kk"] = kk_packing
PACKINGS["routepack"] = routepack_packing
