"""The replication's fit (`fit_replication`): the per-byte cost of a replica's weight copy and
gradient return at both ends beyond the link's time, against the link bandwidth the others
priced."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from routepack.calibrate.fit.common import KernelFit, linear_fit, points
from routepack.model import CostModel, ModelShape

#: What the fit's prediction of a point is, in the coefficients' names: the cost model's
#: replication term of one rank (copies' weights forward, gradients back, exposed in full).
REPLICATION_FORMULA = "link_bytes / bw_intra + c_replica · staged_bytes"


def fit_replication(
    measurement: Mapping[str, Any], holdout_every: int, model: ModelShape, priced: CostModel
) -> KernelFit:
    """The slowest rank's replica parts at each point of the replication sweep
    (`routepack.calibrate.replication`: two ranks send each other ``copies`` copies and get
    their gradients back) as `REPLICATION_FORMULA`, the cost model's replication term with
    prefetch off: ``link_bytes`` (a rank's weights sent plus gradients sent, the larger
    direction of each) over the link bandwidth the links or the exchange priced
    (``priced.bw_intra``, known), plus ``c_replica`` (seconds per byte a rank sends or
    receives, ``staged_bytes``), fitted by non-negative least squares on relative residuals.
    Sets ``c_replica`` in the cost model."""
    sweep, measured = points(measurement, "replication")
    staged = np.array([p["staged_bytes"] for p in sweep], dtype=np.float64)
    link = np.array([p["link_bytes"] for p in sweep], dtype=np.float64)
    offset = link / priced.bw_intra
    coef, pred, held = linear_fit(
        "replication", measurement, holdout_every, ("c_replica",), staged[:, None], offset=offset
    )
    linked = float(np.max(np.abs(offset / measured - 1.0)))
    notes = [
        f"a replica's copy and gradient return: {coef['c_replica']:.3g} s per byte a rank sends or receives "
        f"beyond the link's time (bw_intra {priced.bw_intra:.3g} B/s); the link alone missed the points by up "
        f"to {linked:.0%}"
    ]
    return KernelFit(
        "replication",
        REPLICATION_FORMULA,
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        {**coef, "bw_intra": priced.bw_intra},
        {"c_replica": coef["c_replica"]},
        notes,
        extra={
            "max_rel_error_link_only": linked,
            **{
                k: measurement[k]
                for k in ("ranks", "backend", "clock", "dtype", "weight_bytes_per_expert", "grad_bytes_per_expert")
                if k in measurement
            },
        },
    )
