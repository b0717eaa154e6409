"""`routepack` command line.

* ``routepack demo``: plans a few synthetic windows with every policy and prints how each
  would fare (step time from `simulate`, throughput relative to ``static`` and to the best
  baseline).
* ``routepack bench``: the same over more windows (a built-in profile or your own windows
  saved as ``.npz``), with progress on stderr, a JSON dump and a figure (the figure needs
  matplotlib: ``pip install "routepack[bench]"``; without it the table is still printed).
* ``routepack bench --sweep``: every registered placement × packing × replication instead of
  the presets (`routepack.sweep`), sorted by step time, the ``routepack`` preset marked
  (``--placements``/``--packings``/``--replications`` narrow it; no figure).
* ``routepack calibrate``: measures the cost model's coefficients on this machine with torch
  (`routepack.calibrate`) and writes the calibrated ``CostModel`` JSON, a report JSON and a
  figure of measured vs predicted times (``pip install "routepack[torch]"``).
* ``routepack measure``: executes the MoE layers of ``static`` and ``routepack`` plans for real
  (`routepack.measure`, local gloo processes) and prints measured vs predicted times and speed-ups.
* ``--overlap dispatch_combine`` / ``--cost FILE`` (demo, bench): score with that cost model.

A user error (a bad argument, an unreadable ``--npz``, an input the planner refuses) prints
one line on stderr and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, List, NoReturn, Optional, Tuple

from routepack import __version__, traces
from routepack.compare import available_presets, best_of, compare, format_ratios, format_table, ratios, summarise
from routepack.errors import RoutepackError
from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS
from routepack.sweep import combinations, format_sweep, sweep, sweep_policies
from routepack.window import Window

FIGURE_HINT = 'pip install "routepack[bench]"'


class UsageError(Exception):
    """A user error the CLI reports in one line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: ``routepack bench: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _writable(path: str, flag: str) -> Path:
    """``path`` if a file can be written there (checked before the benchmark runs)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return p


def _bar(iterable: Iterable[Any], total: int, unit: str, quiet: bool) -> Iterator[Any]:
    """``iterable`` with a tqdm bar on stderr (shown on a terminal, unless ``quiet``)."""
    if quiet:
        return iter(iterable)
    from tqdm import tqdm

    return iter(tqdm(iterable, total=total, unit=unit, file=sys.stderr, leave=False, disable=None))


def _load_windows(args: argparse.Namespace, prof: traces.Profile) -> List[Window]:
    t0 = time.perf_counter()
    windows: List[Window] = []
    if args.npz:
        if not args.quiet:
            print(f"loading {len(args.npz)} windows from .npz ...", file=sys.stderr, flush=True)
        for path in _bar(args.npz, len(args.npz), "window", args.quiet):
            try:
                windows.append(Window.load(path))
            except RoutepackError as e:
                raise UsageError(f"--npz {path}: {e}") from None
            except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
                why = f"missing array {e}" if isinstance(e, KeyError) else (str(e) or type(e).__name__)
                raise UsageError(f"--npz {path}: not a routepack Window file ({why})") from None
        src = f"{len(windows)} windows from .npz"
    else:
        n = args.windows + 1
        if not args.quiet:
            print(
                f"generating {n} synthetic {prof.name} windows ({prof.samples} samples each) ...",
                file=sys.stderr,
                flush=True,
            )
        windows = list(_bar(traces.synthetic(prof, n, args.seed), n, "window", args.quiet))
        src = f"{len(windows)} synthetic windows"
    print(
        f"profile {prof.name}: L={prof.num_layers}, E={prof.num_experts}, top-{prof.top_k}, "
        f"dp={prof.dp} ep={prof.ep} gpus/node={prof.gpus_per_node} slots/rank={prof.slots_per_rank}, "
        f"cap={prof.token_cap}; {src} ({windows[0].num_samples} samples) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return windows


def _progress(total: int, quiet: bool) -> Tuple[Optional[Callable[[str, int], None]], Callable[[], None]]:
    if quiet:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="plan", file=sys.stderr, leave=False, disable=None)  # off when not a TTY

    def step(name: str, i: int) -> None:
        bar.set_postfix_str(f"window {i} {name}")
        bar.update(1)

    return step, bar.close


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
    """The cost model demo/bench score with: ``--cost`` or the profile's preset, ``--overlap`` applied."""
    from dataclasses import replace

    from routepack.model import CostModel

    cost = CostModel.load(args.cost) if getattr(args, "cost", None) else prof.cost()
    return replace(cost, overlap=args.overlap) if getattr(args, "overlap", None) else cost


