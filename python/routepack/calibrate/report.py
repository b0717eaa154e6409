"""The calibration report: a JSON document and a PNG of measured against predicted times.

The JSON's top-level ``kernels`` maps each kernel kind to its `KernelFit` (sweep, measured
and predicted seconds, held-out points and their ``max_rel_error``, coefficients, the
`CostModel` fields it set); ``cost_model`` is the calibrated model, ``preset`` the
datasheet model of the same shape (`Hardware.h200` unless told otherwise) with the ratio of
every coefficient to it, ``sources`` where each `CostModel` field came from, ``device`` the
machine (device, torch, threads). The figure needs matplotlib (``pip install
"routepack[bench]"``), imported only when a figure is drawn.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import numpy as np

from routepack.model import CostModel

PLOT_HINT = 'pip install "routepack[bench]"'


def _safe(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v) for v in value]
    return value


def ratios(cost: CostModel, preset: CostModel) -> Dict[str, Optional[float]]:
    """Every numeric coefficient of ``cost`` over ``preset``'s (a_quad: over the full layers)."""
    out: Dict[str, Optional[float]] = {}
    for name in ("a_lin", "c_tok", "c_exp", "bw_intra", "bw_inter", "token_bytes"):
        p = getattr(preset, name)
        out[name] = getattr(cost, name) / p if p else None
    full = [(c, p) for c, p in zip(cost.a_quad, preset.a_quad) if p]
    out["a_quad"] = full[0][0] / full[0][1] if full else None
    return out


def build(
    *,
    fits: Mapping[str, Any],
    cost: CostModel,
    preset: CostModel,
    hardware: Any,
    sources: Dict[str, str],
    device: Dict[str, Any],
    settings: Dict[str, Any],
    model: Dict[str, Any],
    profile: str,
    skipped: Dict[str, str],
    elapsed_s: float,
    version: str,
) -> Dict[str, Any]:
    """The report document (JSON-able)."""
    return _safe(
        {
            "routepack": version,
            "profile": profile,
            "model": model,
            "device": device,
            "settings": settings,
            "kernels": {kind: fit.to_dict() for kind, fit in fits.items()},
            "skipped": skipped,
            "cost_model": asdict(cost),
            "sources": sources,
            "preset": {"hardware": asdict(hardware), "cost_model": asdict(preset), "ratio": ratios(cost, preset)},
            "elapsed_s": elapsed_s,
        }
    )


def write_json(report: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(_safe(dict(report)), indent=2))
    return path


def _x(kind: str, sweep: Any) -> np.ndarray:
    key = {"expert_gemm": "tokens", "attention": "length", "links": "bytes"}.get(kind)
    if key is None:  # a kernel kind this figure does not know: its first numeric sweep variable
        key = next(k for k, v in sweep[0].items() if isinstance(v, (int, float)))
    return np.array([p[key] for p in sweep], dtype=np.float64)


def _series(kind: str, sweep: Any) -> Dict[str, np.ndarray]:
    """Point indices of each curve drawn: per active-expert count, per link op, per routing of
    the exchange, or one."""
    if kind == "expert_gemm":
        labels = [f"{p['active_experts']} active" for p in sweep]
    elif kind == "links":
        labels = [p["op"] for p in sweep]
    elif kind == "exchange":
        labels = [p.get("routing", kind) for p in sweep]
    else:
        labels = [kind] * len(sweep)
    return {lab: np.array([i for i, l2 in enumerate(labels) if l2 == lab]) for lab in dict.fromkeys(labels)}


def plot(report: Mapping[str, Any], path: str | Path) -> Path:
    """Per kernel kind: measured (dots; held-out points ringed) and predicted (lines) time on
    log-log axes, and the relative error underneath (with, as crosses, that of any
    ``alternative_forms`` the fit tried but did not commit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = report["kernels"]
    fig, axes = plt.subplots(
        2,
        max(1, len(kernels)),
        figsize=(5.2 * max(1, len(kernels)), 7.5),
        squeeze=False,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 1.4]},
        constrained_layout=True,
    )
    xlabel = {
        "expert_gemm": "routed tokens (all active experts)",
        "attention": "sample length (tokens)",
        "links": "bytes per rank",
        "exchange": "tokens per rank",
    }
    for col, (kind, k) in enumerate(kernels.items()):
        top, bottom = axes[0, col], axes[1, col]
        x = _x(kind, k["sweep"])
        meas, pred = np.array(k["measured_s"]), np.array(k["predicted_s"])
        held, err = np.array(k["held_out"], dtype=bool), np.array(k["rel_error"])
        for i, (label, idx) in enumerate(_series(kind, k["sweep"]).items()):
            color = f"C{i}"
            o = idx[np.argsort(x[idx])]
            top.plot(x[o], pred[o], "-", color=color, lw=1.2)
            top.plot(x[o], meas[o], ".", color=color, ms=6, label=label)
            h = o[held[o]]
            top.plot(x[h], meas[h], "o", mfc="none", mec="k", ms=8)
            bottom.plot(x[o], 100 * err[o], ".-", color=color, lw=0.8, ms=4)
            bottom.plot(x[h], 100 * err[h], "o", mfc="none", mec="k", ms=7)
        for j, (name, form) in enumerate(k.get("alternative_forms", {}).items()):
            alt = 100 * (np.array(form["predicted_s"]) / meas - 1)
            amre = form.get("max_rel_error")
            bottom.plot(
                x,
                alt,
                "x",
                color=f"{0.35 + 0.2 * j:.2f}",
                ms=3,
                label=f"{name}, not committed: held-out max {'n/a' if amre is None else f'{100 * amre:.1f}%'}",
            )
            bottom.legend(fontsize=6)
        top.set_xscale("log")
        top.set_yscale("log")
        mre = k.get("max_rel_error")
        # long formulas (the expert curve's) wrapped to the panel's width
        formula = "\n".join(textwrap.wrap(f"{kind}: {k['formula']}", 58))
        top.set_title(
            f"{formula}\nheld-out max |rel. error| {'n/a' if mre is None else f'{100 * mre:.1f}%'} (ringed)", fontsize=9
        )
        top.set_ylabel("seconds (dots measured, lines predicted)")
        top.legend(fontsize=7)
        bottom.axhline(0, color="k", lw=0.6)
        bottom.set_ylabel("predicted / measured − 1 (%)")
        bottom.set_xlabel(xlabel.get(kind, kind))
    dev = report.get("device", {})
    fig.suptitle(
        f"routepack calibrate: {report.get('profile')} shapes on {dev.get('gpu') or dev.get('cpu')} "
        f"({dev.get('device')}, {dev.get('dtype')}, {dev.get('threads')} thread(s), torch {dev.get('torch')})",
        fontsize=10,
    )
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
