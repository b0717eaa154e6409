"""`routepack` command line: `routepack demo` plans synthetic windows with every policy and
prints how each would fare (step time from `simulate`, relative to `static`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from routepack import traces
from routepack.compare import available_presets, compare, format_table, summarise


def _demo(args: argparse.Namespace) -> int:
    prof = traces.profile(args.profile)
    t0 = time.perf_counter()
    windows = list(traces.synthetic(prof, args.windows + 1, args.seed))
    print(f"profile {prof.name}: {prof.samples} samples/window, L={prof.num_layers}, "
          f"E={prof.num_experts}, top-{prof.top_k}, dp={prof.dp} ep={prof.ep} "
          f"gpus/node={prof.gpus_per_node} slots/rank={prof.slots_per_rank}, cap={prof.token_cap}; "
          f"{args.windows + 1} windows generated in {time.perf_counter() - t0:.1f} s")
    policies = args.policy or available_presets()
    rows = compare(windows, prof.topology(), prof.cost(), prof.token_cap, policies, seed=args.seed)
    print(f"median over {args.windows} window(s), scored by routepack.simulate (H200 cost model):")
    print(format_table(summarise(rows)))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="routepack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan synthetic windows with every policy and print a comparison")
    demo.add_argument("--profile", default="tiny", choices=sorted(traces.PROFILES))
    demo.add_argument("--windows", type=int, default=2, help="windows to score (one more is generated for history)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--policy", action="append", help="preset to include (repeatable; default: all)")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    if getattr(args, "windows", 1) < 1:
        parser.error("--windows must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