def _cost_name(args: argparse.Namespace) -> str:
    base = f"{args.cost}" if getattr(args, "cost", None) else "H200 datasheet-level, see routepack.Hardware.h200"
    return base + (f", overlap {args.overlap}" if getattr(args, "overlap", None) else "")


def _run_sweep(args: argparse.Namespace) -> int:
    """``routepack bench --sweep`` (and ``benches/sweep.py``)."""
    prof = traces.profile(args.profile)
    json_path = _writable(args.json, "--json") if args.json else None
    try:
        combos = combinations(args.placements, args.packings, args.replications, args.loads)
    except RoutepackError as e:
        raise UsageError(str(e)) from None
    windows = _load_windows(args, prof)
    policies = sweep_policies(combos)
    step, close = _progress((len(windows) - 1) * len(policies), args.quiet)
    options = {} if args.anneal_moves is None else {"anneal_moves": args.anneal_moves}
    try:
        result = sweep(
            windows,
            prof.topology(),
            prof.cost(),
            prof.token_cap,
            args.placements,
            args.packings,
            args.replications,
            loads=args.loads,
            seed=args.seed,
            progress=step,
            **options,
        )
    finally:
        close()
    print(
        f"\nsweep: {len(combos)} stage combinations (loads: {args.loads}) + the routepack preset and the "
        f"baselines where not among them; median over {len(windows) - 1} window(s), scored by routepack.simulate\n"
    )
    print(format_sweep(result))
    if json_path is not None:
        out = {
            "profile": prof.name,
            "seed": args.seed,
            "windows": len(windows) - 1,
            **{k: v for k, v in result.items() if k != "rows"},
            "rows": _rows_json(result["rows"]),
        }
        json_path.write_text(json.dumps(_json_safe(out), indent=2))
        print(f"wrote {json_path}")
    return 0


