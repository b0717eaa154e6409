"""`routepack` command line.

* ``routepack demo``: plans a few synthetic windows with every policy and prints how each
  would fare (step time from `simulate`, throughput relative to ``static`` and to the best
  baseline). Its first line points to its last, the verdict (`routepack.verdict`): routepack
  against the best baseline, and whether that is worth turning on; ``bench`` ends the same way.
  ``--windows`` is at most `MAX_WINDOWS`.
* ``routepack bench``: the same over more windows (a built-in profile or your own windows
  saved as ``.npz``). It prints the tables; ``--json FILE`` also writes the results as JSON,
  ``--figure FILE`` a PNG (needs matplotlib: ``pip install ".[bench]"`` from a clone) and
  ``--results FILE`` a Markdown results page (`routepack.results`). No file is written unless
  asked for.
* ``routepack bench --sweep``: every registered placement × packing × replication instead of
  the presets (`routepack.sweep`), sorted by step time, the ``routepack`` preset marked
  (``--placements``/``--packings``/``--replications`` narrow it; no figure).
* ``routepack calibrate``: measures the cost model's coefficients on this machine with torch
  (`routepack.calibrate`) and writes the calibrated ``CostModel`` JSON, a report JSON and a
  figure of measured vs predicted times (``pip install ".[torch]"``).
* ``routepack measure``: executes the MoE layers of ``static`` and ``routepack`` plans for real
  (`routepack.measure`, local gloo processes) and prints measured vs predicted times and speed-ups.
* ``--overlap dispatch_combine`` / ``--cost FILE`` (demo, bench, bench --sweep, measure): score
  with that cost model.

Progress goes to stderr: a bar on a terminal, plain lines otherwise (`routepack.progress`).
A user error (a bad argument, an unreadable ``--npz`` or ``--cost``, an option that does not
apply in the mode chosen, an input the planner refuses) prints one line on stderr and exits
with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import zipfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional, Tuple

from routepack import __version__, cli_setup, progress, traces, workloads
from routepack._cliargs import UsageError, count, load_cost, writable
from routepack.compare import (
    available_presets,
    baseline_notes,
    best_of,
    compare,
    format_ratios,
    format_table,
    ratios,
    summarise,
)
from routepack.errors import RoutepackError
from routepack.model import Topology
from routepack.oversize import OVERSIZE_MODES
from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS
from routepack.sweep import combinations, format_sweep, sweep, sweep_policies
from routepack.tables import fill
from routepack.plan_figure import plan_pictures
from routepack.verdict import threshold_note, verdict
from routepack.window import Window
from routepack.workloads import WORKLOADS

FIGURE_HINT = 'pip install ".[bench]" from a clone, or pip install "routepack[bench]"'
#: Windows scored when ``--windows`` is not given.
DEFAULT_WINDOWS = {"demo": 2, "bench": 8}
#: The most windows ``--windows`` may ask for: each is planned with every preset and held in
#: memory (134 MB a window of ``flash``: 64 take 8.6 GB), and a median over 64 is steady.
MAX_WINDOWS = 64
#: The first line of demo and bench, so the line a user came for is found.
POINTER = "the last line is the verdict (routepack against the best baseline)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: ``routepack bench: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _oversize_note(args: argparse.Namespace) -> str:
    """The header's words for ``--oversize`` / ``--cp`` ("" without them)."""
    mode = getattr(args, "oversize", None)
    if mode is None:
        return ""
    return f", oversize={mode}" + (f" over cp={args.cp}" if mode == "split" else "")


