"""Timelines: one simulated step per rank as a Chrome trace-event file (``traceEvents``), which
Perfetto (ui.perfetto.dev) and chrome://tracing open.

The parts come from the simulator's own exchanges (``_core.simulate_terms``): the cost model is
not priced again here. In one step, rank r of EP group g (on pipeline stage s) spends, summed
over the microbatches and MoE layers it runs (docs/design.md, "The cost model"):

* ``attention``: its own cells' attention, all passes; ``attention wait``: the wait for the
  slowest rank of its group in each exchange (the exchange's attention less its own);
* ``dispatch`` and ``combine``: the exposed all-to-all (link time and latencies less what the
  overlap hides), half each (they move the same tokens);
* ``experts``: its own expert work, all passes; ``expert wait``: the wait for the busiest rank;
* ``replica traffic``: the exchanges' exposed replica copies and gradient reduction;
* ``pipeline bubble``: its group's pipeline time less its stage's work (0 without a pipeline);
* ``gradient sum``: the once-per-step sum of redundant experts' gradients (``redundant_grads``);
* ``migration``: the exposed expert moves between windows;
* ``group wait``: the wait for the slowest EP group at the step's end (``step_time`` less its
  group's time).

Every rank's parts add up to the plan's simulated ``step_time``. Tracks: one per rank, numbered
``s * dp + g * ep + r`` (`Topology`'s global rank: pipeline outermost); one event per part,
laid end to end from 0 in the order above (a part of 0 s is kept, so every track has them all).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from routepack import _core
from routepack._checks import WINDOW_WORDS, callers_words, instance_of
from routepack.model import CostModel, Topology
from routepack.plan import Plan
from routepack.simulate import SimResult, lower_bound_micro
from routepack.window import Window

#: the parts of a rank's step, in the order a track lays them out
PARTS = (
    "attention",
    "attention wait",
    "dispatch",
    "experts",
    "expert wait",
    "combine",
    "replica traffic",
    "pipeline bubble",
    "gradient sum",
    "migration",
    "group wait",
)


#: the trace's process name where the caller gives none
DEFAULT_TITLE = "simulated step"


def step_parts(
    plan: Plan, window: Window, topo: Topology, cost: CostModel, token_cap: Optional[int] = None
) -> tuple[SimResult, Dict[str, np.ndarray]]:
    """`simulate`'s result for ``plan`` and each rank's seconds in each of `PARTS`: a dict of
    float64 ``[R]`` arrays, ``R = pp * G * ep`` ranks numbered as the module docs say. The plan
    is checked for well-formedness only (as `simulate` does by default)."""
    from routepack.oversize import plan_mode

    instance_of(plan, Plan, "plan")
    instance_of(window, Window, "window")._check_fields("window")
    instance_of(topo, Topology, "topo")
    instance_of(cost, CostModel, "cost")
    cost.check_window_shape(window.num_layers, window.num_experts)
    plan._check_fields("plan.")
    ideal_micro = lower_bound_micro(window, topo, token_cap) if token_cap else None
    with callers_words(WINDOW_WORDS):
        report, t = _core.simulate_terms(
            plan,
            window.seq_lens,
            window.counts,
            topo,
            cost,
            ideal_micro,
            token_cap,
            plan_mode(plan, None),
            plan.replica_timing,
        )
    sim = SimResult(**report)
    g_n, _, _, ep = t["attention_rank"].shape
    pp = int(topo.pp)
    stage = np.asarray(t["layer_stage"])
    parts: Dict[str, np.ndarray] = {p: np.zeros(pp * g_n * ep) for p in PARTS}
    exposed = t["all_to_all"] - t["hidden"]  # [G, M, L]
    for s in range(pp):
        layers = stage == s
        for g in range(g_n):
            rows = slice((s * g_n + g) * ep, (s * g_n + g + 1) * ep)
            own_a = t["attention_rank"][g][:, layers].sum(axis=(0, 1))  # [ep]
            own_x = t["expert_rank"][g][:, layers].sum(axis=(0, 1))
            parts["attention"][rows] = own_a
            parts["attention wait"][rows] = t["attention"][g][:, layers].sum() - own_a
            parts["dispatch"][rows] = exposed[g][:, layers].sum() / 2
            parts["combine"][rows] = exposed[g][:, layers].sum() / 2
            parts["experts"][rows] = own_x
            parts["expert wait"][rows] = t["expert"][g][:, layers].sum() - own_x
            parts["replica traffic"][rows] = t["replication"][g][:, layers].sum()
            work = sum(parts[p][rows] for p in PARTS[:7])
            # the pipeline's idle time: its group's schedule less this stage's work (the
            # rounding of the stage's per-pass split, ~1e-16 s, is kept so the sum is exact)
            parts["pipeline bubble"][rows] = sim.group_times[g] - work if pp > 1 else 0.0
            parts["gradient sum"][rows] = sim.redundant_grads
            parts["migration"][rows] = sim.migration
            parts["group wait"][rows] = sim.step_time - sim.group_times[g] - sim.redundant_grads - sim.migration
    return sim, parts


def chrome_trace(parts: Dict[str, np.ndarray], step_time: float, title: str = DEFAULT_TITLE) -> Dict[str, Any]:
    """``parts`` (`step_parts`') as a Chrome trace-event document: process 0 named ``title``,
    one thread (track) per rank, one complete event (``"ph": "X"``, microseconds) per part,
    end to end from 0; each event's ``args`` carry its seconds."""
    ranks = len(next(iter(parts.values())))
    events: List[Dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for r in range(ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        t = 0.0
        for p in PARTS:
            sec = float(parts[p][r])
            events.append(
                {
                    "name": p,
                    "cat": "routepack",
                    "ph": "X",
                    "pid": 0,
                    "tid": r,
                    "ts": t * 1e6,
                    "dur": sec * 1e6,
                    "args": {"seconds": sec},
                }
            )
            t += sec
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"step_time_s": step_time, "parts": list(PARTS)},
    }


def write_trace(
    path: Union[str, Path],
    plan: Plan,
    window: Window,
    topo: Topology,
    cost: CostModel,
    token_cap: Optional[int] = None,
    title: str = DEFAULT_TITLE,
) -> Path:
    """Writes ``plan``'s simulated step on ``window`` per rank to ``path`` (`chrome_trace`)."""
    sim, parts = step_parts(plan, window, topo, cost, token_cap)
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(parts, sim.step_time, title)))
    return out


