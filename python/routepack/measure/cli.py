"""``routepack measure``: the measured run's subcommand (registered by `routepack.cli`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, List, Optional

from routepack.errors import RoutepackError


def run(args: argparse.Namespace) -> int:
    """Calibrates (or loads ``--cost``), plans, executes and prints measured vs predicted."""
    import importlib

    from routepack._cliargs import load_cost
    from routepack.tables import fill
    from routepack.measure.report import format_table, parts_table, rank_mean_table
    from routepack.measure.workload import Workload

    # the package's `measure` (not the module's): a test may replace it there
    measure = importlib.import_module("routepack.measure").measure

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
        windows=args.windows,
        nodes=args.nodes,
    )
    cost = load_cost(args.cost) if args.cost else None
    try:
        result = measure(
            work,
            cost=cost,
            policies=policies(args.policy),
            overlap=args.overlap,
            warmup=args.warmup,
            repeats=args.repeats,
            quick=args.quick,
            progress=not args.quiet,
            calibration=args.calibration,
            profile=not args.no_profile,
        )
    except ImportError as e:
        raise RoutepackError(f"routepack measure needs torch ({e})") from None
    w = result.workload
    dense = "a_lin 0" if args.cost else "a_lin: the MoE layers' work at the origin rank"
    nodes = f" in {w.nodes} nodes" if w.nodes > 1 else ""
    print(
        f"measured run: {w.ranks} gloo ranks{nodes} (one core each), {w.layers} MoE layers of {w.experts} experts "
        f"top-{w.top_k}, H={w.hidden}, I={w.ffn}, {w.windows} window(s) of {w.samples} samples, popularity "
        f"{w.popularity:g}; times are each rank's CPU time, "
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
    print("\n".join(format_table(result) + parts_table(result) + rank_mean_table(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str))
        print(f"wrote {args.json}")
    from routepack.verdict import measure_verdict

    print(fill(measure_verdict(result.policies, result.calibration), indent="  "))
    return 0


def policies(given: Optional[List[str]]) -> List[str]:
    """The presets of ``--policy`` (repeated, or comma-separated), default static and routepack;
    an unknown name is refused before anything runs."""
    from routepack.policies import PRESETS

    names = [n.strip() for g in (given or ["static,routepack"]) for n in g.split(",") if n.strip()]
    for n in names:
        if n not in PRESETS:
            raise RoutepackError(f"--policy: invalid choice {n!r} (choose from {', '.join(PRESETS)})")
    return names


def check(args: argparse.Namespace) -> Optional[str]:
    """Why the options given do not go together, or None (`routepack.cli` asks before running)."""
    try:
        policies(args.policy)
    except RoutepackError as e:
        return str(e)
    if args.cost and args.quick:
        return "--quick does not apply with --cost (it shortens the calibration, which --cost replaces)"
    if args.cost and args.calibration:
        return "--cost and --calibration: give one (a cost model, or a calibration to reuse)"
    return None


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
        ("windows", 1),
        ("nodes", 1),
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
    p.add_argument(
        "--policy",
        action="append",
        metavar="PRESET[,PRESET...]",
        help="presets to run, repeated or comma-separated, e.g. routepack,eplb_oracle (default: static and "
        "routepack; static is always run, the speed-ups' reference)",
    )
    p.add_argument("--cost", default=None, help="a CostModel JSON to predict with (default: calibrate here first)")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="reuse the calibration in FILE (an earlier run of the same shapes wrote it), or calibrate and write "
        "it there when FILE does not exist",
    )
    p.add_argument("--no-profile", action="store_true", help="do not time each microbatch's parts")
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
