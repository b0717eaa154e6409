#!/usr/bin/env python
"""The measured run's acceptance series: for each workload, N runs of `routepack measure`
(static, routepack and eplb_oracle over 3 windows whose plans migrate experts, hold redundant
ones and fill replicas), each run's measured and predicted speed-ups of routepack over static
and over eplb_oracle, and the summary the acceptance asks for: how many runs land within 10%
of the prediction, and whether routepack measured faster wherever the prediction says > 1.05.

    python benches/measure_series.py --runs 5 --out series        # every workload, ~1 h on 2 free cores
    python benches/measure_series.py --only r2_p01 --runs 2 --quick  # a short look

Each workload's shapes are calibrated once (``--out/cal_<ranks>r.json``, the measured run's
full calibration unless ``--quick``) and every run of it predicts with that calibration, so the
runs differ by the machine's noise only. Every run records the 1-minute load average before
and after (``os.getloadavg``): a figure taken while other work shares the cores is noisy, and
the table says so. Writes ``--out/series.json`` (every run's `Measurement`, trimmed) and
``--out/series.md`` (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

#: name -> Workload fields: 2 ranks at three popularities, 4 ranks as 2 nodes of 2
WORKLOADS: Dict[str, Dict[str, Any]] = {
    "r2_p01": {"ranks": 2, "popularity": 0.1},
    "r2_p02": {"ranks": 2, "popularity": 0.2},
    "r2_p03": {"ranks": 2, "popularity": 0.3},
    "r4n2_p02": {"ranks": 4, "nodes": 2, "slots_per_rank": 5, "popularity": 0.2},
}
POLICIES = ("static", "routepack", "eplb_oracle")
#: the acceptance: measured within this share of the prediction, in at least `NEEDED` of 5 runs
TOLERANCE = 0.10
NEEDED = 4


def load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def one_run(work: Any, calibration: Path, quick: bool, repeats: int) -> Dict[str, Any]:
    from routepack.measure import measure

    before, t0 = load(), time.time()
    res = measure(work, policies=POLICIES, quick=quick, repeats=repeats, progress=False, calibration=calibration)
    rp = res.policies["routepack"]
    out = {
        "load_before": before,
        "load_after": load(),
        "seconds": time.time() - t0,
        "speedups": {ref: rp["speedups"][ref] for ref in ("static", "eplb_oracle")},
        "steps": {n: {"measured": r["step_s"], "predicted": r["predicted_step_s"]} for n, r in res.policies.items()},
        "plans": {
            n: [
                {
                    k: w[k]
                    for k in ("migration_rows", "replicas", "redundant_slots", "migration_s", "predicted_migration_s")
                }
                for w in r["windows"]
            ]
            for n, r in res.policies.items()
        },
    }
    return out


def summary(name: str, runs: List[Dict[str, Any]]) -> List[str]:
    rows = []
    for ref in ("static", "eplb_oracle"):
        got = [r["speedups"][ref] for r in runs]
        within = sum(abs(s["rel_error"]) <= TOLERANCE for s in got)
        must = [s for s in got if s["predicted"] > 1.05]
        faster = sum(s["measured"] > 1.0 for s in must)
        cells = " ".join(f"{s['measured']:.3f}/{s['predicted']:.3f}" for s in got)
        rows.append(
            f"| {name} | {ref} | {cells} | {within}/{len(got)} within {TOLERANCE:.0%} "
            f"({'pass' if within >= min(NEEDED, len(got)) else 'MISS'}) | "
            + (f"{faster}/{len(must)} faster where predicted > 1.05" if must else "prediction <= 1.05 in every run")
            + " | "
            + " ".join("%.1f-%.1f" % (r["load_before"], r["load_after"]) for r in runs)
            + " |"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per plan and window")
    ap.add_argument("--quick", action="store_true", help="calibrate with the smoke sweeps")
    ap.add_argument("--only", default=None, help="comma-separated workload names (%s)" % ", ".join(WORKLOADS))
    ap.add_argument("--out", default="measure_series")
    args = ap.parse_args()
    from routepack.measure import Workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(WORKLOADS)
    doc: Dict[str, Any] = {"tolerance": TOLERANCE, "policies": POLICIES, "workloads": {}}
    table = [
        "| workload | over | speed-up measured/predicted, per run | within 10% | faster where predicted > 1.05 | "
        "load (1 min) before-after |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        work = Workload(windows=3, **WORKLOADS[name])
        calibration = out / f"cal_{work.ranks}r{'_quick' if args.quick else ''}.json"
        runs = []
        for i in range(args.runs):
            runs.append(one_run(work, calibration, args.quick, args.repeats))
            r = runs[-1]["speedups"]
            print(
                f"{name} run {i}: over static {r['static']['measured']:.3f} measured, {r['static']['predicted']:.3f} "
                f"predicted; over eplb_oracle {r['eplb_oracle']['measured']:.3f} / {r['eplb_oracle']['predicted']:.3f}"
                f" (load {runs[-1]['load_before']:.1f}-{runs[-1]['load_after']:.1f})",
                flush=True,
            )
        doc["workloads"][name] = {"workload": WORKLOADS[name], "runs": runs}
        table += summary(name, runs)
        (out / "series.json").write_text(json.dumps(doc, indent=2))
    (out / "series.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
