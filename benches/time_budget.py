"""Wall time of `plan_window` under `time_budget_s`, against the budget.

For each profile (its own topology, cost model and token cap, window 0 of seed 0) and each
budget (and once without), plans the window `--repeats` times with the ``routepack`` policy
and prints the median wall time of the call, its ratio to the budget, the simulated step time
of the plan, whether it passed `Plan.validate`, and the median seconds of each stage (the
budget's shares are in ``plan.report["budget"]``). On a loaded machine wall times include
waiting for a core.

    python benches/time_budget.py --profiles tiny flash --budgets 0.05 0.2 0.5 1.0
"""

from __future__ import annotations

import argparse
import statistics
import time

import routepack as rp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=["tiny", "flash"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.05, 0.2, 0.5, 1.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="routepack")
    args = ap.parse_args()
    print(
        f"{'profile':8} {'budget s':>8} {'wall s':>7} {'wall/b':>6} {'step_time s':>11} {'valid':>5}  "
        f"{'placement':>9} {'packing':>7} {'replic.':>7} {'end':>6} {'xnode kB/tok':>12}  replicas"
    )
    for name in args.profiles:
        prof = rp.traces.profile(name)
        window = next(rp.traces.synthetic(name, 1, seed=0))
        topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
        for budget in [None, *args.budgets]:
            walls, stages, plan = [], [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = rp.plan_window(window, topo, cost, cap, args.policy, time_budget_s=budget)
                walls.append(time.perf_counter() - t0)
                stages.append(plan.report["stage_seconds"])
            assert plan is not None
            try:
                plan.validate(window, topo, cap)
                valid = "yes"
            except rp.RoutepackError:
                valid = "NO"
            wall = statistics.median(walls)
            med = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
            end = med["total"] - med["placement"] - med["packing"] - med["replication"]
            ratio = f"{wall / budget:6.2f}" if budget else f"{'-':>6}"
            step = plan.report["predicted"]["step_time"]
            label = f"{budget:8g}" if budget else f"{'none':>8}"
            print(
                f"{name:8} {label} {wall:7.3f} {ratio} {step:11.4f} {valid:>5}  {med['placement']:9.3f} "
                f"{med['packing']:7.3f} {med['replication']:7.3f} {end:6.3f} "
                f"{plan.report['predicted']['cross_node_bytes_per_token'] / 1e3:12.2f}  {len(plan.replicas)}"
            )


if __name__ == "__main__":
    main()
