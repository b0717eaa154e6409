"""What every kernel's fit shares: the held-out points (`holdout_mask`), the non-negative
least squares on relative residuals (`nnls_relative`, `linear_fit`), the fit's record
(`KernelFit`) and the figures a measurement passes through (`forward_figures`).

The fit is least squares on *relative* residuals ((predicted − measured) / measured), with
non-negative coefficients, because the figure the report is judged by is the relative
error, and the sweeps span three or more orders of magnitude of time (an absolute fit would
ignore the small points). Every ``holdout_every``-th point is left out of the fit
(`holdout_mask`) and only predicted: ``max_rel_error`` is taken over those points, so it
measures how well the model interpolates, not how well it memorises.

Compute times are measured as training runs them, forward and backward; the cost model counts
``COMPUTE_PASSES`` = 3 passes for the default ``passes`` (forward + backward; docs/design.md,
"Passes"), so the predicted time of a point is 3 × the per-pass formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from routepack.errors import RoutepackError

#: Forward + backward ≈ 3 forward passes: the multiplier `simulate` puts on compute terms.
COMPUTE_PASSES = 3.0


def holdout_mask(n: int, every: int) -> np.ndarray:
    """bool ``[n]``: points ``every//2, every//2 + every, ...`` are held out. The first and
    the last point are always fitted, so a held-out point is interpolated, never extrapolated."""
    mask = np.zeros(n, dtype=bool)
    if every >= 2:
        mask[every // 2 :: every] = True
    if n:
        mask[0] = mask[-1] = False
    return mask


def nnls_relative(features: np.ndarray, measured: np.ndarray, offset: Optional[np.ndarray] = None) -> np.ndarray:
    """Non-negative ``c`` minimising Σ ((features·c + offset − measured) / measured)²
    (``offset``: a known part of each point's time, default 0).

    The unconstrained least squares where all its coefficients are >= 0; otherwise Lawson and
    Hanson's active-set algorithm (`scipy.optimize.nnls`), then the least squares on the columns
    it kept positive (the optimum is that solution: the solver itself stops at a tolerance). The
    columns are scaled to unit length for the solver (the coefficients span ten orders of
    magnitude, a per-token second against a per-call millisecond), which moves no optimum: a
    positive scale of a column is a positive scale of its coefficient."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise RoutepackError(f"fit: features {x.shape} and measured {y.shape} do not match")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise RoutepackError("fit: measured times must be finite and > 0")
    if not np.all(np.isfinite(x)):
        raise RoutepackError("fit: features must be finite")
    try:
        from scipy.optimize import nnls  # type: ignore[import-untyped]
    except ImportError as e:
        raise ImportError("routepack.calibrate's fit needs SciPy: pip install 'routepack[torch]'") from e
    a = x / y[:, None]
    ones = np.ones_like(y) if offset is None else 1.0 - np.asarray(offset, dtype=np.float64) / y
    whole, *_ = np.linalg.lstsq(a, ones, rcond=None)
    if np.all(whole >= 0):  # the unconstrained optimum is feasible: nothing to constrain
        return whole
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    coef, _ = nnls(a / scale, ones, maxiter=50 * max(1, x.shape[1]))
    coef = coef / scale
    # the least squares on the columns kept positive, to rounding (the solver stops at a tolerance)
    keep = coef > 0
    if keep.any():
        sub, *_ = np.linalg.lstsq(a[:, keep], ones, rcond=None)
        if np.all(sub >= 0):
            coef = np.zeros_like(coef)
            coef[keep] = sub
    return coef


@dataclass
class KernelFit:
    """One kernel kind's sweep, measured and predicted times and fitted coefficients."""

    kind: str
    formula: str  # what ``predicted_s`` is, in the coefficients' names
    sweep: List[Dict[str, Any]]
    measured_s: List[float]
    predicted_s: List[float]
    held_out: List[bool]
    coefficients: Dict[str, float]
    cost_fields: Dict[str, Any]  # CostModel field -> value this fit sets
    notes: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)  # per-point figures not fitted (e.g. forward time)

    @property
    def rel_error(self) -> List[float]:
        """(predicted − measured) / measured at every point."""
        return [(p - m) / m for p, m in zip(self.predicted_s, self.measured_s)]

    def max_abs(self, held_out: bool) -> Optional[float]:
        errs = [abs(e) for e, h in zip(self.rel_error, self.held_out) if h == held_out]
        return max(errs) if errs else None

    @property
    def max_rel_error(self) -> Optional[float]:
        """Largest |relative error| over the held-out points (None when none was held out)."""
        return self.max_abs(True)

    @property
    def max_rel_error_fit(self) -> Optional[float]:
        """Largest |relative error| over the points the fit saw."""
        return self.max_abs(False)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "formula": self.formula,
            "sweep": self.sweep,
            "measured_s": self.measured_s,
            "predicted_s": self.predicted_s,
            "held_out": self.held_out,
            "rel_error": self.rel_error,
            "max_rel_error": self.max_rel_error,
            "max_rel_error_fit": self.max_rel_error_fit,
            "held_out_points": int(sum(self.held_out)),
            "coefficients": self.coefficients,
            "cost_fields": self.cost_fields,
            "notes": self.notes,
            **self.extra,
        }


