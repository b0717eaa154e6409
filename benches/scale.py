"""Plan time and memory of `plan_window` as the window grows (issue 18's table).

For each size: a synthetic window (seed 0, window 0) of a profile shaped as the size says,
planned once with the ``routepack`` policy (default budget, no `time_budget_s`) and, unless
``--no-baseline``, once with ``eplb_oracle``. Prints per size: the routepack call's wall and
CPU seconds (process CPU over the call, all threads), its stages (placement; packing's rows +
proxy; the layout's init + anneal; replication; the final simulate; the rest: validation and
the report), the simulated step time of the plan (a cost-model prediction), the eplb_oracle
wall time, the seconds to generate the window, and the process's peak RSS. Each size runs in
its own subprocess, so the peak RSS is that size's (window generation included: the dense
window is part of what a caller holds).

    python benches/scale.py                       # flash, flash_x2, flash_x4, dsv3
    python benches/scale.py --sizes kimi          # Kimi-K2-like: ~3 GB of dense demand
    python benches/scale.py --sizes flash --samples 4096 8192 16384 32768   # the S curve

``--samples`` overrides S (and DP, keeping S / DP) of every size chosen: the scaling curve.
On a loaded machine wall times include waiting for a core; CPU seconds do not.

``--out FILE`` keeps the run as JSON and ``--page PAGE`` writes its Markdown page from it
(`routepack.results`, with ``--note``s): docs/bench_scale.md is written that way, and its
first lines hold the command that renders it again from the JSON (tests/test_docs.py checks
it is not stale; tests/test_scale_bench.py that the bench writes what the renderer does)::

    python benches/scale.py --sizes flash flash_x2 flash_x4 dsv3 kimi --cache /tmp/scalecache \
        --out docs/bench_scale.json --page docs/bench_scale.md --note ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict


import routepack as rp
import routepack.planner as planner
from routepack import results
from routepack.stages import registry
from routepack.traces import PROFILES, Profile

_FLASH = PROFILES["flash"]
_DSV3 = Profile(
    name="dsv3",
    num_layers=58,
    num_experts=256,
    top_k=8,
    hidden=7168,
    expert_ffn=2048,
    attention=("full",) * 58,
    dp=256,
    ep=64,
    gpus_per_node=8,
    slots_per_rank=5,
    token_cap=65536,
    samples=8192,
    group_size=16,
    prompt_median=800.0,
    response_median=4000.0,
    max_response=32768,
)

#: name -> the profile of that size (flash's statistics; the models' public shapes).
SIZES: Dict[str, Profile] = {
    "tiny": PROFILES["tiny"],  # a smoke size (tests/test_scale_bench.py)
    "flash": _FLASH,
    "flash_x2": dataclasses.replace(_FLASH, name="flash_x2", samples=8192, dp=128),
    "flash_x4": dataclasses.replace(_FLASH, name="flash_x4", samples=16384, dp=256),
    "dsv3": _DSV3,
    "kimi": dataclasses.replace(
        _DSV3,
        name="kimi",
        num_layers=61,
        num_experts=384,
        attention=("full",) * 61,
        dp=512,
        ep=64,
        slots_per_rank=7,
        samples=32768,
    ),
}
DEFAULT_SIZES = ["flash", "flash_x2", "flash_x4", "dsv3"]


def plan_digest(plan: rp.Plan) -> str:
    """sha256 of the plan's bytes (`Plan.digest`): equal digests, equal plans."""
    return plan.digest()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_timed(fn: Any, stage: str, out: Dict[str, float]) -> Any:
    """`fn`, adding the process CPU seconds (all threads) of each call to ``out[stage]``."""

    def run(*a: Any, **k: Any) -> Any:
        c = _cpu()
        try:
            return fn(*a, **k)
        finally:
            out[stage] = out.get(stage, 0.0) + _cpu() - c

    return run


