"""``routepack calibrate``: the subcommand that measures the cost model on this machine
(`routepack.calibrate`) and writes the cost model, its report, a figure and a results page
(registered by `routepack.cli`)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Optional

from routepack import traces
from routepack._cliargs import UsageError, count, writable
from routepack.tables import fill

#: Local processes for the links and the exchange when ``--ranks`` is not given.
DEFAULT_RANKS = 2


def run(args: argparse.Namespace) -> int:
    """``routepack calibrate``: measure, fit, write the cost model, the report and the figure."""
    out = writable(args.out, "--out")
    report = writable(args.report, "--report") if args.report else None
    fig = writable(args.plot, "--plot") if args.plot else None
    page = writable(args.results, "--results") if args.results else None
    if page is not None and report is None:
        raise UsageError("--results needs --report (the page is rendered from the report)")
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
    rep["command"] = "routepack " + " ".join(shlex.quote(a) for a in args.argv)
    dev = rep["device"]
    print(
        fill(
            f"calibrated {rep['profile']} shapes (H={rep['model']['hidden']}, I={rep['model']['expert_ffn']}) on "
            f"{dev.get('gpu') or dev.get('cpu')} ({dev['device']}, {dev['dtype']}, {dev['threads']} thread(s), "
            f"torch {dev['torch']}) in {rep['elapsed_s']:.0f} s",
            indent="  ",
        )
    )
    print()
    print(f"{'kernel':<12} {'points':>6} {'held out':>8} {'max rel. error (held out)':>26}  coefficients")
    for kind, k in rep["kernels"].items():
        mre = "n/a" if k["max_rel_error"] is None else f"{100 * k['max_rel_error']:.1f}%"
        coef = ", ".join(f"{n}={v:.3g}" for n, v in k["coefficients"].items())
        print(fill(f"{kind:<12} {len(k['sweep']):>6} {k['held_out_points']:>8} {mre:>26}  {coef}", indent=" " * 13))
    for kind, k in rep["kernels"].items():
        if k["cost_fields"].get("expert_table"):
            print(
                fill(
                    f"{kind:<12} expert_table (s per expert and pass beyond the line): "
                    + ", ".join(f"{t:g} tokens {v:.3g}" for t, v in k["cost_fields"]["expert_table"]),
                    indent=" " * 13,
                )
            )
    for kind, why in rep["skipped"].items():
        print(fill(f"{kind:<12} skipped: {why}", indent=" " * 13))
    for kind, k in rep["kernels"].items():
        if k.get("call_curve_bound") is not None:
            print(
                fill(
                    f"{kind:<12} bound: no curve of the cost model fits every point within "
                    f"{100 * k['call_curve_bound']:.1f}% (call_curve_bound; without the call: "
                    f"{100 * k['curve_bound']:.1f}%)",
                    indent=" " * 13,
                )
            )
        for name, form in k.get("alternative_forms", {}).items():
            if form.get("max_rel_error") is not None:
                print(
                    fill(
                        f"{kind:<12} not committed: the {name} form would give {100 * form['max_rel_error']:.1f}% "
                        f"held out ({form['formula']})",
                        indent=" " * 13,
                    )
                )
    load = rep["settings"].get("loadavg") or {}
    if load.get("start") and load.get("end"):
        print(
            fill(
                f"load average (1 min) {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end; "
                f"each point: {rep['settings'].get('aggregate')}",
                indent="  ",
            )
        )
    ratio = rep["preset"]["ratio"]
    print()
    print(
        fill(
            f"vs the {rep['preset']['hardware']['name']} preset: "
            + ", ".join(f"{n} x{v:.3g}" for n, v in ratio.items() if v is not None),
            indent="  ",
        )
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
    if page is not None and report is not None:
        from routepack.results import render

        shown = str(fig) if fig is not None and fig.exists() else None
        page.write_text(render("calibrate", [str(report)], page, shown), encoding="utf-8")
        print(f"wrote {page}")
    from routepack.verdict import calibrate_verdict

    print(fill(calibrate_verdict(rep), indent="  "))
    return 0


def check(args: argparse.Namespace) -> Optional[str]:
    """Why the options given do not go together (an option no kernel measured would read), or None;
    fills the defaults that depend on it."""
    kinds = set(args.kernels)
    for flag, dest, needs in (
        ("--ranks", "ranks", {"links", "exchange", "migration"}),
        ("--max-tokens-per-expert", "max_tokens_per_expert", {"expert_gemm"}),
        ("--max-length", "max_length", {"attention"}),
    ):
        if getattr(args, dest) is not None and not kinds & needs:
            return f"{flag} does not apply: it sets the {' or '.join(sorted(needs))} sweep, which --kernels leaves out"
    args.ranks = DEFAULT_RANKS if args.ranks is None else args.ranks
    return None


def add_parser(sub: Any) -> None:
    from routepack.calibrate import ALL_KERNELS, KERNELS

    helptext = "measure the cost model's coefficients on this machine (needs torch) and write a CostModel JSON"
    p = sub.add_parser("calibrate", help=helptext, description=helptext)
    p.add_argument(
        "--profile",
        default="tiny",
        choices=sorted(traces.PROFILES),
        help="built-in profile whose model shape is measured; choices: %(choices)s",
    )
    p.add_argument("--hidden", type=count(1), default=None, help="override the profile's hidden size")
    p.add_argument(
        "--expert-ffn",
        type=count(1),
        default=None,
        dest="expert_ffn",
        help="override the profile's per-expert FFN size",
    )
    p.add_argument("--out", default="routepack_cost.json", help="the calibrated CostModel JSON (default %(default)s)")
    p.add_argument(
        "--report", default="routepack_calibration.json", help="the report JSON (default %(default)s; '' for none)"
    )
    p.add_argument(
        "--plot",
        default="routepack_calibration.png",
        help="measured vs predicted PNG (default %(default)s; '' for none; needs matplotlib: "
        'pip install ".[bench]" from a clone)',
    )
    p.add_argument(
        "--results",
        default=None,
        help="also write a Markdown results page to this file, rendered from --report (default: none)",
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
        type=count(2),
        default=None,
        help=f"local processes for the links and the exchange (default {DEFAULT_RANKS}; only with those kernels)",
    )
    p.add_argument("--threads", type=count(1), default=None, help="torch CPU threads while measuring")
    p.add_argument("--warmup", type=count(0), default=None, help="untimed rounds over each sweep")
    p.add_argument(
        "--repeats",
        type=count(1),
        default=None,
        help="timed rounds over each sweep (a point's figure: the median of its visits, the drift divided out)",
    )
    p.add_argument(
        "--holdout-every",
        type=count(2),
        default=None,
        dest="holdout_every",
        help="hold every k-th sweep point out of the fit (default 3)",
    )
    p.add_argument(
        "--max-tokens-per-expert",
        type=count(1),
        default=None,
        dest="max_tokens_per_expert",
        help="top of the expert-GEMM sweep (only with the expert_gemm kernel)",
    )
    p.add_argument(
        "--max-length",
        type=count(1),
        default=None,
        dest="max_length",
        help="top of the attention sweep, a sample length (only with the attention kernel)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)