def points(measurement: Mapping[str, Any], kind: str) -> Tuple[List[Dict[str, Any]], np.ndarray]:
    sweep = list(measurement.get("sweep", ()))
    measured = np.asarray(measurement.get("measured_s", ()), dtype=np.float64)
    if not sweep or measured.shape != (len(sweep),):
        raise RoutepackError(
            f"{kind}: needs one measured time per sweep point, got {measured.shape[0]} for {len(sweep)} points"
        )
    return sweep, measured


def linear_fit(
    kind: str,
    measurement: Mapping[str, Any],
    holdout_every: int,
    names: Sequence[str],
    features: np.ndarray,
    mask: Optional[np.ndarray] = None,
    offset: Optional[np.ndarray] = None,
) -> Tuple[Dict[str, float], np.ndarray, np.ndarray]:
    """Coefficients fitted on the points not held out, predictions at every point, the mask.
    ``offset``: a known part of every point's time, added to the fitted part."""
    _, measured = points(measurement, kind)
    held = holdout_mask(len(measured), holdout_every) if mask is None else mask
    if int((~held).sum()) < len(names):
        raise RoutepackError(
            f"{kind}: {int((~held).sum())} fitted points cannot determine "
            f"{len(names)} coefficients {list(names)}; measure more points"
        )
    known = np.zeros(len(measured)) if offset is None else np.asarray(offset, dtype=np.float64)
    coef = nnls_relative(features[~held], measured[~held], known[~held])
    return dict(zip(names, map(float, coef))), features @ coef + known, held


def max_abs(rel: np.ndarray, mask: np.ndarray) -> Optional[float]:
    return float(np.abs(rel[mask]).max()) if mask.any() else None


#: Per-point and per-sweep timer figures a fit passes through to the report unchanged.
TIMER_KEYS = ("spread", "calls_per_visit", "loadavg", "drift")


def forward_figures(measurement: Mapping[str, Any]) -> Dict[str, Any]:
    """The forward-only times measured alongside, and their median share of forward +
    backward (what the cost model's 1 : 3 pass ratio assumes to be 1/3); the timer's figures
    (`TIMER_KEYS`) where the measurement has them."""
    out = {k: measurement[k] for k in TIMER_KEYS if k in measurement}
    fwd = measurement.get("forward_s")
    if fwd is None:
        return out
    share = np.asarray(fwd, dtype=np.float64) / np.asarray(measurement["measured_s"], dtype=np.float64)
    return {**out, "forward_s": list(map(float, fwd)), "forward_share": float(np.median(share))}
