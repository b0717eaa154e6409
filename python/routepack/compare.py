"""Plans successive windows with several policies and scores each with `simulate`: the
comparison behind `routepack demo` and `routepack bench`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from routepack.errors import RoutepackError
from routepack.planner import plan_window
from routepack.policies import PRESETS, resolve
from routepack.simulate import lower_bound_micro, simulate


@dataclass
class Row:
    """One (policy, window) result."""

    policy: str
    window: int
    step_time: float
    throughput: float
    fraction_of_ideal: float
    attention: float
    expert: float
    all_to_all: float
    replication: float
    migration: float
    imbalance: float
    num_micro: int
    micro_lower_bound: int
    plan_seconds: float
    ideal_time: float = float("nan")
    imbalance_map: Any = None  # float64 [G, M, L] for figures


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
    policies: Optional[Iterable[str]] = None,
    seed: int = 0,
    progress: Optional[Callable[[str, int], None]] = None,
    **options: Any,
) -> List[Row]:
    """Plans windows[1:] with every policy (windows[0] only feeds history), carrying each
    policy's placement from window to window so migration is charged, and scores every plan
    with `simulate` under the same coefficients."""
    if len(windows) < 2:
        raise RoutepackError(f"windows: need at least 2 (the first only feeds history), got {len(windows)}")
    names = list(policies) if policies is not None else available_presets()
    rows: List[Row] = []
    previous: Dict[str, Any] = {}
    for i in range(1, len(windows)):
        w, prev_w = windows[i], windows[i - 1]
        for name in names:
            t0 = time.perf_counter()
            plan = plan_window(w, topo, cost, token_cap=token_cap, policy=name,
                               previous=previous.get(name), previous_window=prev_w, seed=seed + i,
                               **options)
            seconds = time.perf_counter() - t0
            plan.validate(w, topo, token_cap)
            previous[name] = plan.placement
            sim = simulate(plan, w, topo, cost, token_cap)
            rows.append(Row(
                policy=name, window=i, step_time=sim.step_time, throughput=sim.throughput,
                fraction_of_ideal=sim.fraction_of_ideal, attention=sim.attention, expert=sim.expert,
                all_to_all=sim.all_to_all, replication=sim.replication, migration=sim.migration,
                imbalance=sim.mean_imbalance, num_micro=plan.num_micro,
                micro_lower_bound=lower_bound_micro(w, topo, token_cap), plan_seconds=seconds,
                ideal_time=sim.ideal_time, imbalance_map=sim.imbalance,
            ))
            if progress is not None:
                progress(name, i)
    return rows


def summarise(rows: Sequence[Row], baseline: str = "static") -> List[Dict[str, Any]]:
    """Median over windows per policy; throughput relative to `baseline` is the median of
    per-window ratios."""
    by: Dict[str, List[Row]] = {}
    for r in rows:
        by.setdefault(r.policy, []).append(r)
    base = {r.window: r.throughput for r in by.get(baseline, [])}
    out = []
    for name, rs in by.items():
        med = lambda f: float(np.median([f(r) for r in rs]))  # noqa: E731
        rel = [r.throughput / base[r.window] for r in rs if r.window in base]
        out.append({
            "policy": name,
            "windows": len(rs),
            "vs_" + baseline: float(np.median(rel)) if rel else float("nan"),
            "of_ideal": med(lambda r: r.fraction_of_ideal),
            "step_s": med(lambda r: r.step_time),
            "attention": med(lambda r: r.attention),
            "expert": med(lambda r: r.expert),
            "all_to_all": med(lambda r: r.all_to_all),
            "replication": med(lambda r: r.replication),
            "migration": med(lambda r: r.migration),
            "imbalance": med(lambda r: r.imbalance),
            "micro": med(lambda r: r.num_micro),
            "micro_lb": med(lambda r: r.micro_lower_bound),
            "plan_s": med(lambda r: r.plan_seconds),
        })
    # docs/design.md's `ideal`: every max replaced by the mean (a bound, not a plan)
    ref = by.get(baseline) or next(iter(by.values()), [])
    if ref:
        nan = float("nan")
        out.append({
            "policy": "ideal (bound)", "windows": len(ref),
            "vs_" + baseline: float(np.median([r.step_time / r.ideal_time for r in ref])),
            "of_ideal": 1.0, "step_s": float(np.median([r.ideal_time for r in ref])),
            "attention": nan, "expert": nan, "all_to_all": nan, "replication": 0.0, "migration": 0.0,
            "imbalance": 1.0, "micro": float(np.median([r.micro_lower_bound for r in ref])),
            "micro_lb": float(np.median([r.micro_lower_bound for r in ref])), "plan_s": 0.0,
        })
    return out


def format_table(summary: Sequence[Dict[str, Any]], baseline: str = "static") -> str:
    """Fixed-width table of `summarise` output."""
    cols = [
        ("policy", "policy", "{:<22}"),
        ("vs_" + baseline, "thr/" + baseline, "{:>10.3f}"),
        ("of_ideal", "of ideal", "{:>9.1%}"),
        ("step_s", "step s", "{:>8.3f}"),
        ("attention", "attn s", "{:>7.3f}"),
        ("expert", "expert s", "{:>8.3f}"),
        ("all_to_all", "a2a s", "{:>7.3f}"),
        ("replication", "repl s", "{:>7.3f}"),
        ("migration", "migr s", "{:>7.3f}"),
        ("imbalance", "imbal", "{:>6.3f}"),
        ("micro", "M", "{:>4.0f}"),
        ("micro_lb", "M lb", "{:>5.0f}"),
        ("plan_s", "plan s", "{:>7.3f}"),
    ]
    head = " ".join(fmt.replace(".3f", "").replace(".1%", "").replace(".0f", "").format(title)
                    for _, title, fmt in cols)
    lines = [head, "-" * len(head)]
    for row in summary:
        lines.append(" ".join(fmt.format(row[key]) for key, _, fmt in cols))
    return "\n".join(lines)
