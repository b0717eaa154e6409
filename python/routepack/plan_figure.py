"""A picture of a plan (``routepack bench --plan-figure FILE``): where each layer's expert
tokens are computed, per (MoE layer, rank), under the best baseline and under routepack, and
each rank's simulated step split into its parts (`routepack.timeline`) under both.
Needs matplotlib (``pip install ".[bench]"`` from a clone, ``"routepack[bench]"`` from an index)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from routepack import _core
from routepack.errors import RoutepackError
from routepack.model import CostModel, Topology
from routepack.plan import Plan
from routepack.timeline import PARTS, step_parts, trace_bench, traced_plan
from routepack.window import Window


def rank_load(plan: Plan, window: Window, topo: Topology) -> np.ndarray:
    """float64 ``[L, G * ep]``: expert tokens each rank computes per MoE layer over the window
    (``_core.rank_tokens`` summed over microbatches; rank ``g * ep + r``), over the layer's mean
    over ranks (1.0: balanced)."""
    tok = _core.rank_tokens(plan, window.seq_lens, window.counts, topo).sum(axis=1)  # [G, L, ep]
    load = np.transpose(tok, (1, 0, 2)).reshape(tok.shape[1], -1).astype(np.float64)
    mean = load.mean(axis=1, keepdims=True)
    return np.asarray(load / np.where(mean > 0, mean, 1.0))


def plan_figure(
    plans: Dict[str, Tuple[Plan, Window]],
    topo: Topology,
    cost: CostModel,
    token_cap: int,
    path: str | Path,
    title: str = "",
) -> Path:
    """Writes a PNG: for each of ``plans`` (name → (plan, window); Megatron's static one, the
    best baseline's, then routepack's) a heat map of `rank_load`, and one panel of each rank's
    simulated step split into `PARTS`, the plans' bars side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plans)
    loads = {n: rank_load(p, w, topo) for n, (p, w) in plans.items()}
    parts = {n: step_parts(p, w, topo, cost, token_cap) for n, (p, w) in plans.items()}
    # a diverging scale centred on the balanced 1.0: hot ranks red, idle ones blue
    # (at least +-10%, so that a spread of a percent does not look like a straggler)
    vmax = max(1.1, max(float(v.max()) for v in loads.values()))
    vmin = max(0.0, 2.0 - vmax)
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5 * (len(names) + 1), 4.2))
    for ax, n in zip(axes, names):
        im = ax.imshow(loads[n], aspect="auto", cmap="coolwarm", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(f"{n}: tokens / layer mean", fontsize=10)
        ax.set_xlabel("rank")
        ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=list(axes[: len(names)]), shrink=0.8)
    ax = axes[-1]
    ranks = len(next(iter(parts.values()))[1]["attention"])
    width = 0.8 / len(names)
    colors = [plt.get_cmap("tab20")(i) for i in range(20)]
    for k, n in enumerate(names):
        p = parts[n][1]
        x = np.arange(ranks) + (k - (len(names) - 1) / 2) * width
        bottom = np.zeros(ranks)
        for i, part in enumerate(PARTS):
            ax.bar(
                x,
                p[part],
                width,
                bottom=bottom,
                color=colors[i % len(colors)],
                label=part if k == 0 else None,
                edgecolor="black" if k else "none",
                linewidth=0.3,
            )
            bottom += p[part]
    steps = ", ".join(f"{n} {parts[n][0].step_time:.3g} s" for n in names)
    ax.set_title(f"simulated step per rank ({steps}; bars in that order)", fontsize=9)
    ax.set_xlabel("rank")
    ax.set_ylabel("seconds (cost model)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def figure_bench(
    path: Path,
    windows: Sequence[Window],
    topo: Topology,
    cost: CostModel,
    token_cap: int,
    best_baseline: str,
    seed: int,
    options: Dict[str, Any],
    title: str,
) -> Path:
    """``routepack bench --plan-figure``: `plan_figure` of the last window's plans of static
    (the load before any balancing), ``best_baseline`` (the fastest baseline there) and
    routepack, planned as the bench planned them (`routepack.timeline.traced_plan`)."""
    plans = {
        name: (traced_plan(windows, topo, cost, token_cap, name, seed, **options), windows[-1])
        for name in dict.fromkeys(("static", best_baseline, "routepack"))
    }
    return plan_figure(plans, topo, cost, token_cap, path, title)


def plan_pictures(
    paths: Dict[str, Optional[Path]],
    windows: Sequence[Window],
    topo: Topology,
    cost: CostModel,
    token_cap: int,
    policies: Sequence[str],
    winners: Dict[int, str],
    seed: int,
    options: Dict[str, Any],
    profile: str,
) -> List[Path]:
    """``routepack bench --trace`` and ``--plan-figure`` (``paths["trace"]``,
    ``paths["plan_figure"]``; None: not asked): the files written. ``winners``: the best
    baseline per window (`routepack.compare.best_of`)."""
    out = []
    trace, figure = paths.get("trace"), paths.get("plan_figure")
    if trace is not None:
        out.append(trace_bench(trace, windows, topo, cost, token_cap, policies, seed, options))
    if figure is not None:
        best = winners.get(len(windows) - 1)
        if best is None or "routepack" not in policies:
            raise RoutepackError("--plan-figure needs routepack and a baseline among the policies")
        title = f"routepack bench: {profile}, window {len(windows) - 1}"
        out.append(figure_bench(figure, windows, topo, cost, token_cap, best, seed, options, title))
    return out
