"""Plans successive windows with several policies and scores each with `simulate`: the
comparison behind `routepack demo` and `routepack bench`.

Every ratio is quoted per window and then summarised (median, range): against ``static``,
and against the **best baseline**, per window the fastest plan of every baseline preset that
ran (`BASELINES`: each baseline in its configurations, e.g. EPLB's global and hierarchical
policies, previous and this window's loads). Two references sit under the plans: the
**balanced** step time (docs/design.md's ``ideal``: every max over ranks replaced by the
mean, at uniform all-to-all traffic; a reference, not a bound, since a plan that keeps
tokens inside their node can beat it) and, where `simulate` reports it, the **lower bound**
(``fraction_of_bound``: no valid plan for the window is faster).
"""

from __future__ import annotations

import math
import textwrap
import time
from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from routepack._checks import boolean, positive_int, restated
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.planner import plan_window
from routepack.stages.context import DEFAULT_SEED
from routepack.policies import PRESETS, Policy, resolve
from routepack.simulate import lower_bound_micro, simulate
from routepack.tables import WIDTH, fill, text_tables
from routepack.window import Window

NAN = float("nan")

#: The baselines' presets, every configuration of each that `routepack bench` runs; the
#: ``best baseline`` row is, per window, the fastest of those that ran.
BASELINES = (
    "static",
    "hot_n",
    "eplb",
    "eplb_oracle",
    "eplb_hierarchical",
    "eplb_hierarchical_oracle",
    "relibra",
    "moonep",
    "ultraep",
)

#: What the cross-node column of every bench table means (`SimResult.cross_node_bytes_per_token`).
CROSS_NODE_LEGEND = (
    "all-to-all bytes between nodes per window token, kB (10^3 B): routed tokens sent to a rank "
    "on another node, dispatch + combine, forward + backward, over the window's tokens; 0 when "
    "an EP group fits in one node"
)

#: Names of the summary rows that are not presets.
BEST = "best baseline"
#: The preset the tables and figures give each policy's speed-up over (``vs_<baseline>``) by default.
DEFAULT_BASELINE = "static"
BALANCED = "balanced (reference)"
BOUND = "lower bound"


@dataclass
class Row:
    """One (policy, window) result."""

    policy: str
    window: int
    step_time: float
    throughput: float
    #: ``ideal_time / step_time``: above 1 when the plan beats the balanced reference
    fraction_of_balanced: float
    attention: float
    expert: float
    all_to_all: float
    replication: float
    migration: float
    imbalance: float
    num_micro: int
    micro_lower_bound: int
    plan_seconds: float
    ideal_time: float = NAN
    #: ``lower_bound_time / step_time`` (at most 1); NaN while `simulate` does not report it
    fraction_of_bound: float = NAN
    lower_bound_time: float = NAN
    #: `SimResult.cross_node_bytes_per_token`: all-to-all bytes between nodes per window token
    cross_node_bytes_per_token: float = NAN
    imbalance_map: Any = None  # float64 [G, M, L] for figures
    #: `SimResult.redundant_grads`: the once-per-step sum of redundant experts' gradients
    redundant_grads: float = 0.0
    #: `SimResult.pipeline_bubble`: seconds the busiest pipeline stage waits (0 without a pipeline)
    pipeline_bubble: float = 0.0


