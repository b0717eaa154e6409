"""The attention kernel's fit (`fit_attention`): ``a_lin`` and ``a_quad`` over sample lengths."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from routepack.calibrate.fit.common import COMPUTE_PASSES, KernelFit, forward_figures, linear_fit, points
from routepack.model import ModelShape


def fit_attention(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """Forward + backward of one full-attention layer on one sample of ``length`` n:
    3·(a_lin·n + a_quad·n²). ``a_quad`` goes to the model's full-attention layers; the
    linear-attention layers get 0, as `CostModel.from_model` gives them."""
    sweep, measured = points(measurement, "attention")
    n = np.array([p["length"] for p in sweep], dtype=np.float64)
    coef, pred, held = linear_fit(
        "attention", measurement, holdout_every, ("a_lin", "a_quad"), COMPUTE_PASSES * np.stack([n, n * n], axis=1)
    )
    a_quad = [coef["a_quad"] if kind == "full" else 0.0 for kind in model.attention]
    notes = [
        "a_lin is fitted on full-attention layers and applies to every layer (the cost model "
        "has one a_lin); linear-attention layers get a_quad = 0"
    ]
    if "parts" in measurement:
        notes.append(
            f"timed per token: {', '.join(measurement['parts'])} (moe_origin: the MoE layer's gather, "
            f"gate-weighted combine and residual at the origin rank)"
        )
    return KernelFit(
        "attention",
        "3·(a_lin·length + a_quad·length²)",
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        coef,
        {"a_lin": coef["a_lin"], "a_quad": a_quad},
        notes,
        extra={
            **forward_figures(measurement),
            **{k: measurement[k] for k in ("heads", "head_dim", "top_k", "parts") if k in measurement},
        },
    )
