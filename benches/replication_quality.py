"""Replication quality and planner time on the synthetic profiles.

For each profile, plans successive windows with static placement and sequential packing,
varying only the replication stage (none, hot_n, relibra, routepack), plus ReLibra's
per-window node-level reordering placement (with and without replication). Every plan is
scored by `routepack.simulate`; the table gives, per policy, the median over windows of the
simulated throughput relative to static/none (min and max in brackets), the fraction of the
ideal bound, the mean expert imbalance (max/mean over EP ranks per (group, micro, layer)),
replicas per cell, the median wall time of the replication stage (plan_window's
stage_seconds) and its CPU time (all threads), and the median step-time parts of the
slowest group (all-to-all, expert, exposed replication, exposed migration), in seconds.

    python benches/replication_quality.py --profiles tiny flash --windows 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import routepack as rp
from routepack.stages import REPLICATIONS, register_replication

#: CPU seconds (all threads) of the last replication stage call, next to plan_window's
#: wall-clock stage time: on a shared machine wall time includes waiting for a core.
_cpu = {"s": 0.0}


def _timed(stage):
    def run(*args, **kwargs):
        c0 = time.process_time()
        try:
            return stage(*args, **kwargs)
        finally:
            _cpu["s"] = time.process_time() - c0

    return run


def timed_replication(name: str) -> str:
    """The name of replication ``name`` wrapped in a CPU timer, registered on first use (the
    built-in choice stays as it is)."""
    timed = f"timed_{name}"
    if timed not in REPLICATIONS:
        stage = REPLICATIONS[name]
        register_replication(timed, _timed(stage.run), stage.options)
    return timed


#: (label, placement, replication)
POLICIES = [
    ("static + none", "static", "none"),
    ("static + hot_n", "static", "hot_n"),
    ("static + relibra", "static", "relibra"),
    ("static + routepack", "static", "routepack"),
    ("relibra-place + none", "relibra", "none"),
    ("relibra-place + relibra", "relibra", "relibra"),
    ("relibra-place + routepack", "relibra", "routepack"),
]


def run_profile(name: str, windows: int, seed: int, options: dict) -> list:
    prof = rp.traces.profile(name)
    topo, cost = prof.topology(), prof.cost()
    results = {label: [] for label, _, _ in POLICIES}
    previous = {label: None for label, _, _ in POLICIES}
    for wi, window in enumerate(rp.traces.synthetic(name, windows, seed)):
        t0 = time.perf_counter()
        for label, placement, replication in POLICIES:
            pol = rp.Policy(placement, "sequential", timed_replication(replication))
            # ReLibra reorders per window from the placement in force (migration is charged)
            prev = previous[label] if placement == "relibra" else None
            p = rp.plan_window(window, topo, cost, prof.token_cap, policy=pol, previous=prev, seed=seed, **options)
            previous[label] = p.placement
            s = p.report["predicted"]
            cells = topo.num_groups * p.num_micro * window.num_layers
            results[label].append(
                {
                    "throughput": s["throughput"],
                    "fraction_of_ideal": s["fraction_of_ideal"],
                    "imbalance": s["mean_imbalance"],
                    "rows_per_cell": len(p.replicas) / cells,
                    "replication_s": p.report["stage_seconds"]["replication"],
                    "replication_cpu": _cpu["s"],
                    "all_to_all": s["all_to_all"],
                    "expert": s["expert"],
                    "replication": s["replication"],
                    "migration": s["migration"],
                    "cross_node_kb": s["cross_node_bytes_per_token"] / 1e3,
                }
            )
        print(f"  {name} window {wi}: {time.perf_counter() - t0:.1f} s", flush=True)
    base = [r["throughput"] for r in results["static + none"]]
    rows = []
    for label, _, _ in POLICIES:
        rs = results[label]
        rel = [r["throughput"] / b for r, b in zip(rs, base)]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        rows.append(
            (
                label,
                statistics.median(rel),
                min(rel),
                max(rel),
                med("fraction_of_ideal"),
                med("imbalance"),
                med("rows_per_cell"),
                med("replication_s"),
                med("replication_cpu"),
                med("all_to_all"),
                med("expert"),
                med("replication"),
                med("migration"),
                med("cross_node_kb"),
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=["tiny", "flash"])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--replication-slots",
        "--replica-slots",
        dest="replication_slots",
        type=int,
        default=None,
        help="relibra/routepack copies per rank (default: the core's, 2)",
    )
    ap.add_argument(
        "--replication-hot-experts",
        "--hot-experts",
        dest="replication_hot_experts",
        type=int,
        default=None,
        help="hot_n's N (default: the core's, 3)",
    )
    args = ap.parse_args()
    options = {}
    for name in ("replication_slots", "replication_hot_experts"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    print(
        f"routepack {rp.__version__}, {os.cpu_count()} CPUs, RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'default')}, "
        f"options {options or 'defaults'}"
    )
    for name in args.profiles:
        rows = run_profile(name, args.windows, args.seed, options)
        print(
            f"\n{name}: {args.windows} windows, seed {args.seed}; throughput relative to static + none, median [min, max]"
        )
        print(
            f"{'policy':27s} {'throughput':>22s} {'of ideal':>8s} {'imbal':>6s} {'rows/cell':>9s} {'repl s':>7s} {'cpu s':>6s} "
            f"{'a2a s':>7s} {'expert s':>8s} {'repl exp s':>10s} {'migr s':>7s} {'xnode kB/tok':>12s}"
        )
        for label, rel, lo, hi, ideal, imb, rpc, rs, cpu, a2a, ex, rep, mig, xnode in rows:
            print(
                f"{label:27s} {rel:8.4f} [{lo:.4f}, {hi:.4f}] {ideal:8.3f} {imb:6.3f} {rpc:9.2f} {rs:7.3f} {cpu:6.3f} "
                f"{a2a:7.2f} {ex:8.2f} {rep:10.4f} {mig:7.3f} {xnode:12.2f}"
            )


if __name__ == "__main__":
    main()
