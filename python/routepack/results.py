"""Results pages: Markdown written by code from what a run saved, never by hand.

``routepack bench ... --results PAGE`` (with or without ``--sweep``) and ``routepack
calibrate ... --results PAGE`` write their page as they finish. Every page can also be
rendered again from the run's JSON (``--json``, ``--report``), which keeps the pages of runs
too long to repeat in step with this renderer:

    python -m routepack.results bench docs/bench_flash.json --figure docs/bench_flash.png \\
        --out docs/results/bench_flash.md

Kinds: ``bench`` (one ``routepack bench --json`` file), ``sweep`` (``routepack bench --sweep
--json``), ``overlap`` (``routepack bench --json`` files of one profile without and with
``--overlap dispatch_combine``, in that order, one pair per profile), ``calibrate`` (a
``routepack calibrate --report`` file), ``measure`` (a ``routepack measure --json`` file) and
``scale`` (a ``benches/scale.py --out`` file).
A page's second line is the command that renders it again (``tests/test_docs.py`` runs it
for every page under docs/results and compares).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from routepack.compare import BEST, baseline_notes, legend_entries, table_cells
from routepack.errors import RoutepackError
from routepack.sweep import sweep_legend, verdict_text
from routepack.tables import markdown_table

PREDICTION = (
    "Every step time and ratio on this page is a prediction of routepack's cost model "
    "(`routepack.simulate`), not a measurement on GPUs; `plan s` is the planner's wall time on the "
    "machine the run was on."
)


def _rel(path: str, page: Optional[Path]) -> str:
    """``path`` (as the run named it, relative to where it ran) relative to the page's folder."""
    if page is None:
        return path
    return Path(os.path.relpath(Path(path).resolve(), page.resolve().parent)).as_posix()


def _num(v: Any, fmt: str, scale: float = 1.0) -> str:
    if v is None or not math.isfinite(float(v)):
        return "-"
    return format(float(v) * scale, fmt)