def measure(prof: Profile, baseline: bool, cache: str | None) -> Dict[str, Any]:
    """One size, in this process: the figures of one table row (`cache`: a folder where the
    window is kept as ``<size>-S<samples>.npz`` after its first generation)."""
    t0 = time.perf_counter()
    path = os.path.join(cache, f"{prof.name}-S{prof.samples}.npz") if cache else None
    if path and os.path.exists(path):
        window = rp.Window.load(path)
    else:
        window = next(rp.traces.synthetic(prof, 1, seed=0))
        if path:
            window.save(path)
    gen = time.perf_counter() - t0
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap

    sim_s = [0.0]
    stage_cpu: Dict[str, float] = {}
    real_simulate = planner.score  # the final validation + simulate (`routepack.simulate.score`)

    def timed_simulate(*a: Any, **k: Any) -> Any:
        t, c = time.perf_counter(), _cpu()
        out = real_simulate(*a, **k)
        sim_s[0] += time.perf_counter() - t
        stage_cpu["simulate"] = stage_cpu.get("simulate", 0.0) + _cpu() - c
        return out

    planner.score = timed_simulate
    saved = {}
    for stage, table, choice in (
        ("placement", registry.PLACEMENTS, "routepack"),
        ("packing", registry.PACKINGS, "routepack"),
        ("replication", registry.REPLICATIONS, "routepack"),
    ):
        saved[stage] = (table, choice, table[choice])
        table[choice] = table[choice]._replace(run=_cpu_timed(table[choice].run, stage, stage_cpu))
    c0, t0 = _cpu(), time.perf_counter()
    plan = rp.plan_window(window, topo, cost, cap, "routepack")
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    planner.score = real_simulate
    for table, choice, entry in saved.values():
        table[choice] = entry
    st = plan.report["stage_seconds"]
    ps = plan.report["packing"]["seconds"]
    row = {
        "size": prof.name,
        "S": window.num_samples,
        "L": window.num_layers,
        "E": window.num_experts,
        "dp": prof.dp,
        "ep": prof.ep,
        "wall": wall,
        "cpu": cpu,
        "placement": st["placement"],
        "rows": ps["rows"] + ps["proxy"],
        "layout": ps["init"] + ps["anneal"],
        "replication": st["replication"],
        "simulate": sim_s[0],
        "cpu_stages": stage_cpu,
        "rest": st["total"] - st["placement"] - st["packing"] - st["replication"] - sim_s[0],
        "step_time": plan.report["predicted"]["step_time"],
        "replicas": len(plan.replicas),
        "digest": plan_digest(plan)[:12],
        "gen": gen,
    }
    del plan
    if baseline:
        t0 = time.perf_counter()
        rp.plan_window(window, topo, cost, cap, "eplb_oracle")
        row["eplb_oracle"] = time.perf_counter() - t0
    # ru_maxrss is in KiB on Linux
    row["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=sorted(SIZES))
    ap.add_argument(
        "--samples", nargs="+", type=int, default=None, help="override S (DP scales with it) for each size chosen"
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the eplb_oracle plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row as well")
    ap.add_argument(
        "--out",
        default=None,
        help="also write the run (command, rows) as JSON to this file; python -m routepack.results scale renders it",
    )
    ap.add_argument("--page", default=None, help="with --out: also write the run's Markdown page to this file")
    ap.add_argument("--note", action="append", default=[], help="with --page: a note to put on the page (repeatable)")
    ap.add_argument("--cache", help="folder to keep generated windows in and load them from (generation is slow)")
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if (args.page or args.note) and not args.out:
        ap.error("--page and --note need --out (the page is rendered from the run's JSON)")
    if args._one:
        prof = Profile(**json.loads(args._one))
        print(json.dumps(measure(prof, not args.no_baseline, args.cache)))
        return

    jobs = []
    for name in args.sizes:
        prof = SIZES[name]
        for s in args.samples or [prof.samples]:
            dp = max(1, prof.dp * s // prof.samples)
            jobs.append(dataclasses.replace(prof, name=name if s == prof.samples else f"{name}@{s}", samples=s, dp=dp))
    hdr = (
        f"{'size':12} {'S':>6} {'LxE':>8} {'dp/ep':>7} {'wall s':>7} {'cpu s':>6}  {'place':>6} {'rows':>6} "
        f"{'layout':>6} {'repl':>6} {'sim':>6} {'rest':>6}  {'step s':>8} {'eplb_o s':>8} {'gen s':>6} "
        f"{'RSS GB':>6} digest"
    )
    print(hdr)
    rows, load_start = [], os.getloadavg()
    for prof in jobs:
        fields = {f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)}
        fields["attention"] = list(fields["attention"])
        fields["layer_skew"] = list(fields["layer_skew"])
        cmd = (
            [sys.executable, __file__, "--_one", json.dumps(fields)]
            + (["--no-baseline"] if args.no_baseline else [])
            + (["--cache", args.cache] if args.cache else [])
        )
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            print(f"{prof.name:12} failed (rc {out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        eo = f"{r['eplb_oracle']:8.2f}" if "eplb_oracle" in r else f"{'-':>8}"
        print(
            f"{r['size']:12} {r['S']:6d} {r['L']:>3}x{r['E']:<4} {r['dp']:>3}/{r['ep']:<3} {r['wall']:7.2f} "
            f"{r['cpu']:6.2f}  {r['placement']:6.2f} {r['rows']:6.2f} {r['layout']:6.2f} {r['replication']:6.2f} "
            f"{r['simulate']:6.2f} {r['rest']:6.2f}  {r['step_time']:8.4f} {eo} {r['gen']:6.1f} {r['rss_gb']:6.2f} {r['digest']}",
            flush=True,
        )
        c = r["cpu_stages"]
        print(
            f"{'  (cpu s)':12} {'':6} {'':8} {'':7} {'':7} {'':6}  {c.get('placement', 0):6.2f} "
            f"{c.get('packing', 0):13.2f} {c.get('replication', 0):6.2f} {c.get('simulate', 0):6.2f}",
            flush=True,
        )
        if args.json:
            print(json.dumps(r), flush=True)
    if args.out:
        command = "python benches/scale.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        run = {"command": command, "routepack": rp.__version__, "loadavg": [load_start, os.getloadavg()], "rows": rows}
        with open(args.out, "w") as f:
            json.dump(run, f, indent=2)
        print(f"wrote {args.out}")
    if args.page:
        page = Path(args.page)
        page.write_text(results.render("scale", [args.out], page, notes=args.note), encoding="utf-8")
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
