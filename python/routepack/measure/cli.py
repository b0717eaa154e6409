"""``routepack measure``: the measured run's subcommand (registered by `routepack.cli`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from routepack.errors import RoutepackError


def run(args: argparse.Namespace) -> int:
    """Calibrates (or loads ``--cost``), plans, executes and prints measured vs predicted."""
    from routepack._cliargs import load_cost
    from routepack.measure.run import format_table, measure
    from routepack.measure.workload import Workload

    work = Workload(
        ranks=args.ranks,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        ffn=args.ffn,
        slots_per_rank=args.slots_per_rank,
        samples=args.samples,
        micro=args.micro,
        seed=args.seed,
        popularity=args.popularity,
    )
    cost = load_cost(args.cost) if args.cost else None
    try:
        result = measure(
            work,
            cost=cost,
            policies=args.policy or ("static", "routepack"),
            overlap=args.overlap,
            warmup=args.warmup,
            repeats=args.repeats,
            quick=args.quick,
            progress=not args.quiet,
        )
    except ImportError as e:
        raise RoutepackError(f"routepack measure needs torch ({e})") from None
    w = result.workload
    dense = "a_lin 0" if args.cost else "a_lin: the MoE layers' work at the origin rank"
    print(
        f"measured run: {w.ranks} gloo ranks (one core each), {w.layers} MoE layers of {w.experts} experts "
        f"top-{w.top_k}, H={w.hidden}, I={w.ffn}, {w.samples} samples; times are each rank's CPU time, "
        f"the slowest rank's; predictions: routepack.simulate with the "
        f"{'given' if args.cost else 'calibrated'} cost model (overlap={args.overlap}, no attention; {dense})"
    )
    if result.calibration:
        for kind, fit in result.calibration.items():
            err = fit["max_rel_error"]
            bound = fit.get("call_curve_bound")
            print(
                f"  calibrated {kind}: held-out max rel. error "
                f"{'n/a' if err is None else f'{100 * err:.1f}%'}"
                + ("" if bound is None else f" (no cost-model curve fits every point within {100 * bound:.1f}%)")
            )
    print("\n".join(format_table(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


def add_parser(sub: Any, count: Any) -> None:
    """Adds ``measure`` to the subcommands ``sub``; ``count(lo)`` is the CLI's int-type check."""
    from routepack.measure.workload import Workload

    d = Workload()
    helptext = (
        "execute the MoE layers of static and routepack plans for real (routepack.torch, local gloo "
        "processes) and compare measured with predicted times and speed-ups (needs torch)"
    )
    p = sub.add_parser("measure", help=helptext, description=helptext)
    for name, lo in (
        ("ranks", 2),
        ("layers", 1),
        ("experts", 1),
        ("top_k", 1),
        ("hidden", 1),
        ("ffn", 1),
        ("slots_per_rank", 1),
        ("samples", 1),
        ("micro", 1),
        ("seed", 0),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=count(lo),
            default=getattr(d, name),
            help=f"workload {name} (default %(default)s)",
        )
    p.add_argument(
        "--popularity",
        type=float,
        default=d.popularity,
        help="Dirichlet concentration of expert popularity, lower is more skewed (default %(default)s)",
    )
    p.add_argument("--policy", action="append", metavar="PRESET", help="presets (default: static and routepack)")
    p.add_argument("--cost", default=None, help="a CostModel JSON to predict with (default: calibrate here first)")
    p.add_argument(
        "--overlap",
        choices=("none", "dispatch_combine"),
        default="none",
        help="the predictions' overlap (the run overlaps nothing; default %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="calibrate with the smoke sweeps")
    p.add_argument("--warmup", type=count(0), default=1, help="untimed steps per plan (default %(default)s)")
    p.add_argument(
        "--repeats",
        type=count(1),
        default=5,
        help="timed steps per plan (the median CPU time is kept, the drift divided out; default %(default)s)",
    )
    p.add_argument("--json", default=None, help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)