def _run(args: argparse.Namespace, figure: bool) -> int:
    if getattr(args, "sweep", False):
        return _run_sweep(args)
    prof = traces.profile(args.profile)
    json_path = _writable(args.json, "--json") if getattr(args, "json", None) else None
    fig_path = _writable(args.figure, "--figure") if figure and getattr(args, "figure", None) else None
    windows = _load_windows(args, prof)
    policies = args.policy or available_presets()
    baseline = "static" if "static" in policies else policies[0]
    step, close = _progress((len(windows) - 1) * len(policies), args.quiet)
    options = {}
    if args.anneal_moves is not None:
        options["anneal_moves"] = args.anneal_moves
    try:
        rows = compare(
            windows,
            prof.topology(),
            _bench_cost(args, prof),
            prof.token_cap,
            policies,
            seed=args.seed,
            progress=step,
            **options,
        )
    finally:
        close()
    summary = summarise(rows, baseline)
    vs = ratios(rows)
    winners = best_of(rows)
    print(
        f"\nmedian over {len(windows) - 1} window(s), scored by routepack.simulate (cost model: {_cost_name(args)}):\n"
    )
    print(format_table(summary, baseline))
    if vs:
        print()
        print(format_ratios(vs, winners))
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                _json_safe(
                    {
                        "profile": prof.name,
                        "baseline": baseline,
                        "summary": summary,
                        "ratios": vs,
                        "best_of": {str(w): p for w, p in winners.items()},
                        "rows": _rows_json(rows),
                    }
                ),
                indent=2,
            )
        )
        print(f"wrote {json_path}")
    if fig_path is not None:
        try:
            import matplotlib  # noqa: F401  (only to know whether the figure can be drawn)
        except ImportError:
            print(f"no figure: matplotlib is not installed ({FIGURE_HINT} for it)")
            return 0
        from routepack.figures import bench_figure

        path = bench_figure(
            rows,
            summary,
            fig_path,
            baseline=baseline,
            title=f"routepack bench: {prof.name}, {len(windows) - 1} windows",
        )
        print(f"wrote {path}")
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    """``routepack calibrate``: measure, fit, write the cost model, the report and the figure."""
    out = _writable(args.out, "--out")
    report = _writable(args.report, "--report") if args.report else None
    fig = _writable(args.plot, "--plot") if args.plot else None
    try:
        from routepack.calibrate import calibrate
        from routepack.calibrate.report import PLOT_HINT

        cal = calibrate(
            args.profile,
            hidden=args.hidden,
            expert_ffn=args.expert_ffn,
            device=args.device,
            dtype=args.dtype,
            quick=args.quick,
            kernels=args.kernels,
            bw_inter=args.bw_inter,
            ranks=args.ranks,
            threads=args.threads,
            warmup=args.warmup,
            repeats=args.repeats,
            holdout_every=args.holdout_every,
            max_tokens_per_expert=args.max_tokens_per_expert,
            max_length=args.max_length,
            progress=not args.quiet,
        )
    except ImportError as e:
        raise UsageError(str(e)) from None
    rep = cal.report
    dev = rep["device"]
    print(
        f"calibrated {rep['profile']} shapes (H={rep['model']['hidden']}, I={rep['model']['expert_ffn']}) on "
        f"{dev.get('gpu') or dev.get('cpu')} ({dev['device']}, {dev['dtype']}, {dev['threads']} thread(s), "
        f"torch {dev['torch']}) in {rep['elapsed_s']:.0f} s\n"
    )
    print(f"{'kernel':<12} {'points':>6} {'held out':>8} {'max rel. error (held out)':>26}  coefficients")
    for kind, k in rep["kernels"].items():
        mre = "n/a" if k["max_rel_error"] is None else f"{100 * k['max_rel_error']:.1f}%"
        coef = ", ".join(f"{n}={v:.3g}" for n, v in k["coefficients"].items())
        print(f"{kind:<12} {len(k['sweep']):>6} {k['held_out_points']:>8} {mre:>26}  {coef}")
    for kind, k in rep["kernels"].items():
        if k["cost_fields"].get("expert_table"):
            print(
                f"{kind:<12} expert_table (s per expert and pass beyond the line): "
                + ", ".join(f"{t:g} tokens {v:.3g}" for t, v in k["cost_fields"]["expert_table"])
            )
    for kind, why in rep["skipped"].items():
        print(f"{kind:<12} skipped: {why}")
    for kind, k in rep["kernels"].items():
        if k.get("call_curve_bound") is not None:
            print(
                f"{kind:<12} bound: no curve of the cost model fits every point within "
                f"{100 * k['call_curve_bound']:.1f}% (call_curve_bound; without the call: "
                f"{100 * k['curve_bound']:.1f}%)"
            )
        for name, form in k.get("alternative_forms", {}).items():
            if form.get("max_rel_error") is not None:
                print(
                    f"{kind:<12} not committed: the {name} form would give {100 * form['max_rel_error']:.1f}% "
                    f"held out ({form['formula']})"
                )
    load = rep["settings"].get("loadavg") or {}
    if load.get("start") and load.get("end"):
        print(
            f"load average (1 min) {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end; "
            f"each point: {rep['settings'].get('aggregate')}"
        )
    ratio = rep["preset"]["ratio"]
    print(
        f"\nvs the {rep['preset']['hardware']['name']} preset: "
        + ", ".join(f"{n} x{v:.3g}" for n, v in ratio.items() if v is not None)
    )
    print(f"bw_inter: {rep['sources']['bw_inter']} ({cal.cost.bw_inter:.3g} B/s)")
    cal.cost.save(out)
    print(f"wrote {out}")
    if report is not None:
        from routepack.calibrate.report import write_json

        print(f"wrote {write_json(rep, report)}")
    if fig is not None:
        try:
            print(f"wrote {cal.plot(fig)}")
        except ImportError:
            print(f"no figure: matplotlib is not installed ({PLOT_HINT} for it)")
    return 0


