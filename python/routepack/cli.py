"""`routepack` command line.

* ``routepack demo``: plans a few synthetic windows with every policy and prints how each
  would fare (step time from `simulate`, throughput relative to ``static``).
* ``routepack bench``: the same over more windows (a built-in profile or your own windows
  saved as ``.npz``), with a progress bar, a JSON dump and a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from routepack import traces
from routepack.compare import available_presets, compare, format_table, summarise
from routepack.window import Window


def _load_windows(args: argparse.Namespace, prof: traces.Profile) -> List[Window]:
    t0 = time.perf_counter()
    if args.npz:
        windows = [Window.load(p) for p in args.npz]
        src = f"{len(windows)} windows from .npz"
    else:
        windows = list(traces.synthetic(prof, args.windows + 1, args.seed))
        src = f"{len(windows)} synthetic windows"
    print(f"profile {prof.name}: L={prof.num_layers}, E={prof.num_experts}, top-{prof.top_k}, "
          f"dp={prof.dp} ep={prof.ep} gpus/node={prof.gpus_per_node} slots/rank={prof.slots_per_rank}, "
          f"cap={prof.token_cap}; {src} ({windows[0].num_samples} samples) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return windows


def _progress(total: int, quiet: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of the bench extra
        tqdm = None
    if quiet:
        return None, lambda: None
    if tqdm is not None:
        bar = tqdm(total=total, unit="plan", file=sys.stderr, leave=False, disable=None)  # off when not a TTY
        return (lambda name, i: (bar.set_postfix_str(f"window {i} {name}"), bar.update(1))), bar.close
    done = [0]

    def step(name: str, i: int) -> None:
        done[0] += 1
        print(f"\r[{done[0]}/{total}] window {i} {name:<24}", end="", file=sys.stderr, flush=True)

    return step, lambda: print(file=sys.stderr)


def _run(args: argparse.Namespace, figure: bool) -> int:
    prof = traces.profile(args.profile)
    windows = _load_windows(args, prof)
    policies = args.policy or available_presets()
    step, close = _progress((len(windows) - 1) * len(policies), args.quiet)
    options = {}
    if getattr(args, "anneal_moves", None) is not None:
        options["anneal_moves"] = args.anneal_moves
    try:
        rows = compare(windows, prof.topology(), prof.cost(), prof.token_cap, policies,
                       seed=args.seed, progress=step, **options)
    finally:
        close()
    summary = summarise(rows)
    print(f"median over {len(windows) - 1} window(s), scored by routepack.simulate "
          f"(cost model: H200 datasheet-level, see routepack.Hardware.h200):")
    print(format_table(summary))
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(
            {"profile": prof.name, "summary": summary,
             "rows": [{k: v for k, v in asdict(r).items() if k != "imbalance_map"} for r in rows]},
            indent=2))
        print(f"wrote {args.json}")
    if figure and getattr(args, "figure", None):
        try:
            from routepack.figures import bench_figure
        except ImportError:
            print("matplotlib is missing: pip install 'routepack[bench]' for the figure")
            return 0
        path = bench_figure(rows, summary, args.figure,
                            title=f"routepack bench: {prof.name}, {len(windows) - 1} windows")
        print(f"wrote {path}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="routepack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, windows, helptext in (
        ("demo", 2, "plan a couple of synthetic windows with every policy and print a comparison"),
        ("bench", 8, "benchmark every preset over successive windows: table, JSON and figure"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--profile", default="tiny", choices=sorted(traces.PROFILES),
                       help="built-in profile: model, topology, cap (and the synthetic trace)")
        p.add_argument("--windows", type=int, default=windows,
                       help="windows to score (one more is generated first, for history)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--policy", action="append", help="preset to include (repeatable; default: all)")
        p.add_argument("--npz", nargs="+", help="your own windows (Window.save files), in order")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument("--anneal-moves", type=int, default=None, dest="anneal_moves")
        if name == "bench":
            p.add_argument("--figure", default="routepack_bench.png", help="PNG to write ('' for none)")
            p.add_argument("--json", default=None, help="also write the results as JSON")
        p.set_defaults(func=lambda a, fig=(name == "bench"): _run(a, fig))
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error("--windows must be >= 1")
    if args.npz and len(args.npz) < 2:
        parser.error("--npz needs at least 2 windows (the first only feeds history)")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