def _items(value: Any, name: str, cls: type, what: str) -> List[Any]:
    """``value`` as a list whose entries are all ``cls``; a non-sequence (a string, a mapping,
    a scalar) or a wrong entry raises `RoutepackTypeError` naming the argument or the entry."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise RoutepackTypeError(f"{name}: expected a sequence of {what}, got {type(value).__name__}")
    out = list(value)
    for i, item in enumerate(out):
        if not isinstance(item, cls):
            raise RoutepackTypeError(f"{name}[{i}]: expected a {what}, got {type(item).__name__}")
    return out


def check_rows(rows: Any, name: str = "rows") -> List[Row]:
    """``rows`` as a list of `Row` (what `compare` returns), else `RoutepackTypeError`."""
    return _items(rows, name, Row, "routepack.compare.Row")


def _check_entries(entries: Any, name: str, keys: Sequence[str]) -> List[Dict[str, Any]]:
    """``entries`` as a list of dicts holding ``keys`` (what `summarise` / `ratios` return)."""
    out = _items(entries, name, Mapping, "dict")
    for i, e in enumerate(out):
        missing = [k for k in keys if k not in e]
        if missing:
            raise RoutepackError(f"{name}[{i}]: missing keys {missing}")
    return out


def _name(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RoutepackTypeError(f"{name}: expected a str, got {type(value).__name__} {value!r}")
    return value


def available_presets() -> List[str]:
    """Presets whose every stage is implemented, in PRESETS order."""
    names = []
    for name in PRESETS:
        try:
            resolve(name)
        except ValueError:
            continue
        names.append(name)
    return names


def compare(
    windows: Sequence[Any],
    topo: Any,
    cost: Any,
    token_cap: int,
    policies: Optional[Iterable[Union[str, Policy]]] = None,
    seed: int = DEFAULT_SEED,
    progress: Optional[Callable[[str, int], None]] = None,
    **options: Any,
) -> List[Row]:
    """Plans windows[1:] with every policy (windows[0] only feeds history), carrying each
    policy's placement from window to window so migration is charged, and scores every plan
    with `simulate` under the same coefficients. A policy is a preset name or a `Policy`
    (its rows are named ``placement+packing+replication``, as `resolve` names it)."""
    windows = _items(windows, "windows", Window, "routepack.Window")
    if len(windows) < 2:
        raise RoutepackError(f"windows: need at least 2 (the first only feeds history), got {len(windows)}")
    if policies is not None and (isinstance(policies, (str, bytes, Mapping)) or not isinstance(policies, Iterable)):
        raise RoutepackTypeError(
            f"policies: expected a sequence of preset names or Policy objects, got "
            f"{type(policies).__name__} {policies!r}"
        )
    seed = positive_int(seed, "seed", minimum=0, maximum=2**64 - 1 - len(windows))  # each window plans with seed + i
    if progress is not None and not callable(progress):
        raise RoutepackTypeError(f"progress: expected None or a callable(label, n), got {type(progress).__name__}")
    chosen = list(policies) if policies is not None else available_presets()
    names = []
    for i, pol in enumerate(chosen):
        try:
            names.append(resolve(pol)[0])
        except RoutepackError as e:
            raise restated(e, {"policy": f"policies[{i}]"}) from None
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        # rows, and the placement carried to the next window, are keyed by name
        raise RoutepackError(f"policies: {twice} appear more than once")
    rows: List[Row] = []
    previous: Dict[str, Any] = {}
    for i in range(1, len(windows)):
        w, prev_w = windows[i], windows[i - 1]
        for name, pol in zip(names, chosen):
            t0 = time.perf_counter()
            plan = plan_window(
                w,
                topo,
                cost,
                token_cap=token_cap,
                policy=pol,
                previous=previous.get(name),
                previous_window=prev_w,
                seed=seed + i,
                **options,
            )
            seconds = time.perf_counter() - t0
            plan.validate(w, topo, token_cap)
            previous[name] = plan.placement
            sim = simulate(plan, w, topo, cost, token_cap)
            summary = sim.summary()  # the bound's keys only where simulate reports them
            rows.append(
                Row(
                    policy=name,
                    window=i,
                    step_time=sim.step_time,
                    throughput=sim.throughput,
                    fraction_of_balanced=sim.fraction_of_balanced,
                    attention=sim.attention,
                    expert=sim.expert,
                    all_to_all=sim.all_to_all,
                    replication=sim.replication,
                    migration=sim.migration,
                    imbalance=sim.mean_imbalance,
                    num_micro=plan.num_micro,
                    micro_lower_bound=lower_bound_micro(w, topo, token_cap),
                    plan_seconds=seconds,
                    ideal_time=sim.ideal_time,
                    fraction_of_bound=float(summary.get("fraction_of_bound", NAN)),
                    lower_bound_time=float(summary.get("lower_bound_time", NAN)),
                    cross_node_bytes_per_token=sim.cross_node_bytes_per_token,
                    imbalance_map=sim.imbalance,
                    redundant_grads=sim.redundant_grads,
                    pipeline_bubble=sim.pipeline_bubble,
                )
            )
            if progress is not None:
                progress(name, i)
    return rows


def _by_policy(rows: Sequence[Row]) -> Dict[str, Dict[int, Row]]:
    by: Dict[str, Dict[int, Row]] = {}
    for r in rows:
        by.setdefault(r.policy, {})[r.window] = r
    return by


def best_baseline(rows: Sequence[Row]) -> List[Row]:
    """Per window, the fastest row of the `BASELINES` that ran, renamed ``best baseline``
    (the winner's name is in `best_of`)."""
    rows = check_rows(rows)
    out = []
    for window in sorted({r.window for r in rows}):
        cands = [r for r in rows if r.window == window and r.policy in BASELINES]
        if cands:
            out.append(replace(min(cands, key=lambda r: r.step_time), policy=BEST))
    return out


def best_of(rows: Sequence[Row]) -> Dict[int, str]:
    """Per window, which baseline preset the ``best baseline`` row is."""
    rows = check_rows(rows)
    out = {}
    for window in sorted({r.window for r in rows}):
        cands = [r for r in rows if r.window == window and r.policy in BASELINES]
        if cands:
            out[window] = min(cands, key=lambda r: r.step_time).policy
    return out


def _ratios(num: Dict[int, Row], den: Dict[int, Row]) -> List[float]:
    return [num[w].throughput / den[w].throughput for w in sorted(num) if w in den]


def summarise(rows: Sequence[Row], baseline: str = DEFAULT_BASELINE) -> List[Dict[str, Any]]:
    """Median over windows per policy, then the ``best baseline`` row and the references
    (``balanced``; ``lower bound`` where `simulate` reports it). ``vs_<baseline>`` and
    ``vs_best`` are medians of per-window throughput ratios."""
    rows = check_rows(rows)
    baseline = _name(baseline, "baseline")
    by = _by_policy(rows)
    best = {r.window: r for r in best_baseline(rows)}
    base = by.get(baseline, {})
    out = []
    groups = list(by.items()) + ([(BEST, best)] if best else [])
    winners = best_of(rows)
    for name, per_window in groups:
        rs = list(per_window.values())
        med = lambda f: float(np.median([f(r) for r in rs]))  # noqa: E731
        rel = _ratios(per_window, base)
        vs_best = _ratios(per_window, best)
        entry = {
            "policy": name,
            "windows": len(rs),
            "vs_" + baseline: float(np.median(rel)) if rel else NAN,
            "vs_best": float(np.median(vs_best)) if vs_best else NAN,
            "of_balanced": med(lambda r: r.fraction_of_balanced),
            "of_bound": med(lambda r: r.fraction_of_bound),
            "step_s": med(lambda r: r.step_time),
            "attention": med(lambda r: r.attention),
            "expert": med(lambda r: r.expert),
            "all_to_all": med(lambda r: r.all_to_all),
            "replication": med(lambda r: r.replication),
            "migration": med(lambda r: r.migration),
            "redundant_grads": med(lambda r: r.redundant_grads),
            "bubble": med(lambda r: r.pipeline_bubble / r.step_time if r.step_time > 0 else 0.0),
            "imbalance": med(lambda r: r.imbalance),
            "micro": med(lambda r: r.num_micro),
            "micro_lb": med(lambda r: r.micro_lower_bound),
            "cross_node_bytes_per_token": med(lambda r: r.cross_node_bytes_per_token),
            "plan_s": med(lambda r: r.plan_seconds),
        }
        if name == BEST:
            entry["best_of"] = {str(w): p for w, p in winners.items()}
        out.append(entry)
    # the references: plan-independent times per window (window, topology, cost model)
    ref = base or next(iter(by.values()), {})
    if ref:
        windows = sorted(ref)
        m_lb = float(np.median([ref[w].micro_lower_bound for w in windows]))

        def reference(name: str, times: Dict[int, float]) -> Dict[str, Any]:
            thr = {w: ref[w].throughput * ref[w].step_time / times[w] for w in windows}
            return {
                "policy": name,
                "windows": len(windows),
                "vs_" + baseline: float(np.median([ref[w].step_time / times[w] for w in windows])),
                "vs_best": (
                    float(np.median([thr[w] / best[w].throughput for w in windows if w in best])) if best else NAN
                ),
                "of_balanced": float(np.median([ref[w].ideal_time / times[w] for w in windows])),
                "of_bound": float(np.median([ref[w].lower_bound_time / times[w] for w in windows])),
                "step_s": float(np.median([times[w] for w in windows])),
                "attention": NAN,
                "expert": NAN,
                "all_to_all": NAN,
                "replication": NAN,
                "migration": NAN,
                "redundant_grads": NAN,
                "bubble": NAN,
                "imbalance": 1.0,
                "micro": m_lb,
                "micro_lb": m_lb,
                "cross_node_bytes_per_token": NAN,
                "plan_s": NAN,
            }

        out.append(reference(BALANCED, {w: ref[w].ideal_time for w in windows}))
        if all(math.isfinite(ref[w].lower_bound_time) for w in windows):
            out.append(reference(BOUND, {w: ref[w].lower_bound_time for w in windows}))
    return out


def ratios(rows: Sequence[Row], target: str = "routepack") -> List[Dict[str, Any]]:
    """``target``'s throughput over every other policy's and the best baseline's, per window:
    median, min and max over the windows both ran (empty when ``target`` did not run)."""
    rows = check_rows(rows)
    target = _name(target, "target")
    by = _by_policy(rows)
    if target not in by:
        return []
    best = {r.window: r for r in best_baseline(rows)}
    out = []
    for name, per_window in ([(BEST, best)] if best else []) + [(n, p) for n, p in by.items() if n != target]:
        rel = _ratios(by[target], per_window)
        if rel:
            out.append(
                {
                    "policy": target,
                    "against": name,
                    "windows": len(rel),
                    "median": float(np.median(rel)),
                    "min": float(min(rel)),
                    "max": float(max(rel)),
                }
            )
    return out


def _has_bound(summary: Sequence[Dict[str, Any]]) -> bool:
    return any(math.isfinite(s.get("of_bound", NAN)) for s in summary)


def _has_bubble(summary: Sequence[Dict[str, Any]]) -> bool:
    """Whether a plan of the summary ran a pipeline (a bubble > 0)."""
    return any(math.isfinite(b) and b > 0 for b in (s.get("bubble", NAN) for s in summary))


def table_columns(
    baseline: str = DEFAULT_BASELINE, bound: bool = True, bubble: bool = False
) -> List[Tuple[str, str, str, int]]:
    """``(key, title, format, group)`` of every column of `format_table` (group 0: how fast each
    plan is; group 1: where its step time goes). ``of bound`` only with ``bound``; ``bubble``
    (the pipeline bubble's share of the step) only with ``bubble``."""
    baseline = _name(baseline, "baseline")
    cols = [
        ("vs_" + baseline, "thr/" + baseline, ".3f", 0),
        ("vs_best", "thr/best", ".3f", 0),
        ("of_balanced", "of balanced", ".1%", 0),
    ]
    if bound:
        cols.append(("of_bound", "of bound", ".1%", 0))
    cols += [
        ("step_s", "step s", ".3f", 0),
        ("cross_node_kb", "xnode kB/tok", ".2f", 0),
        ("plan_s", "plan s", ".3f", 0),
        ("attention", "attn s", ".3f", 1),
        ("expert", "expert s", ".3f", 1),
        ("all_to_all", "a2a s", ".3f", 1),
        ("replication", "repl s", ".3f", 1),
        ("migration", "migr s", ".3f", 1),
        ("redundant_grads", "rgrad s", ".3f", 1),
    ]
    if bubble:
        cols.append(("bubble", "bubble", ".1%", 1))
    cols += [
        ("imbalance", "imbal", ".3f", 1),
        ("micro", "M", ".0f", 1),
        ("micro_lb", "M lb", ".0f", 1),
    ]
    return cols


def table_cells(
    summary: Sequence[Dict[str, Any]], baseline: str = DEFAULT_BASELINE
) -> Tuple[List[str], List[Tuple[str, List[str], int]]]:
    """The policy names of `summarise` output and, per column of `table_columns`, its title,
    its formatted cells (``-`` where a row has no value) and its group."""
    baseline = _name(baseline, "baseline")
    summary = _check_entries(summary, "summary", ("policy",))
    cols = table_columns(baseline, _has_bound(summary), _has_bubble(summary))
    # cross_node_kb is derived below from cross_node_bytes_per_token (NaN where a row lacks it)
    _check_entries(summary, "summary", [key for key, _, _, _ in cols if key != "cross_node_kb"])
    rows = [{**r, "cross_node_kb": r.get("cross_node_bytes_per_token", NAN) / 1e3} for r in summary]

    def cell(fmt: str, value: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return "-"
        return format(value, fmt)

    names = [str(r["policy"]) for r in rows]
    return names, [(title, [cell(fmt, r[key]) for r in rows], group) for key, title, fmt, group in cols]


def format_table(summary: Sequence[Dict[str, Any]], baseline: str = DEFAULT_BASELINE, legend: bool = True) -> str:
    """Fixed-width tables of `summarise` output, at most `routepack.tables.WIDTH` (100)
    columns wide: how fast each plan is, then where its step time goes; with a legend of the
    columns under them. The ``of bound`` column appears when `simulate` reports the lower
    bound."""
    baseline = _name(baseline, "baseline")
    legend = boolean(legend, "legend")
    names, columns = table_cells(summary, baseline)
    text = text_tables([("policy", names)], columns)
    if legend:
        text += "\n\n" + table_legend(baseline, _has_bound(summary), _has_bubble(summary))
    return text


def legend_entries(baseline: str, bound: bool, bubble: bool) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    """``(columns, rows)``: what every column and every reference row of `format_table` means,
    as (name, text) pairs."""
    baseline = _name(baseline, "baseline")
    bound = boolean(bound, "bound")
    bubble = boolean(bubble, "bubble")
    items = [
        ("thr/" + baseline, f"throughput over {baseline}'s: median over windows of the per-window ratio"),
        ("thr/best", "throughput over the best baseline's, the same way"),
        (
            "of balanced",
            "balanced step time / this step time; balanced (docs/design.md's `ideal`) replaces every "
            "max over ranks by the mean at uniform all-to-all traffic: a reference, not a bound "
            "(a plan that keeps tokens in their node can pass 100%)",
        ),
    ]
    if bound:
        items.append(("of bound", "lower bound / this step time: no valid plan is faster than the bound (<= 100%)"))
    items += [
        (
            "step s",
            "predicted step time (seconds) of the slowest EP group; in each plan the six parts "
            "attn s ... rgrad s add up to it (less what overlap hides)",
        ),
        ("attn s", "attention and dense work (projections, shared experts), forward + backward"),
        ("expert s", "routed-expert compute on the most loaded EP rank of each exchange"),
        ("a2a s", "dispatch + combine all-to-all, forward + backward"),
        ("repl s", "hot-expert copies and their gradients not hidden behind attention (0: all hidden, or none)"),
        ("migr s", "moving experts with their optimizer state since the previous window (never hidden)"),
        ("rgrad s", "summing redundant experts' gradients over the EP group, once per step (never hidden)"),
    ]
    if bubble:
        items += [
            (
                "bubble",
                "pipeline bubble / step time: the slowest EP group's 1F1B schedule (warm-up, cool-down, "
                "sends between stages, stages waiting on each other) less its busiest stage's work; "
                "under a pipeline the parts attn s ... repl s are that stage's and the bubble adds to them",
            )
        ]
    items += [
        ("imbal", "expert tokens max / mean over EP ranks, averaged over exchanges (1 = even)"),
        ("M", "microbatch steps per DP rank"),
        ("M lb", "the fewest any plan can use: ceil(ceil(total tokens / cap) / dp)"),
        ("xnode kB/tok", CROSS_NODE_LEGEND),
        ("plan s", "planner wall time on this machine"),
    ]
    rows = [
        ("best baseline", "per window the fastest baseline preset that ran (" + ", ".join(BASELINES) + ")"),
        ("balanced", "the balanced reference's time (above); 'lower bound' the bound's"),
    ]
    return items, rows


def table_legend(baseline: str = DEFAULT_BASELINE, bound: bool = True, bubble: bool = False) -> str:
    """What every column and reference row of `format_table` means."""
    items, rows = legend_entries(baseline, bound, bubble)
    width = max(len(k) for k, _ in items + rows)

    def entry(key: str, text: str) -> str:
        return textwrap.fill(
            text,
            WIDTH,
            initial_indent=f"  {key:<{width}}  ",
            subsequent_indent=" " * (width + 4),
            break_on_hyphens=False,
        )

    out = ["columns (medians over windows):"] + [entry(k, v) for k, v in items]
    out += ["rows:"] + [entry(k, v) for k, v in rows]
    return "\n".join(out)


def baseline_notes(topo: Any, num_experts: int, expert_groups: int, policies: Iterable[str]) -> List[str]:
    """Why two baselines' rows are equal, where they are by construction: EPLB's hierarchical
    configuration (one expert group per node of an EP group, `eplb_hierarchical`) is the
    ``eplb`` preset itself when that gives the model's own expert-group count, e.g. where an
    EP group lies in one node and the model routes without groups (``tiny``)."""
    names = set(policies)
    if not names & {"eplb_hierarchical", "eplb_hierarchical_oracle"}:
        return []
    nodes = int(topo.nodes_per_group)
    per_node = nodes if nodes > 1 and int(num_experts) % nodes == 0 else 1
    groups = int(expert_groups)
    if per_node != groups:
        return []
    if nodes == 1:
        why = (
            "an EP group of this topology lies in one node, so one expert group per node is a single group, "
            f"as many as the model has ({groups}), and EPLB runs its global policy for both"
        )
    else:
        why = (
            f"one expert group per node gives {per_node} groups here, as many as the model has, so EPLB runs "
            "the same hierarchical policy for both"
        )
    return [f"note: the eplb_hierarchical rows equal the eplb rows (and _oracle eplb_oracle's) by construction: {why}"]


def format_ratios(ratio_rows: Sequence[Dict[str, Any]], winners: Optional[Dict[int, str]] = None) -> str:
    """`ratios` as text: one line per baseline, median and range over windows."""
    ratio_rows = _check_entries(ratio_rows, "ratio_rows", ("policy", "against", "windows", "median", "min", "max"))
    if winners is not None and not isinstance(winners, Mapping):
        raise RoutepackTypeError(f"winners: expected a dict of window -> preset, got {type(winners).__name__}")
    if not ratio_rows:
        return ""
    target = ratio_rows[0]["policy"]
    n = ratio_rows[0]["windows"]
    lines = [fill(f"{target}'s throughput over each policy, per window (median, range over {n} window(s)):")]
    width = max(len(r["against"]) for r in ratio_rows)
    for r in ratio_rows:
        line = f"  {r['against']:<{width}}  {r['median']:.3f}x  ({r['min']:.3f}-{r['max']:.3f})"
        if r["against"] == BEST and winners:
            counts: Dict[str, int] = {}
            for p in winners.values():
                counts[p] = counts.get(p, 0) + 1
            line += "  best per window: " + ", ".join(
                f"{p} x{c}" for p, c in sorted(counts.items(), key=lambda x: -x[1])
            )
        lines.append(fill(line, indent=" " * (width + 4)))
    return "\n".join(lines)


__all__ = [
    "BALANCED",
    "BASELINES",
    "BEST",
    "BOUND",
    "CROSS_NODE_LEGEND",
    "Row",
    "available_presets",
    "baseline_notes",
    "best_baseline",
    "best_of",
    "check_rows",
    "compare",
    "format_ratios",
    "format_table",
    "legend_entries",
    "ratios",
    "summarise",
    "table_cells",
    "table_columns",
    "table_legend",
]