def _load_windows(args: argparse.Namespace, prof: traces.Profile) -> List[Window]:
    t0 = time.perf_counter()
    windows: List[Window] = []
    if args.npz:
        bar = progress.bar(len(args.npz), "window", "loading .npz windows", not args.quiet)
        try:
            for path in args.npz:
                try:
                    windows.append(Window.load(path))
                except RoutepackError as e:
                    raise UsageError(f"--npz {path}: {e}") from None
                except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
                    why = f"missing array {e}" if isinstance(e, KeyError) else (str(e) or type(e).__name__)
                    raise UsageError(f"--npz {path}: not a routepack Window file ({why})") from None
                bar.update(1)
        finally:
            bar.close()
        src = f"{len(windows)} windows from .npz"
    else:
        n = args.windows + 1
        kind = f"{args.workload} ({WORKLOADS[args.workload]})" if getattr(args, "workload", None) else "synthetic"
        desc = f"generating {n} {kind} {prof.name} windows ({prof.samples} samples each)"
        bar = progress.bar(n, "window", desc, not args.quiet)
        made = (
            workloads.windows(prof, args.workload, n, args.seed)
            if getattr(args, "workload", None)
            else traces.synthetic(prof, n, args.seed)
        )
        try:
            for w in made:
                windows.append(w)
                bar.update(1)
        finally:
            bar.close()
        src = f"{len(windows)} {kind} windows"
    print(
        fill(
            f"profile {prof.name}: L={prof.num_layers}, E={prof.num_experts}, top-{prof.top_k}, "
            f"dp={prof.dp} ep={prof.ep} gpus/node={prof.gpus_per_node} slots/rank={prof.slots_per_rank}, "
            f"cap={getattr(args, 'token_cap', None) or prof.token_cap}{_oversize_note(args)}; {src} "
            f"({windows[0].num_samples} samples) in {time.perf_counter() - t0:.1f} s",
            indent="  ",
        ),
        flush=True,
    )
    return windows