def _calibrate_parser(sub: Any) -> None:
    from routepack.calibrate import ALL_KERNELS, KERNELS

    helptext = "measure the cost model's coefficients on this machine (needs torch) and write a CostModel JSON"
    p = sub.add_parser("calibrate", help=helptext, description=helptext)
    p.add_argument(
        "--profile",
        default="tiny",
        choices=sorted(traces.PROFILES),
        help="built-in profile whose model shape is measured; choices: %(choices)s",
    )
    p.add_argument("--hidden", type=_count(1), default=None, help="override the profile's hidden size")
    p.add_argument(
        "--expert-ffn",
        type=_count(1),
        default=None,
        dest="expert_ffn",
        help="override the profile's per-expert FFN size",
    )
    p.add_argument("--out", default="routepack_cost.json", help="the calibrated CostModel (JSON)")
    p.add_argument("--report", default="routepack_calibration.json", help="the report JSON ('' for none)")
    p.add_argument(
        "--plot",
        default="routepack_calibration.png",
        help=f"measured vs predicted PNG ('' for none; needs matplotlib: {FIGURE_HINT})",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: small sweeps, few repeats")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure (default %(default)s)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 on cpu, bfloat16 on cuda",
    )
    p.add_argument(
        "--kernels",
        nargs="+",
        choices=ALL_KERNELS,
        default=list(KERNELS),
        metavar="KIND",
        help=f"kernel kinds to measure (default: {' '.join(KERNELS)}; of {', '.join(ALL_KERNELS)})",
    )
    p.add_argument(
        "--bw-inter",
        type=float,
        default=None,
        dest="bw_inter",
        help="inter-node bytes/s for the cost model (default: the H200 preset's; not measurable here)",
    )
    p.add_argument(
        "--ranks",
        type=_count(2),
        default=2,
        help="local processes for the links and the exchange (default %(default)s)",
    )
    p.add_argument("--threads", type=_count(1), default=None, help="torch CPU threads while measuring")
    p.add_argument("--warmup", type=_count(0), default=None, help="untimed rounds over each sweep")
    p.add_argument(
        "--repeats",
        type=_count(1),
        default=None,
        help="timed rounds over each sweep (a point's figure: its least visit median)",
    )
    p.add_argument(
        "--holdout-every",
        type=_count(2),
        default=None,
        dest="holdout_every",
        help="hold every k-th sweep point out of the fit (default 3)",
    )
    p.add_argument(
        "--max-tokens-per-expert",
        type=_count(1),
        default=None,
        dest="max_tokens_per_expert",
        help="top of the expert-GEMM sweep",
    )
    p.add_argument(
        "--max-length",
        type=_count(1),
        default=None,
        dest="max_length",
        help="top of the attention sweep (sample length)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run_calibrate)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="routepack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"routepack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    presets = available_presets()
    for name, windows, helptext in (
        ("demo", 2, "plan a couple of synthetic windows with every policy and print a comparison"),
        ("bench", 8, "benchmark every preset over successive windows: table, JSON and figure"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument(
            "--profile",
            default="tiny",
            choices=sorted(traces.PROFILES),
            help="built-in profile: model, topology, cap (and the synthetic trace); choices: %(choices)s",
        )
        p.add_argument(
            "--windows",
            type=_count(1),
            default=windows,
            help="windows to score (one more is generated first, for history); default %(default)s",
        )
        p.add_argument("--seed", type=_count(0), default=0, help="trace and planner seed, >= 0")
        p.add_argument(
            "--policy",
            action="append",
            choices=presets,
            metavar="PRESET",
            help="preset to include (repeatable; default: all): " + ", ".join(presets),
        )
        p.add_argument("--npz", nargs="+", help="your own windows (Window.save files), in order")
        p.add_argument("--quiet", action="store_true", help="no progress on stderr")
        p.add_argument(
            "--anneal-moves",
            type=_count(0),
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
        p.add_argument("--cost", default=None, help="a CostModel JSON (default: the profile's H200 preset)")
        if name == "bench":
            p.add_argument(
                "--figure",
                default="routepack_bench.png",
                help=f"PNG to write ('' for none; needs matplotlib: {FIGURE_HINT})",
            )
            p.add_argument("--json", default=None, help="also write the results as JSON")
            p.add_argument(
                "--sweep",
                action="store_true",
                help="every placement x packing x replication instead of the presets (no figure)",
            )
            for flag, table in (
                ("--placements", PLACEMENTS),
                ("--packings", PACKINGS),
                ("--replications", REPLICATIONS),
            ):
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
                default="window",
                help="with --sweep: the loads every combination plans from (default: %(default)s, "
                "as the routepack preset does)",
            )
        p.set_defaults(func=lambda a, fig=(name == "bench"): _run(a, fig))
    _calibrate_parser(sub)
    from routepack.measure.cli import add_parser as _measure_parser

    _measure_parser(sub, _count)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "npz", None) and len(args.npz) < 2:
        parser.error("--npz needs at least 2 windows (the first only feeds history)")
    if args.command == "bench" and not args.sweep:
        given = [f for f in ("placements", "packings", "replications") if getattr(args, f) is not None]
        if given or args.loads != "window":
            parser.error(f"--{(given or ['loads'])[0]} needs --sweep")
    try:
        return int(args.func(args))
    except (UsageError, RoutepackError) as e:
        print(f"routepack {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"routepack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
