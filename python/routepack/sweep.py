"""The stage-combination sweep behind ``routepack bench --sweep`` and ``benches/sweep.py``: every
registered placement × packing × replication, planned and scored like `routepack.compare`
(successive windows, the first only history; each plan through `Plan.validate`, then
`simulate`), so nobody has to guess whether the ``routepack`` preset is the best plan its own
stages can build.

Every combination plans from the loads of the window it plans (``Policy(loads="window")``,
what the ``routepack`` preset does and the ``_oracle`` baselines do); ``loads="previous"``
plans them from the previous window's instead. Beside the combinations run the ``routepack``
preset (it is one of them unless a filter leaves it out) and every configuration of every
baseline (`routepack.compare.BASELINES`, in their own load settings), which give the **best
baseline**: per window the fastest of them, as in the ``routepack bench`` table.

Entries are sorted by median step time; ``vs_preset`` / ``vs_best`` are medians over windows of
the per-window throughput ratio of the entry over the preset's / the best baseline's (above 1:
faster). The verdict says whether the preset is the fastest entry or within `TOLERANCE` of it.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from routepack.compare import BASELINES, BEST, CROSS_NODE_LEGEND, Row, compare
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.policies import PRESETS, Policy, resolve
from routepack.stages.context import DEFAULT_SEED
from routepack.stages.policy import DEFAULT_LOADS
from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS
from routepack.tables import WIDTH, fill, text_tables

#: The preset the sweep is about.
PRESET = "routepack"
#: How far (a fraction of its median step time) behind the fastest entry the preset may be and
#: still count as the best (the acceptance of issue 14).
TOLERANCE = 0.005


def _choices(values: Optional[Sequence[str]], table: Dict[str, Any], name: str) -> List[str]:
    if values is None:
        return list(table)
    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise RoutepackTypeError(f"{name}: expected a sequence of names, got {values!r}")
    unknown = [v for v in values if v not in table]
    if unknown:
        raise RoutepackError(f"{name}: unknown choice(s) {unknown}; known: {sorted(table)}")
    if not values:
        raise RoutepackError(f"{name}: expected at least one choice, got none")
    return list(dict.fromkeys(values))


def combinations(
    placements: Optional[Sequence[str]] = None,
    packings: Optional[Sequence[str]] = None,
    replications: Optional[Sequence[str]] = None,
    loads: str = DEFAULT_LOADS,
) -> List[Policy]:
    """Every (placement, packing, replication) of the registered choices (None: all of a stage),
    in registry order, each planning from ``loads``."""
    if loads not in ("window", "previous"):
        raise RoutepackError(f"loads: expected 'window' or 'previous', got {loads!r}")
    return [
        Policy(a, b, c, loads=loads)
        for a in _choices(placements, PLACEMENTS, "placements")
        for b in _choices(packings, PACKINGS, "packings")
        for c in _choices(replications, REPLICATIONS, "replications")
    ]


def sweep_policies(combos: Sequence[Policy]) -> List[Union[str, Policy]]:
    """What a sweep plans: the combinations, then the preset and the baselines' presets that are
    not among them (a preset whose policy is a combination reuses that combination's plans)."""
    extra = [p for p in (PRESET,) + BASELINES if PRESETS[p] not in combos]
    return list(combos) + extra


def sweep(
    windows: Sequence[Any],
    topo: Any,
    cost: Any,
    token_cap: int,
    placements: Optional[Sequence[str]] = None,
    packings: Optional[Sequence[str]] = None,
    replications: Optional[Sequence[str]] = None,
    loads: str = DEFAULT_LOADS,
    seed: int = DEFAULT_SEED,
    progress: Optional[Callable[[str, int], None]] = None,
    **options: Any,
) -> Dict[str, Any]:
    """Plans windows[1:] with every combination (and the preset and baselines, see the module
    docs) and returns `summarise_sweep` of the rows, with the rows under ``"rows"``."""
    combos = combinations(placements, packings, replications, loads)
    rows = compare(windows, topo, cost, token_cap, sweep_policies(combos), seed=seed, progress=progress, **options)
    out = summarise_sweep(rows, combos)
    out["loads"] = loads
    out["rows"] = rows
    return out


def _label(pol: Policy) -> str:
    return resolve(pol)[0]


def _entry(name: str, rows: Dict[int, Row], preset: Dict[int, Row], best: Dict[int, Row]) -> Dict[str, Any]:
    steps = [r.step_time for r in rows.values()]

    def ratio(den: Dict[int, Row]) -> float:
        rel = [den[w].step_time / rows[w].step_time for w in sorted(rows) if w in den]
        return float(np.median(rel)) if rel else math.nan

    return {
        "policy": name,
        "windows": len(steps),
        "step_s": float(np.median(steps)),
        "step_min": float(min(steps)),
        "step_max": float(max(steps)),
        "vs_preset": ratio(preset),
        "vs_best": ratio(best),
        "cross_node_bytes_per_token": float(np.median([r.cross_node_bytes_per_token for r in rows.values()])),
        "bubble": float(
            np.median([r.pipeline_bubble / r.step_time if r.step_time > 0 else 0.0 for r in rows.values()])
        ),
        "plan_s": float(np.median([r.plan_seconds for r in rows.values()])),
    }


def _run_name(preset: str, combos: Sequence[Policy]) -> str:
    """The name a preset's rows carry in a sweep: a preset whose policy is a combination ran as
    that combination (``placement+packing+replication``)."""
    pol = PRESETS[preset]
    return _label(pol) if pol in combos else preset


def summarise_sweep(rows: Sequence[Row], combos: Sequence[Policy]) -> Dict[str, Any]:
    """``entries`` (one per combination, and the preset's when no combination is it; the
    preset's marked ``preset``; sorted by median step time), ``best_baseline`` (with
    ``best_of``: which baseline preset won each window) and ``verdict``."""
    by: Dict[str, Dict[int, Row]] = {}
    for r in rows:
        by.setdefault(r.policy, {})[r.window] = r
    preset_name = _run_name(PRESET, combos)
    if preset_name not in by:
        raise RoutepackError(f"rows: the {PRESET!r} preset did not run; the sweep's ratios need it")
    preset = by[preset_name]
    best: Dict[int, Row] = {}
    winners: Dict[int, str] = {}
    for name in BASELINES:
        for w, r in by.get(_run_name(name, combos), {}).items():
            if w not in best or r.step_time < best[w].step_time:
                best[w], winners[w] = r, name
    shown = list(combos) + ([] if PRESETS[PRESET] in combos else [PRESETS[PRESET]])
    entries = []
    for pol in shown:
        name = _label(pol) if pol in combos else PRESET
        e = _entry(name, by[name], preset, best)
        e.update(
            placement=pol.placement,
            packing=pol.packing,
            replication=pol.replication,
            loads=pol.loads,
            preset=(name == preset_name),
        )
        entries.append(e)
    entries.sort(key=lambda e: (e["step_s"], e["policy"]))
    best_entry = None
    if best:
        best_entry = _entry(BEST, best, preset, best)
        best_entry["best_of"] = {str(w): winners[w] for w in sorted(winners)}
    fastest = entries[0]
    mine = next(e for e in entries if e["preset"])
    gap = mine["step_s"] / fastest["step_s"] - 1.0
    verdict = {
        "preset": PRESET,
        "rank": entries.index(mine) + 1,
        "of": len(entries),
        "fastest": fastest["policy"],
        "gap": gap,
        "is_fastest": mine is fastest,
        "within_tolerance": gap <= TOLERANCE,
        "tolerance": TOLERANCE,
    }
    return {"entries": entries, "best_baseline": best_entry, "verdict": verdict}


def format_sweep(summary: Dict[str, Any], legend: bool = True) -> str:
    """Fixed-width tables of `summarise_sweep` output, at most `routepack.tables.WIDTH` (100)
    columns wide (the preset's row marked ``*``; the step time's range over windows and the
    plan time in the second table), the best baseline as the last row, the verdict and a
    legend."""
    entries = list(summary["entries"])
    b = summary.get("best_baseline")
    shown = entries + ([b] if b is not None else [])

    def num(key: str, fmt: str, scale: float = 1.0) -> List[str]:
        return [format(e[key] / scale, fmt) if math.isfinite(e[key]) else "-" for e in shown]

    labels = [
        ("", ["*" if e["preset"] else "" for e in entries] + ([""] if b is not None else [])),
        ("placement", [e["placement"] for e in entries] + ([BEST] if b is not None else [])),
        ("packing", [e["packing"] for e in entries] + ([""] if b is not None else [])),
        ("replication", [e["replication"] for e in entries] + ([""] if b is not None else [])),
    ]
    columns = [
        ("step s", num("step_s", ".4f"), 0),
        ("thr/preset", num("vs_preset", ".4f"), 0),
        ("thr/best", num("vs_best", ".4f"), 0),
        ("xnode kB/tok", num("cross_node_bytes_per_token", ".2f", 1e3), 0),
    ]
    pipelined = any(e.get("bubble", 0.0) > 0 for e in shown)
    if pipelined:
        columns.append(("bubble", num("bubble", ".1%"), 1))
    columns += [
        ("min s", num("step_min", ".4f"), 1),
        ("max s", num("step_max", ".4f"), 1),
        ("plan s", num("plan_s", ".3f"), 1),
    ]
    lines = [text_tables(labels, columns)]
    if b is not None:
        counts: Dict[str, int] = {}
        for p in b["best_of"].values():
            counts[p] = counts.get(p, 0) + 1
        lines.append(
            fill(
                "best baseline per window: "
                + ", ".join(f"{p} x{c}" for p, c in sorted(counts.items(), key=lambda x: -x[1])),
                indent="  ",
            )
        )
    lines += ["", verdict_text(summary["verdict"])]
    if legend:
        lines += ["", sweep_legend(pipelined)]
    return "\n".join(lines)


def verdict_text(v: Dict[str, Any]) -> str:
    """The sweep's verdict (`summarise_sweep`'s ``verdict``) as a sentence."""
    if v["is_fastest"]:
        return f"* the {v['preset']} preset is the fastest of the {v['of']} entries"
    where = "within" if v["within_tolerance"] else "NOT within"
    return fill(
        f"* the {v['preset']} preset ranks {v['rank']} of {v['of']}: its median step is "
        f"{v['gap']:.2%} above the fastest ({v['fastest']}), {where} {v['tolerance']:.1%}",
        indent="  ",
    )


def sweep_legend(bubble: bool = False) -> str:
    """What every column of `format_sweep` means (``bubble``: with the pipeline bubble's)."""
    items: List[Tuple[str, str]] = [
        ("step s", "median over windows of the predicted step time (seconds, routepack.simulate)"),
        ("min/max s", "the fastest and slowest window's step time (second table)"),
        (
            "thr/preset",
            f"throughput over the {PRESET} preset's: median over windows of the per-window ratio "
            "(above 1: faster than the preset)",
        ),
        (
            "thr/best",
            "the same over the best baseline's (per window the fastest of "
            + ", ".join(BASELINES)
            + ", each in its own configuration)",
        ),
        ("xnode kB/tok", CROSS_NODE_LEGEND),
        ("plan s", "median planner wall time on this machine (second table)"),
    ]
    if bubble:
        items.append(("bubble", "median over windows of the pipeline bubble's share of the step (second table)"))
    width = max(len(k) for k, _ in items)
    out = [fill("columns (every combination plans from its loads setting; the first column marks the preset):")]
    for k, text in items:
        out.append(textwrap.fill(text, WIDTH, initial_indent=f"  {k:<{width}}  ", subsequent_indent=" " * (width + 4)))
    return "\n".join(out)


__all__ = [
    "PRESET",
    "TOLERANCE",
    "combinations",
    "format_sweep",
    "summarise_sweep",
    "sweep",
    "sweep_legend",
    "sweep_policies",
    "verdict_text",
]