def _json_safe(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _rows_json(rows: Iterable[Any]) -> List[Any]:
    return [{k: v for k, v in asdict(r).items() if k != "imbalance_map"} for r in rows]


def _bench_cost(args: argparse.Namespace, prof: Any) -> Any:
    """The cost model demo/bench (presets and sweep) score with: ``--cost`` or the profile's
    preset, ``--overlap`` applied."""
    cost = load_cost(args.cost) if args.cost else prof.cost()
    return replace(cost, overlap=args.overlap) if args.overlap else cost


def _cost_name(args: argparse.Namespace, prof: Any) -> str:
    base = f"{args.cost}" if args.cost else cli_setup.hardware_name(prof)
    return base + (f", overlap {args.overlap}" if args.overlap else "")


def _record(args: argparse.Namespace, prof: Any, windows: List[Window], cost: Any) -> Dict[str, Any]:
    """What every JSON and results page of a run says about the run itself."""
    return {
        "profile": prof.name,
        "command": "routepack " + " ".join(shlex.quote(a) for a in args.argv),
        "routepack": __version__,
        "seed": args.seed,
        "windows": max(len(windows) - 1, 0),
        "cost_model_name": _cost_name(args, prof),
        "cost_model": asdict(cost),
        # the cap and the oversize mode where the options set them (the profile's cap otherwise)
        **{k: getattr(args, k) for k in ("token_cap", "oversize", "cp") if getattr(args, k, None) is not None},
    }


def _write_outputs(args: argparse.Namespace, data: Dict[str, Any], paths: Dict[str, Optional[Path]], kind: str) -> None:
    """``--json`` and ``--results`` of a bench run (the figure is drawn by the caller)."""
    from routepack import results

    if paths["json"] is not None:
        paths["json"].write_text(json.dumps(_json_safe(data), indent=2))
        print(f"wrote {paths['json']}")
    if paths["results"] is not None:
        page = paths["results"]
        src = str(paths["json"]) if paths["json"] is not None else None
        clean = json.loads(json.dumps(_json_safe(data)))  # the page reads what the JSON holds
        if src is not None:
            fig = str(paths["figure"]) if kind in ("bench", "break_even") and paths.get("figure") is not None else None
            text = results.render(kind, [src], page, fig)
        else:
            pages = {"bench": results.bench_page, "sweep": results.sweep_page, "break_even": results.break_even_page}
            body = pages[kind](clean, page)
            text = results.header(data["command"]) + body
        page.write_text(text, encoding="utf-8")
        print(f"wrote {page}")


def _ticker(bar: Any) -> Callable[[str, int], None]:
    """`compare`'s progress callback: one plan done."""

    def tick(name: str, i: int) -> None:
        bar.set_postfix_str(f"window {i} {name}")
        bar.update(1)

    return tick


def _paths(args: argparse.Namespace) -> Dict[str, Optional[Path]]:
    """The files a bench run writes, checked before it plans anything."""
    return {
        "json": writable(args.json, "--json") if getattr(args, "json", None) else None,
        "results": writable(args.results, "--results") if getattr(args, "results", None) else None,
        "figure": writable(args.figure, "--figure") if getattr(args, "figure", None) else None,
        "trace": writable(args.trace, "--trace") if getattr(args, "trace", None) else None,
        "plan_figure": writable(args.plan_figure, "--plan-figure") if getattr(args, "plan_figure", None) else None,
    }


def _plan_args(args: argparse.Namespace, prof: traces.Profile) -> Tuple[Topology, int, Dict[str, Any]]:
    """(topology, token cap, plan_window options) of a bench run: the profile's, with the cap,
    the oversize mode and the context-parallel size the options give."""
    topo = prof.topology()
    if getattr(args, "cp", None) is not None:
        try:
            topo = replace(topo, cp=args.cp)
        except RoutepackError as e:
            raise UsageError(f"--cp {args.cp}: {e}") from None
    options: Dict[str, Any] = {}
    if args.anneal_moves is not None:
        options["anneal_moves"] = args.anneal_moves
    if getattr(args, "oversize", None) is not None:
        options["oversize"] = args.oversize
    cap = getattr(args, "token_cap", None)
    return topo, prof.token_cap if cap is None else cap, options


def _run_sweep(args: argparse.Namespace) -> int:
    """``routepack bench --sweep`` (and ``benches/sweep.py``)."""
    prof = cli_setup.run_profile(args, traces.profile(args.profile))
    paths = _paths(args)
    print(f"routepack bench --sweep: {POINTER}", flush=True)
    try:
        combos = combinations(args.placements, args.packings, args.replications, args.loads)
    except RoutepackError as e:
        raise UsageError(str(e)) from None
    cost = _bench_cost(args, prof)
    topo, cap, options = _plan_args(args, prof)
    windows = _load_windows(args, prof)
    policies = sweep_policies(combos)
    topo = cli_setup.board_topology(args, topo, windows[0].num_experts, [str(p) for p in policies] + ["moonep"])
    bar = progress.bar((len(windows) - 1) * len(policies), "plan", "sweep", not args.quiet)
    try:
        result = sweep(
            windows,
            topo,
            cost,
            cap,
            args.placements,
            args.packings,
            args.replications,
            loads=args.loads,
            seed=args.seed,
            progress=_ticker(bar),
            **options,
        )
    finally:
        bar.close()
    print()
    print(
        fill(
            f"sweep: {len(combos)} stage combinations (loads: {args.loads}) + the routepack preset and the "
            f"baselines where not among them; median over {len(windows) - 1} window(s), scored by "
            f"routepack.simulate (cost model: {_cost_name(args, prof)})"
        )
    )
    print()
    print(format_sweep(result))
    data = {
        **_record(args, prof, windows, cost),
        **{k: v for k, v in result.items() if k != "rows"},
        "rows": _rows_json(result["rows"]),
    }
    _write_outputs(args, data, paths, "sweep")
    preset = next(e["policy"] for e in result["entries"] if e["preset"])  # its rows' name in the sweep
    print()
    print(fill(threshold_note()))
    print(verdict(ratios(result["rows"], preset), ["routepack"], name="routepack"))
    return 0


def _run_break_even(args: argparse.Namespace) -> int:
    """``routepack bench --break-even`` (`routepack.break_even`)."""
    from routepack import break_even

    prof = cli_setup.run_profile(args, traces.profile(args.profile))
    paths = _paths(args)
    cost = _bench_cost(args, prof)
    topo = cli_setup.board_topology(args, prof.topology(), prof.num_experts, ("moonep", "ultraep"))
    n = len(break_even.TOKENS) * len(break_even.VIOS)
    bar = progress.bar(n, "cell", "break-even grid", not args.quiet)
    try:
        data = break_even.run(prof, topo, cost, seed=args.seed, progress=_ticker(bar))
    finally:
        bar.close()
    for v in data["vios"]:
        found = {p: break_even.break_even_tokens(data, p, v) for p in break_even.POLICIES}
        print(f"max_vio {v:g}: break-even tokens per rank " + ", ".join(f"{p} {t}" for p, t in found.items()))
    data = {**_record(args, prof, [], cost), **data}
    if paths["figure"] is not None:
        print(f"wrote {break_even.figure(data, str(paths['figure']), f'{prof.name}: per-microbatch copies')}")
    _write_outputs(args, data, paths, "break_even")
    return 0


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "sweep", False):
        return _run_sweep(args)
    if getattr(args, "break_even", False):
        return _run_break_even(args)
    prof = cli_setup.run_profile(args, traces.profile(args.profile))
    paths = _paths(args)
    print(f"routepack {args.command}: {POINTER}", flush=True)
    cost = _bench_cost(args, prof)
    topo, cap, options = _plan_args(args, prof)
    windows = _load_windows(args, prof)
    policies = args.policy or available_presets()
    topo = cli_setup.board_topology(args, topo, windows[0].num_experts, policies)
    baseline = "static" if "static" in policies else policies[0]
    bar = progress.bar((len(windows) - 1) * len(policies), "plan", args.command, not args.quiet)
    try:
        rows = compare(
            windows,
            topo,
            cost,
            cap,
            policies,
            seed=args.seed,
            progress=_ticker(bar),
            **options,
        )
    finally:
        bar.close()
    summary = summarise(rows, baseline)
    vs = ratios(rows)
    winners = best_of(rows)
    notes = baseline_notes(topo, windows[0].num_experts, cost.expert_groups, policies)
    print()
    print(
        fill(
            f"median over {len(windows) - 1} window(s), scored by routepack.simulate (cost model: "
            f"{_cost_name(args, prof)}):"
        )
    )
    print()
    print(format_table(summary, baseline))
    for note in notes:
        print()
        print(fill(note, indent="  "))
    if vs:
        print()
        print(format_ratios(vs, winners))
    data = {
        **_record(args, prof, windows, cost),
        "baseline": baseline,
        "summary": summary,
        "ratios": vs,
        "best_of": {str(w): p for w, p in winners.items()},
        "notes": notes,
        "figure": str(paths["figure"]) if paths["figure"] is not None else None,
        "rows": _rows_json(rows),
    }
    if paths["figure"] is not None:
        try:
            import matplotlib  # noqa: F401  (only to know whether the figure can be drawn)
        except ImportError:
            print(f"no figure: matplotlib is not installed ({FIGURE_HINT} for it)")
            data["figure"] = None
            paths["figure"] = None
        else:
            from routepack.figures import bench_figure

            path = bench_figure(
                rows,
                summary,
                paths["figure"],
                baseline=baseline,
                title=f"routepack bench: {prof.name}, {len(windows) - 1} windows",
            )
            print(f"wrote {path}")
    for path in plan_pictures(paths, windows, topo, cost, cap, policies, winners, args.seed, options, prof.name):
        print(f"wrote {path}")
    _write_outputs(args, data, paths, "bench")
    print()
    print(fill(threshold_note()))
    print(verdict(vs, policies))
    return 0