def _counts(best_of: Dict[str, str]) -> str:
    counts: Dict[str, int] = {}
    for p in best_of.values():
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(f"`{p}` in {c}" for p, c in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


def _windows(data: Dict[str, Any]) -> int:
    return int(data.get("windows") or len({r["window"] for r in data["rows"]}))


def _command_line(data: Dict[str, Any], default: str) -> str:
    if data.get("command"):
        return f"- Command: `{data['command']}`"
    if data.get("stated_command"):
        return f"- Command: `{data['stated_command']}` (stated when the page was rendered: the file predates recorded commands)"
    return (
        f"- Command: `{default}` (reconstructed: the file predates recorded commands; seed 0, the profile's cost model)"
    )


def _stated(data: Dict[str, Any]) -> List[str]:
    """The notes given when the page was rendered (``--note``), as bullets."""
    return [f"- {n}" for n in data.get("stated_notes", [])]


def _meta(data: Dict[str, Any], default_command: str, json_path: Optional[str], page: Optional[Path]) -> List[str]:
    out = [_command_line(data, default_command)]
    cost = data.get("cost_model_name") or "the profile's H200 datasheet-level preset (`routepack.Hardware.h200`)"
    out.append(f"- Cost model: {cost}")
    if data.get("routepack"):
        out.append(f"- Recorded with routepack {data['routepack']}")
    if json_path:
        out.append(f"- Data: [{Path(json_path).name}]({_rel(json_path, page)})")
    return out + _stated(data)


def _notes(data: Dict[str, Any]) -> List[str]:
    """The run's notes, or for a file from before they were recorded, its profile's."""
    if "notes" in data:
        return list(data["notes"])
    from routepack import traces

    if data.get("profile") not in traces.PROFILES:
        return []
    prof = traces.profile(data["profile"])
    names = [r["policy"] for r in data["summary"]]
    return baseline_notes(prof.topology(), prof.num_experts, prof.cost().expert_groups, names)


def bench_page(
    data: Dict[str, Any],
    page: Optional[Path] = None,
    json_path: Optional[str] = None,
    figure: Optional[str] = None,
) -> str:
    """The page of one ``routepack bench`` run, from its JSON (what ``--json`` writes)."""
    baseline = data.get("baseline", "static")
    n = _windows(data)
    figure = figure or data.get("figure")
    out = [f"# routepack bench: `{data['profile']}`", "", PREDICTION, ""]
    out += _meta(data, f"routepack bench --profile {data['profile']} --windows {n}", json_path, page)
    if figure:
        out += ["", f"![routepack bench, {data['profile']}]({_rel(figure, page)})"]
    summary = [{k: math.nan if v is None else v for k, v in e.items()} for e in data["summary"]]  # JSON null: NaN
    names, columns = table_cells(summary, baseline)
    ran = {r["policy"] for r in data["rows"]}
    titles = ["policy"] + [t for t, _, _ in columns]
    rows = [[f"`{p}`" if p in ran else p] + [c[i] for _, c, _ in columns] for i, p in enumerate(names)]
    out += ["", f"## Medians over {n} window(s)", "", markdown_table(titles, rows)]
    if data.get("ratios"):
        out += ["", "## routepack over each policy, per window", ""]
        rr = [
            [r["against"] if r["against"] == BEST else f"`{r['against']}`", f"{r['median']:.3f}x"]
            + [f"{r['min']:.3f}-{r['max']:.3f}", str(r["windows"])]
            for r in data["ratios"]
        ]
        out.append(markdown_table(["over", "median", "range", "windows"], rr))
        if data.get("best_of"):
            out += ["", f"The best baseline per window: {_counts(data['best_of'])} of {n}."]
    notes = _notes(data)
    if notes:
        out += [""] + [f"- {note}" for note in notes]
    items, refs = legend_entries(baseline, "of bound" in titles, "bubble" in titles)
    out += ["", "## Legend", ""]
    out += [f"- **{k}**: {v}" for k, v in items]
    out += [f"- row **{k}**: {v}" for k, v in refs]
    return "\n".join(out) + "\n"


def sweep_page(data: Dict[str, Any], page: Optional[Path] = None, json_path: Optional[str] = None) -> str:
    """The page of one ``routepack bench --sweep`` run, from its JSON."""
    n = _windows(data)
    loads = data.get("loads", "window")
    out = [f"# routepack bench --sweep: `{data['profile']}`", "", PREDICTION, ""]
    default = f"routepack bench --sweep --profile {data['profile']} --windows {n} --loads {loads}"
    out += _meta(data, default, json_path, page)

    def row(mark: str, names: Sequence[str], e: Dict[str, Any]) -> List[str]:
        return [mark, *names] + [
            _num(e["step_s"], ".3f"),
            _num(e["step_min"], ".3f"),
            _num(e["step_max"], ".3f"),
            _num(e["vs_preset"], ".4f"),
            _num(e["vs_best"], ".4f"),
            _num(e["cross_node_bytes_per_token"], ".2f", 1e-3),
            _num(e["plan_s"], ".3f"),
        ]

    rows = [
        row("*" if e["preset"] else "", (e["placement"], e["packing"], e["replication"]), e) for e in data["entries"]
    ]
    b = data.get("best_baseline")
    if b is not None:
        rows.append(row("", (BEST, "", ""), b))
    titles = ["", "placement", "packing", "replication", "step s", "min s", "max s", "thr/preset", "thr/best"]
    titles += ["xnode kB/tok", "plan s"]
    out += ["", f"## Every stage combination, medians over {n} window(s)", ""]
    out.append(markdown_table(titles, rows, align="llll" + "r" * 7))
    if b is not None:
        out += ["", f"The best baseline per window: {_counts(b['best_of'])} of {n}."]
    verdict = " ".join(verdict_text(data["verdict"]).split()).lstrip("* ")
    out += ["", verdict[0].upper() + verdict[1:] + "."]
    out += ["", "## Legend", "", "```text", sweep_legend(), "```"]
    return "\n".join(out) + "\n"


def overlap_page(runs: Sequence[Dict[str, Any]], paths: Sequence[str] = (), page: Optional[Path] = None) -> str:
    """Benches of one profile without and with ``--overlap dispatch_combine``, side by side:
    ``runs`` in pairs (without, with), one pair per profile."""
    if len(runs) % 2:
        raise RoutepackError(f"overlap: expected the runs in pairs (without, with overlap), got {len(runs)}")
    out = ["# routepack bench with the all-to-all overlapped and not", "", PREDICTION, ""]
    out.append(
        "`--overlap dispatch_combine` prices every exchange as max(compute, all-to-all) plus the exposed "
        'replication instead of their sum (docs/design.md, "The cost model", Overlap); everything else '
        "is the profile's preset. Plans are made and scored under the same model."
    )
    for k in range(0, len(runs), 2):
        plain, over = runs[k], runs[k + 1]
        name = plain["profile"]
        out += ["", f"## `{name}`, medians over {_windows(plain)} window(s)", ""]
        for data, path, overlap in zip((plain, over), paths[k : k + 2] or ("", ""), ("none", "dispatch_combine")):
            default = f"routepack bench --profile {name} --windows {_windows(data)} --overlap {overlap}"
            out.append(_command_line(data, default))
            if path:
                out.append(f"- Data: [{Path(path).name}]({_rel(path, page)})")
        out += _stated(plain)
        a = {s["policy"]: s for s in plain["summary"]}
        b = {s["policy"]: s for s in over["summary"]}
        rows = []
        for pol in [p for p in a if p in b]:
            x, y = a[pol], b[pol]
            rows.append(
                [f"`{pol}`" if pol in {r["policy"] for r in plain["rows"]} else pol]
                + [_num(x["step_s"], ".3f"), _num(y["step_s"], ".3f")]
                + [f"{_num(x['vs_static'], '.3f')} → {_num(y['vs_static'], '.3f')}"]
                + [f"{_num(x['vs_best'], '.3f')} → {_num(y['vs_best'], '.3f')}"]
                + [f"{_num(x['of_bound'], '.1%')} → {_num(y['of_bound'], '.1%')}"]
            )
        titles = ["policy", "step s, none", "step s, overlap", "thr/static", "thr/best", "of bound"]
        out += ["", markdown_table(titles, rows)]
        best = [
            (r, s)
            for r in plain.get("ratios", [])
            for s in over.get("ratios", [])
            if r["against"] == BEST == s["against"]
        ]
        for r, s in best:
            out += [
                "",
                f"routepack over the best baseline, per window: {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f}) "
                f"without overlap, {s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f}) with it.",
            ]
    return "\n".join(out) + "\n"


def calibrate_page(
    report: Dict[str, Any], page: Optional[Path] = None, json_path: Optional[str] = None, figure: Optional[str] = None
) -> str:
    """The page of one ``routepack calibrate`` run, from its report (``--report``)."""
    dev = report["device"]
    model = report["model"]
    out = [f"# routepack calibrate: `{report['profile']}` shapes on {dev.get('gpu') or dev.get('cpu')}", ""]
    out.append(
        "Measured on the machine named above (these are timings, not predictions), then fitted: the "
        "held-out error is over sweep points left out of the fit and only predicted."
    )
    out.append("")
    if report.get("command") or report.get("stated_command"):
        out.append(_command_line(report, ""))
    out.append(
        f"- Shapes H = {model['hidden']}, I = {model['expert_ffn']}; {dev['device']}, {dev['dtype']}, "
        f"{dev['threads']} torch thread(s), clock {dev.get('clock', '-')}, torch {dev['torch']}; "
        f"{report['elapsed_s']:.0f} s"
    )
    load = report.get("settings", {}).get("loadavg") or {}
    if load.get("start") and load.get("end"):
        out.append(f"- Load average (1 min): {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end")
    if report.get("routepack"):
        out.append(f"- Recorded with routepack {report['routepack']}")
    if json_path:
        out.append(f"- Report: [{Path(json_path).name}]({_rel(json_path, page)})")
    out += _stated(report)
    if figure:
        out += ["", f"![measured and predicted times, {report['profile']}]({_rel(figure, page)})"]
    rows = []
    for kind, k in report["kernels"].items():
        coef = ", ".join(f"{n} {v:.3g}" for n, v in k["coefficients"].items())
        rows.append(
            [f"`{kind}`", str(len(k["sweep"])), str(k["held_out_points"]), _num(k["max_rel_error"], ".1%"), coef]
        )
    out += ["", "## Fitted kernels", ""]
    titles = ["kernel", "points", "held out", "max rel. error (held out)", "coefficients"]
    out.append(markdown_table(titles, rows, align="lrrrl"))
    extra = []
    for kind, k in report["kernels"].items():
        table = k.get("cost_fields", {}).get("expert_table")
        if table:
            knots = ", ".join(f"{t:g}: {1e3 * v:.3g} ms" for t, v in table)
            extra.append(f"- `{kind}` expert table (tokens per expert: seconds per expert and pass): {knots}")
        if k.get("call_curve_bound") is not None:
            extra.append(
                f"- `{kind}`: no curve of the cost model fits every point within "
                f"{_num(k['call_curve_bound'], '.1%')} (`call_curve_bound`)"
            )
        for name, form in k.get("alternative_forms", {}).items():
            if form.get("max_rel_error") is not None:
                extra.append(
                    f"- `{kind}`, not committed: the {name} form would give {_num(form['max_rel_error'], '.1%')} "
                    "held out"
                )
    for kind, why in report.get("skipped", {}).items():
        extra.append(f"- `{kind}` skipped: {why}")
    if extra:
        out += [""] + extra
    ratio = report.get("preset", {}).get("ratio", {})
    if ratio:
        hw = report["preset"].get("hardware", {}).get("name", "preset")
        out += [
            "",
            f"Coefficients over the {hw} preset's: "
            + ", ".join(f"{n} {v:.3g}x" for n, v in ratio.items() if v is not None)
            + ".",
        ]
    return "\n".join(out) + "\n"


def measure_page(data: Dict[str, Any], page: Optional[Path] = None, json_path: Optional[str] = None) -> str:
    """The page of one ``routepack measure`` run, from its JSON (``--json``): per window and
    plan the measured and predicted step and microbatches, the run's totals and speed-ups."""
    w = data["workload"]
    out = ["# routepack measure: measured against predicted", ""]
    out.append(
        f"The MoE layers of each plan executed for real with `routepack.torch` on {w['ranks']} local gloo "
        f"processes ({w['layers']} layers of {w['experts']} experts top-{w['top_k']}, H = {w['hidden']}, "
        f"I = {w['ffn']}, {w['samples']} samples a window, {w.get('windows', 1)} window(s), seed {w['seed']}); "
        "times are the slowest rank's CPU time. Predictions are `routepack.simulate` under the cost model "
        "calibrated for the run."
    )
    out.append("")
    if data.get("command") or data.get("stated_command"):
        out.append(_command_line(data, ""))
    if json_path:
        out.append(f"- Data: [{Path(json_path).name}]({_rel(json_path, page)})")
    out += _stated(data)
    rows = []
    for name, rec in data["policies"].items():
        for k, win in enumerate(rec.get("windows", [rec])):  # one window: the format before windows
            where = f"window {k}, " if "windows" in rec else ""
            for m, (t, p, e) in enumerate(zip(win["micro_s"], win["predicted_micro_s"], win["micro_rel_error"])):
                rows.append(
                    [f"`{name}`", f"{where}micro {m}", _num(t, ".1f", 1e3), _num(p, ".1f", 1e3), _num(e, "+.1%")]
                )
            err = win["predicted_step_s"] / win["step_s"] - 1.0
            step = [_num(win["step_s"], ".1f", 1e3), _num(win["predicted_step_s"], ".1f", 1e3), _num(err, "+.1%")]
            rows.append([f"`{name}`", f"{where}step", *step])
        if "windows" in rec:
            err = rec["predicted_step_s"] / rec["step_s"] - 1.0
            run = [_num(rec["step_s"], ".1f", 1e3), _num(rec["predicted_step_s"], ".1f", 1e3), _num(err, "+.1%")]
            rows.append([f"`{name}`", "the run", *run])
    out += ["", "## Times (ms)", "", markdown_table(["plan", "part", "measured", "predicted", "error"], rows)]
    speed = []
    for name, rec in data["policies"].items():
        pairs = rec.get("speedups") or (
            {
                "static": {
                    "measured": rec["speedup"],
                    "predicted": rec["predicted_speedup"],
                    "rel_error": rec["speedup_rel_error"],
                }
            }
            if name != "static"
            else {}
        )
        for ref, sp in pairs.items():
            if ref != name:
                speed.append([f"`{name}` over `{ref}`", _num(sp["measured"], ".3f"), _num(sp["predicted"], ".3f")])
                speed[-1].append(_num(sp["rel_error"], "+.1%"))
    out += ["", "## Speed-ups", ""]
    out.append(markdown_table(["plan", "measured", "predicted", "predicted / measured - 1"], speed))
    if data.get("calibration"):
        out += ["", "## The run's calibration", ""]
        cal = [
            [f"`{kind}`", _num(fit.get("max_rel_error"), ".1%"), _num(fit.get("call_curve_bound"), ".1%")]
            for kind, fit in data["calibration"].items()
            if isinstance(fit, dict)
        ]
        out.append(markdown_table(["kernel", "held-out max rel. error", "call_curve_bound"], cal))
    return "\n".join(out) + "\n"


def scale_page(data: Dict[str, Any], page: Optional[Path] = None, json_path: Optional[str] = None) -> str:
    """The page of one ``benches/scale.py --out`` run: plan time and memory as the window grows."""
    out = ["# Plan time and memory as the window grows (`benches/scale.py`)", ""]
    out.append(
        "Each size is one synthetic window (seed 0) planned once with the `routepack` preset (default "
        "budget) in a process of its own: wall and process-CPU seconds of the call, its stages (wall), "
        "the predicted step time (a prediction of the cost model), the `eplb_oracle` plan's wall time "
        "and the process's peak RSS. Wall times include waiting for a core on a loaded machine."
    )
    out.append("")
    out.append(_command_line(data, "python benches/scale.py"))
    load = data.get("loadavg")
    if load:
        out.append(f"- Load average (1 min): {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end")
    if data.get("routepack"):
        out.append(f"- Recorded with routepack {data['routepack']}")
    if json_path:
        out.append(f"- Data: [{Path(json_path).name}]({_rel(json_path, page)})")
    out += _stated(data)
    titles = ["size", "S", "L × E", "dp / ep", "wall (CPU) s", "placement", "rows", "layout", "replication"]
    titles += ["simulate", "rest", "step s", "eplb_oracle s", "peak RSS GB", "digest"]
    rows = [
        [f"`{r['size']}`", f"{r['S']:,}", f"{r['L']} × {r['E']}", f"{r['dp']} / {r['ep']}"]
        + [f"{r['wall']:.2f} ({r['cpu']:.2f})"]
        + [_num(r[k], ".2f") for k in ("placement", "rows", "layout", "replication", "simulate", "rest")]
        + [_num(r["step_time"], ".2f"), _num(r.get("eplb_oracle"), ".2f"), _num(r["rss_gb"], ".2f"), r["digest"]]
        for r in data["rows"]
    ]
    out += ["", markdown_table(titles, rows, align="lrrr" + "r" * 10 + "l")]
    return "\n".join(out) + "\n"


def break_even_page(
    data: Dict[str, Any], page: Optional[Path] = None, json_path: Optional[str] = None, figure: Optional[str] = None
) -> str:
    """The page of one ``routepack bench --break-even`` run (`routepack.break_even`), from its JSON."""
    from routepack.break_even import BASELINE, POLICIES, break_even_tokens

    out = [f"# Where per-microbatch copies stop paying: `{data['profile']}`", "", PREDICTION, ""]
    out += _meta(data, f"routepack bench --break-even --profile {data['profile']}", json_path, page)
    if figure:
        out += ["", f"![break-even]({_rel(figure, page)})"]
    tokens, vios = data["tokens"], data["vios"]
    grid = {(c["tokens"], c["vio"]): c for c in data["cells"]}
    out += ["", "## Break-even: the fewest tokens per rank from which on each policy is faster than no balancing", ""]
    rows = []
    for v in vios:
        cells = [break_even_tokens(data, p, v) for p in POLICIES]
        rows.append([f"{v:g}"] + [f"{t:,}" if t is not None else "never" for t in cells])
    out.append(markdown_table(["max_vio", *POLICIES], rows, align="l" + "r" * len(POLICIES)))
    for pol in POLICIES:
        out += ["", f"## `{pol}` over `{BASELINE}` (throughput ratio; rows max_vio, columns tokens per rank)", ""]
        rows = [[f"{v:g}"] + [_num(grid[(t, v)]["speedup"][pol], ".3f") for t in tokens] for v in vios]
        out.append(markdown_table(["max_vio", *(f"{t:,}" for t in tokens)], rows, align="l" + "r" * len(tokens)))
    measured = [f"{v:g}: {grid[(tokens[-1], v)]['measured_vio']:.2f}" for v in vios]
    out += [
        "",
        "## Legend",
        "",
        f"- A cell's windows: {data['micro']} microbatches of one sample a rank, exactly that many tokens each; every "
        "sample's tokens favour one EP rank's experts (chosen per sample and layer) at max_vio (verl's and MoonEP's "
        "metric: max over experts of load / mean - 1); `routepack.break_even` says how.",
        f"- Measured max_vio of the samples at {tokens[-1]:,} tokens (target: measured): " + ", ".join(measured) + ".",
        f"- No balancing: `{BASELINE}` (Megatron's placement and packing, no copies).",
    ]
    return "\n".join(out) + "\n"


def _load(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RoutepackError(f"{path}: not a readable results JSON ({e})") from None


def render(
    kind: str,
    paths: Sequence[str],
    out: Path,
    figure: Optional[str] = None,
    notes: Sequence[str] = (),
    command: Optional[str] = None,
) -> str:
    """The page of ``kind`` from the JSON files ``paths``, for the page file ``out``; its
    header holds the command that renders it again. ``notes`` go on the page as given;
    ``command`` states the command of a file that predates recorded commands."""
    runs = [_load(p) for p in paths]
    for run in runs[:1]:
        run["stated_notes"] = list(notes)
        if command and not run.get("command"):
            run["stated_command"] = command
    kinds = ("bench", "sweep", "overlap", "calibrate", "measure", "scale", "break_even")
    if kind not in kinds:
        raise RoutepackError(f"kind: expected one of {list(kinds)}, got {kind!r}")
    if kind != "overlap" and len(runs) != 1:
        raise RoutepackError(f"{kind}: expected one JSON file, got {len(runs)}")
    if kind == "overlap":
        text = overlap_page(runs, paths, out)
    elif kind == "bench":
        text = bench_page(runs[0], out, paths[0], figure)
    elif kind == "calibrate":
        text = calibrate_page(runs[0], out, paths[0], figure)
    elif kind == "sweep":
        text = sweep_page(runs[0], out, paths[0])
    elif kind == "scale":
        text = scale_page(runs[0], out, paths[0])
    elif kind == "break_even":
        text = break_even_page(runs[0], out, paths[0], figure)
    else:
        text = measure_page(runs[0], out, paths[0])
    cmd = ["python", "-m", "routepack.results", kind, *paths] + (["--figure", figure] if figure else [])
    cmd += (["--command", command] if command else []) + [a for n in notes for a in ("--note", n)]
    cmd += ["--out", str(out)]
    return header(" ".join(shlex.quote(c) for c in cmd)) + text


def header(command: str) -> str:
    """A page's first lines: written by code (``command`` renders it again), not by hand."""
    return f"<!-- generated: do not edit by hand; this command writes it again:\n{command}\n-->\n"


def parser() -> argparse.ArgumentParser:
    """The arguments of ``python -m routepack.results`` (a page's header holds them)."""
    ap = argparse.ArgumentParser(prog="python -m routepack.results", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("bench", "sweep", "overlap", "calibrate", "measure", "scale", "break_even"))
    ap.add_argument("json", nargs="+", help="the run's JSON file(s)")
    ap.add_argument("--figure", default=None, help="bench, calibrate: the run's figure, shown on the page")
    ap.add_argument("--command", default=None, help="the run's command, for a file that predates recorded commands")
    ap.add_argument("--note", action="append", default=[], help="a note to put on the page (repeatable)")
    ap.add_argument("--out", required=True, help="the page to write (Markdown)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        text = render(args.kind, args.json, Path(args.out), args.figure, args.note, args.command)
    except (RoutepackError, KeyError, TypeError) as e:
        print(f"routepack.results: error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


__all__ = [
    "bench_page",
    "break_even_page",
    "calibrate_page",
    "header",
    "measure_page",
    "overlap_page",
    "parser",
    "render",
    "scale_page",
    "sweep_page",
]

if __name__ == "__main__":
    sys.exit(main())