def traced_plan(
    windows: Sequence[Window], topo: Topology, cost: CostModel, token_cap: int, policy: str, seed: int, **options: Any
) -> Plan:
    """The plan `compare` scores for ``policy`` on the last window: windows[1:] planned in turn,
    each from the previous one's placement, with seed ``seed + i`` (what `routepack bench`
    traces with ``--trace``)."""
    from routepack.planner import plan_window

    previous = None
    plan = None
    for i in range(1, len(windows)):
        plan = plan_window(
            windows[i],
            topo,
            cost,
            token_cap=token_cap,
            policy=policy,
            previous=previous,
            previous_window=windows[i - 1],
            seed=seed + i,
            **options,
        )
        previous = plan.placement
    assert plan is not None, "compare needs at least 2 windows"
    return plan


def trace_bench(
    path: Path,
    windows: Sequence[Window],
    topo: Topology,
    cost: CostModel,
    token_cap: int,
    policies: Sequence[str],
    seed: int,
    options: Dict[str, Any],
) -> Path:
    """``routepack bench --trace``: routepack's plan of the last window (else the first
    policy's), as `traced_plan` plans it, written by `write_trace`."""
    policy = "routepack" if "routepack" in policies else policies[0]
    plan = traced_plan(windows, topo, cost, token_cap, policy, seed, **options)
    return write_trace(
        path, plan, windows[-1], topo, cost, token_cap, f"{policy}: simulated step, window {len(windows) - 1}"
    )