def _bench_parser(sub: Any, name: str, helptext: str) -> argparse.ArgumentParser:
    presets = available_presets()
    p = sub.add_parser(name, help=helptext, description=helptext)
    p.add_argument(
        "--profile",
        default="tiny",
        choices=sorted(traces.PROFILES),
        help="built-in profile: model, topology, cap (and the synthetic trace); choices: %(choices)s",
    )
    p.add_argument(
        "--windows",
        type=count(1),
        default=None,
        help=f"windows to score, at most {MAX_WINDOWS} (one more is generated first, for history; default "
        f"{DEFAULT_WINDOWS[name]}); not with --npz",
    )
    p.add_argument("--seed", type=count(0), default=0, help="trace and planner seed, >= 0 (default %(default)s)")
    p.add_argument(
        "--policy",
        action="append",
        choices=presets,
        metavar="PRESET",
        help="preset to include (repeatable; default: all; not with --sweep): " + ", ".join(presets),
    )
    p.add_argument("--npz", nargs="+", help="your own windows (Window.save files), in order; at least 2")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--anneal-moves",
        type=count(0),
        default=None,
        dest="anneal_moves",
        help="layout search budget in proposed moves (default: the core's)",
    )
    p.add_argument(
        "--overlap",
        choices=("none", "dispatch_combine"),
        default=None,
        help="the cost model's overlap (default: the cost model's own, none for the preset)",
    )
    p.add_argument("--cost", default=None, help="a CostModel JSON (default: the profile's hardware preset)")
    if name == "demo":
        return p
    cli_setup.add_arguments(p)
    p.add_argument(
        "--figure",
        default=None,
        help=f"also draw a PNG figure to this file (default: none; not with --sweep; needs matplotlib: {FIGURE_HINT})",
    )
    p.add_argument("--trace", help="also write routepack's simulated step per rank (last window) as a Chrome trace")
    p.add_argument(
        "--plan-figure",
        default=None,
        help="also draw the last window's plans of static, the best baseline and routepack to this PNG: tokens per "
        f"(layer, rank) and the simulated step per rank (default: none; needs matplotlib: {FIGURE_HINT})",
    )
    p.add_argument("--json", default=None, help="also write the results as JSON to this file (default: none)")
    p.add_argument(
        "--token-cap",
        type=count(1),
        default=None,
        dest="token_cap",
        help="tokens a microbatch may hold (default: the profile's); set it to your trainer's cap with --npz",
    )
    p.add_argument(
        "--oversize",
        choices=OVERSIZE_MODES,
        default=None,
        help="a sample longer than the cap: refuse it (the default), run it alone in a microbatch, or split it "
        "over a context-parallel group of --cp ranks",
    )
    p.add_argument(
        "--cp",
        type=count(2),
        default=None,
        help="with --oversize split: the context-parallel group size (a divisor of the profile's EP size)",
    )
    p.add_argument(
        "--results",
        default=None,
        help="also write a Markdown results page to this file (routepack.results; default: none)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="every placement x packing x replication instead of the presets (no figure)",
    )
    for flag, table in (("--placements", PLACEMENTS), ("--packings", PACKINGS), ("--replications", REPLICATIONS)):
        p.add_argument(
            flag,
            nargs="+",
            choices=list(table),
            default=None,
            metavar="NAME",
            help=f"with --sweep: only these {flag[2:]} (default: all): " + ", ".join(table),
        )
    p.add_argument(
        "--loads",
        choices=("window", "previous"),
        default=None,
        help="with --sweep: the loads every combination plans from (default: window, as the routepack preset does)",
    )
    return p


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="routepack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"routepack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, helptext in (
        ("demo", "plan a couple of synthetic windows with every policy and print a comparison"),
        (
            "bench",
            "benchmark every preset over successive windows and print the tables (--json, --figure, --results: "
            "also write them to files)",
        ),
    ):
        _bench_parser(sub, name, helptext).set_defaults(func=_run)
    from routepack.cli_calibrate import add_parser as _calibrate_parser

    _calibrate_parser(sub)
    from routepack.measure.cli import add_parser as _measure_parser

    _measure_parser(sub, count)
    return parser


