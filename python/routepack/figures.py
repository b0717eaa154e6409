"""The benchmark figure: expert-load heat maps before/after and throughput bars per preset.
Needs matplotlib (``pip install ".[bench]"`` from a clone, ``"routepack[bench]"`` from an index)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence

import numpy as np

from routepack.compare import BALANCED, BEST, BOUND, DEFAULT_BASELINE, check_rows
from routepack.errors import RoutepackTypeError


def bench_figure(
    rows: Sequence[Any],
    summary: Sequence[Dict[str, Any]],
    path: str | Path,
    before: str = "static",
    after: str = "routepack",
    baseline: str = DEFAULT_BASELINE,
    title: str = "",
) -> Path:
    """Writes a PNG with three panels: per-(layer, microbatch) max/mean expert load of the
    slowest EP group under `before` and `after` on the last window, and throughput relative
    to `baseline` per preset (median over windows)."""
    rows = check_rows(rows)
    if not isinstance(path, (str, Path)) or not str(path):
        raise RoutepackTypeError(f"path: expected a non-empty str or Path, got {type(path).__name__} {path!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r.window for r in rows)
    maps = {}
    for name in (before, after):
        hit = [r for r in rows if r.policy == name and r.window == last]
        if hit:
            m = np.asarray(hit[0].imbalance_map)  # [G, M, L]
            maps[name] = m.max(axis=0).T  # worst group per (layer, micro)
    fig = plt.figure(figsize=(14, 5.2), constrained_layout=True)
    grid = fig.add_gridspec(1, 3, width_ratios=[1, 1, 1.25])
    vmax = max([float(m.max()) for m in maps.values()] + [1.5])
    im = None
    for i, name in enumerate((before, after)):
        ax = fig.add_subplot(grid[0, i])
        if name in maps:
            im = ax.imshow(maps[name], aspect="auto", origin="lower", cmap="magma_r", vmin=1.0, vmax=vmax)
            ax.set_title(f"{name}: expert load max/mean\n(mean {maps[name].mean():.3f})")
        else:
            ax.set_title(f"{name}: not run")
        ax.set_xlabel("microbatch step")
        ax.set_ylabel("MoE layer")
    if im is not None:
        fig.colorbar(im, ax=fig.axes[:2], shrink=0.8, label="max / mean over EP ranks")
    ax = fig.add_subplot(grid[0, 2])
    names = [s["policy"] for s in summary]
    rel = [s["vs_" + baseline] for s in summary]
    balanced = [s["of_balanced"] for s in summary]
    y = np.arange(len(names))
    colors = [
        "#888"
        if n in (baseline, BEST)
        else "#ddd"
        if n in (BALANCED, BOUND)
        else "#d9822b"
        if n == after
        else "#2a7ab9"
        for n in names
    ]
    bars = ax.barh(y, rel, color=colors, edgecolor="#555", linewidth=0.5)
    for b, r, f in zip(bars, rel, balanced):
        ax.text(
            b.get_width(), b.get_y() + b.get_height() / 2, f" {r:.3f}x ({f:.0%} of balanced)", va="center", fontsize=8
        )
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel(f"throughput relative to {baseline} (median over windows)")
    ax.set_xlim(0, max(rel + [1.0]) * 1.35)
    ax.axvline(1.0, color="k", lw=0.8)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
