"""Where per-microbatch copies stop paying: the break-even of imbalance × tokens per rank that
MoonEP's users ask for (MoonEP issues 6 and 30), for ``moonep``, ``ultraep`` and ``routepack``,
each over no balancing at all (``static``: Megatron's placement and packing, no copies).
``routepack bench --break-even`` runs it (`run`) and draws its figure (`figure`).

A cell of the grid is (max_vio v, tokens per rank T). Its windows hold ``ranks × micro`` samples
of exactly T tokens (one sample a rank and microbatch: T tokens each rank sends per exchange,
MoonEP's S), each of whose tokens routes to k distinct experts: with probability 1 from the
experts of one EP rank chosen per sample and layer (its hot block, E / ep experts) at a rate that
makes that block's experts (1 + v)/E of the sample's assignments each, the rest spread evenly.
An exchange then holds ep samples whose hot blocks fall on random ranks, so its expert imbalance
changes from microbatch to microbatch (what per-microbatch balancers are for) while the window's
is low; ``max_vio`` is verl's and MoonEP's metric, max over experts of load / mean load − 1, of
one sample (the table also gives each exchange's, averaged). Every plan is scored by `simulate`
under the profile's cost model: predictions of the cost model, not measurements.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from routepack._checks import positive_int
from routepack.compare import compare
from routepack.errors import RoutepackError
from routepack.stages.context import DEFAULT_SEED
from routepack.traces import Profile, _route_counts
from routepack.window import Window, count_dtype
from routepack.workloads import _generator

#: The policies of the figure, and the one they are each compared with.
POLICIES = ("moonep", "ultraep", "routepack")
BASELINE = "static"
#: The default grid: tokens a rank sends per exchange, and max_vio.
TOKENS = (128, 256, 512, 1024, 4096, 16384, 65536)
VIOS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def _window(prof: Profile, tokens: int, vio: float, micro: int, seed: int, step: int) -> Window:
    """One window of the cell (see the module docs)."""
    rng = _generator("break_even", prof.name, tokens, vio, seed, step)
    dp, ep, E, k, L = prof.dp, prof.ep, prof.num_experts, prof.top_k, prof.num_layers
    S = dp * micro
    n = np.full(S, tokens, dtype=np.int64)
    block = -(-E // ep)
    counts = np.empty((S, L, E), dtype=count_dtype(tokens))
    hot_share = min((1.0 + vio) / E, 0.95 / k)  # an expert takes at most one of a token's k picks
    for layer in range(L):
        hot = rng.integers(0, ep, size=S)
        p = np.empty((S, E))
        for s in range(S):
            lo, hi = hot[s] * block, min(E, (hot[s] + 1) * block)
            share = min(hot_share, 1.0 / (hi - lo))
            rest = (1.0 - share * (hi - lo)) / max(E - (hi - lo), 1)
            p[s] = rest
            p[s, lo:hi] = share
        counts[:, layer, :] = _route_counts(rng, n, k, p)
    return Window(n, counts, top_k=k)


def max_vio(window: Window) -> float:
    """verl's / MoonEP's max_vio of the window's samples: per (sample, layer) max_e load / mean
    load − 1, averaged."""
    c = window.counts.astype(np.float64)
    mean = c.sum(-1) / c.shape[-1]
    return float(np.mean(c.max(-1) / np.maximum(mean, 1e-300) - 1.0))


def run(
    prof: Profile,
    topo: Any,
    cost: Any,
    tokens: Optional[Sequence[int]] = None,
    vios: Optional[Sequence[float]] = None,
    micro: int = 2,
    seed: int = DEFAULT_SEED,
    progress: Any = None,
) -> Dict[str, Any]:
    """The grid: per cell, the step time of every policy and ``static`` and the speed-ups over
    ``static`` (one scored window after one for history); the grid `TOKENS` × `VIOS` unless given."""
    micro = positive_int(micro, "micro")
    tokens = TOKENS if tokens is None else tokens
    vios = VIOS if vios is None else vios
    if not tokens or not vios:
        raise RoutepackError("tokens, vios: the grid needs at least one of each")
    cells: List[Dict[str, Any]] = []
    for t in tokens:
        t = positive_int(t, "tokens")
        for v in vios:
            if not (math.isfinite(v) and v >= 0):
                raise RoutepackError(f"vios: {v} is not a max_vio (a finite number >= 0)")
            wins = [_window(prof, t, v, micro, seed, step) for step in range(2)]
            rows = compare(wins, topo, cost, t, (BASELINE, *POLICIES), seed=seed)
            step = {r.policy: r.step_time for r in rows}
            cells.append(
                {
                    "tokens": t,
                    "vio": v,
                    "measured_vio": max_vio(wins[1]),
                    "imbalance": {r.policy: r.imbalance for r in rows},
                    "step_time": step,
                    "speedup": {p: step[BASELINE] / step[p] for p in POLICIES},
                }
            )
            if progress is not None:
                progress(f"T={t} v={v}", 1)
    return {"tokens": list(tokens), "vios": list(vios), "micro": micro, "cells": cells}


def break_even_tokens(data: Dict[str, Any], policy: str, vio: float) -> Any:
    """The fewest tokens per rank of the grid from which on ``policy`` is faster than no
    balancing for ``vio`` (None where it is not at the largest)."""
    cells = sorted((c for c in data["cells"] if c["vio"] == vio), key=lambda c: c["tokens"])
    found = None
    for c in reversed(cells):
        if c["speedup"][policy] <= 1.0:
            break
        found = c["tokens"]
    return found


def figure(data: Dict[str, Any], path: str, title: str) -> str:
    """A heat map per policy of its speed-up over no balancing, the break-even (1.0) contoured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, vios = data["tokens"], data["vios"]
    fig, axes = plt.subplots(1, len(POLICIES), figsize=(4.2 * len(POLICIES), 3.8), sharey=True)
    grid = {(c["tokens"], c["vio"]): c for c in data["cells"]}
    for ax, pol in zip(axes, POLICIES):
        z = np.array([[grid[(t, v)]["speedup"][pol] for t in tokens] for v in vios])
        im = ax.imshow(z, origin="lower", aspect="auto", cmap="RdYlGn", vmin=0.8, vmax=1.6)
        ax.contour(z, levels=[1.0], colors="k", linewidths=1.5)
        for i in range(len(vios)):
            for j in range(len(tokens)):
                ax.text(j, i, f"{z[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(tokens)), [f"{t // 1024}K" if t >= 1024 else str(t) for t in tokens])
        ax.set_yticks(range(len(vios)), [f"{v:g}" for v in vios])
        ax.set_xlabel("tokens per rank per exchange (S)")
        ax.set_title(f"{pol} over no balancing")
    axes[0].set_ylabel("max_vio")
    fig.colorbar(im, ax=axes, shrink=0.8, label="throughput ratio (1 = break-even, black line)")
    fig.suptitle(title + " (predicted by the cost model)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


__all__ = ["BASELINE", "POLICIES", "TOKENS", "VIOS", "break_even_tokens", "figure", "max_vio", "run"]
