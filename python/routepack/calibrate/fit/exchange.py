"""The exchange's fit (`fit_exchange`): one MoE layer's time outside its expert kernel, against
what the other kinds priced."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from routepack.calibrate.fit.common import COMPUTE_PASSES, KernelFit, linear_fit, points
from routepack.model import CostModel, ModelShape

#: All-to-alls of one MoE layer's forward and backward: dispatch and combine, each pass.
LAYER_ALL_TO_ALLS = 4.0


def fit_exchange(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape, priced: CostModel) -> KernelFit:
    """One MoE layer's forward + backward on a rank outside its expert kernel, at ``tokens``
    per rank routed three ways (`routepack.calibrate.exchange`), as
    ``4·(a2a_latency + remote_bytes / bw_intra) + 3·(a_lin + a_lin_extra)·tokens``: its four
    all-to-alls (dispatch and combine, forward and backward) with their fixed cost (routing,
    split sizes, launches) and the slowest rank's bytes that leave or reach it, and the
    per-token work beyond the origin work ``priced.a_lin`` (measured by the attention kind, or
    the preset's): sorting the received rows, the exchanges' own copies. (a2a_latency,
    1/bw_intra, a_lin_extra) ≥ 0 by least squares; sets them in place of the links'. Where the
    bytes fit no cost of their own (1/bw 0: the tokens' work explains them), the links'
    ``priced.bw_intra`` prices them and only the other two are fitted."""
    sweep, measured = points(measurement, "exchange")
    tokens = np.array([p["tokens"] for p in sweep], dtype=np.float64)
    nbytes = np.array([p["remote_bytes"] for p in sweep], dtype=np.float64)
    origin = COMPUTE_PASSES * priced.a_lin * tokens
    calls = np.full(tokens.size, LAYER_ALL_TO_ALLS)
    formula = "4·(a2a_latency + remote_bytes / bw_intra) + 3·(a_lin + a_lin_extra)·tokens"
    coef, pred, held = linear_fit(
        "exchange",
        measurement,
        holdout_every,
        ("a2a_latency", "s_per_byte", "a_lin_extra"),
        np.stack([calls, LAYER_ALL_TO_ALLS * nbytes, COMPUTE_PASSES * tokens], axis=1),
        offset=origin,
    )
    # a share of every point's time below a millionth is the solver's rounding, not a cost
    if np.any(LAYER_ALL_TO_ALLS * nbytes * coef["s_per_byte"] > 1e-6 * measured):
        bw, how = 1.0 / coef["s_per_byte"], "fitted"
    else:
        bw, how = priced.bw_intra, "the links' (the bytes fitted no cost of their own)"
        coef, pred, held = linear_fit(
            "exchange",
            measurement,
            holdout_every,
            ("a2a_latency", "a_lin_extra"),
            np.stack([calls, COMPUTE_PASSES * tokens], axis=1),
            offset=origin + LAYER_ALL_TO_ALLS * nbytes / bw,
        )
    coef = {"a2a_latency": coef["a2a_latency"], "bw_intra": bw, "a_lin_extra": coef["a_lin_extra"]}
    # what the other kinds' model charged the layer: the links' latency and bandwidth, the origin work
    charged = origin + LAYER_ALL_TO_ALLS * (priced.a2a_latency + nbytes / priced.bw_intra)
    before = float(np.max(np.abs(charged / measured - 1.0)))
    notes = [
        f"bw_intra {how}: {bw:.3g} B/s (the links': {priced.bw_intra:.3g}); a2a_latency {coef['a2a_latency']:.3g} s "
        f"(the links': {priced.a2a_latency:.3g}); a_lin = {priced.a_lin:.3g} (origin) + {coef['a_lin_extra']:.3g}; "
        f"the links' and origin's model alone missed the layer by up to {before:.0%}"
    ]
    return KernelFit(
        "exchange",
        formula,
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        {**coef, "a_lin": priced.a_lin},
        {"a2a_latency": coef["a2a_latency"], "bw_intra": bw, "a_lin": priced.a_lin + coef["a_lin_extra"]},
        notes,
        extra={
            "priced_before_s": charged.tolist(),
            "max_rel_error_before": before,
            **{
                k: measurement[k]
                for k in ("layer_s", "kernel_s", "ranks", "backend", "clock", "dtype")
                if k in measurement
            },
        },
    )