def _check(args: argparse.Namespace) -> Optional[str]:
    """Why the options given do not go together (an option the mode chosen would not read), or None."""
    if args.command in ("demo", "bench"):
        if args.npz and len(args.npz) < 2:
            return "--npz needs at least 2 windows (the first only feeds history)"
        if args.npz and args.windows is not None:
            return "--windows does not apply with --npz (the files are the windows)"
        if args.windows is not None and args.windows > MAX_WINDOWS:
            prof = traces.profile(args.profile)  # a window's demand: uint16 [S, L, E]
            mb = prof.samples * prof.num_layers * prof.num_experts * 2 / 1e6
            return (
                f"--windows {args.windows}: at most {MAX_WINDOWS} (a median over {MAX_WINDOWS} windows is steady; each "
                f"window is planned with every preset and held in memory, {mb:,.0f} MB a window of {prof.name})"
            )
        args.windows = DEFAULT_WINDOWS[args.command] if args.windows is None else args.windows
    if args.command == "bench":
        sweep_only = [f for f in ("placements", "packings", "replications", "loads") if getattr(args, f) is not None]
        if not args.sweep and sweep_only:
            return f"--{sweep_only[0]} needs --sweep"
        if args.sweep:
            for flag, why in (
                ("policy", "it plans every combination"),
                ("figure", "it draws no figure"),
                ("trace", "it traces no plan"),
                ("plan_figure", "it draws no figure"),
            ):
                if getattr(args, flag):
                    return f"--{flag} does not apply with --sweep ({why})"
        args.loads = args.loads or "window"
        if args.cp is not None and args.oversize != "split":
            return "--cp needs --oversize split (a context-parallel group serves only split samples)"
        if args.oversize == "split" and args.cp is None:
            return "--oversize split needs --cp (the context-parallel group size to split over)"
        for why in cli_setup.check(args):
            return why
    if args.command == "calibrate":
        from routepack.cli_calibrate import check

        return check(args)
    if args.command == "measure":
        from routepack.measure.cli import check as check_measure

        return check_measure(args)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    why = _check(args)
    if why is not None:  # as argparse reports its own errors: one line, SystemExit(2)
        _Parser(prog=f"routepack {args.command}").error(why)
    try:
        if args.command == "measure" and args.json:
            writable(args.json, "--json")
        return int(args.func(args))
    except (UsageError, RoutepackError) as e:
        print(f"routepack {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"routepack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
