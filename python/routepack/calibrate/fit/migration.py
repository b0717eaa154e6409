"""The migration's fit (`fit_migration`): a window's fixed cost and the per-byte cost of staging
an expert's state beyond the link's time, against the link bandwidth the others priced."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from routepack.calibrate.fit.common import KernelFit, linear_fit, points
from routepack.model import CostModel, ModelShape

#: What the fit's prediction of a point is, in the coefficients' names.
MIGRATION_FORMULA = "migration_latency + link_bytes / bw_intra + c_migrate · staged_bytes"


def fit_migration(
    measurement: Mapping[str, Any], holdout_every: int, model: ModelShape, priced: CostModel
) -> KernelFit:
    """The slowest rank's `routepack.torch.migrate` call at each point of the migration sweep
    (`routepack.calibrate.migration`: two ranks swap ``moves`` experts with their Adam state) as
    `MIGRATION_FORMULA`, the cost model's migration term: ``link_bytes`` (a rank's larger of
    sent and received bytes) over the link bandwidth the links or the exchange priced
    (``priced.bw_intra``, known), plus what is fitted, by non-negative least squares on relative
    residuals: ``migration_latency`` (the window's agreement and verification rounds, whatever
    moves) and ``c_migrate`` (seconds per byte a rank sends or receives, ``staged_bytes``:
    packing, checksums, backups, unpacking). Sets both in the cost model; its
    ``expert_state_bytes`` must count the same bytes a migration of one expert moves (the
    measurement's ``state_bytes_per_expert``: the weights and Adam's two moments in the
    measured dtype)."""
    sweep, measured = points(measurement, "migration")
    staged = np.array([p["staged_bytes"] for p in sweep], dtype=np.float64)
    link = np.array([p["link_bytes"] for p in sweep], dtype=np.float64)
    offset = link / priced.bw_intra
    coef, pred, held = linear_fit(
        "migration",
        measurement,
        holdout_every,
        ("migration_latency", "c_migrate"),
        np.stack([np.ones_like(staged), staged], axis=1),
        offset=offset,
    )
    linked = float(np.max(np.abs(offset / measured - 1.0)))
    per_expert = measurement.get("state_bytes_per_expert")
    notes = [
        f"a window's migration: {coef['migration_latency']:.3g} s whatever it moves, plus {coef['c_migrate']:.3g} s "
        f"per byte a rank sends or receives beyond the link's time (bw_intra {priced.bw_intra:.3g} B/s); the "
        f"link alone missed the points by up to {linked:.0%}"
    ]
    if per_expert:
        notes.append(
            f"one expert's state moved {per_expert:.0f} bytes (the cost model's expert_state_bytes must count the same)"
        )
    return KernelFit(
        "migration",
        MIGRATION_FORMULA,
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        {**coef, "bw_intra": priced.bw_intra},
        {"c_migrate": coef["c_migrate"], "migration_latency": coef["migration_latency"]},
        notes,
        extra={
            "max_rel_error_link_only": linked,
            **{
                k: measurement[k]
                for k in ("ranks", "backend", "clock", "dtype", "state_bytes_per_expert")
                if k in measurement
            },
        },
    )
