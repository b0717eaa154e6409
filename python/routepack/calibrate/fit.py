"""Fitting measured kernel times to the cost model's coefficients, one function per kernel kind.

Each ``fit_<kind>`` takes that kind's measurement (``sweep``: one dict of sweep variables per
point; ``measured_s``: its median time) and returns a `KernelFit`: the coefficients, the
times the fitted model predicts at every point, which points were held out, and the
`CostModel` fields the coefficients set (``cost_fields``). `FITS` maps each kind to its
function, so a richer model of one kernel (tabulated attention, a link latency) replaces one entry and leaves the others alone; `to_cost_model` merges the
fields of whatever was fitted into `CostModel.from_model`'s coefficients.

The fit is least squares on *relative* residuals ((predicted − measured) / measured), with
non-negative coefficients, because the figure the report is judged by is the relative
error, and the sweeps span three or more orders of magnitude of time (an absolute fit would
ignore the small points). Every ``holdout_every``-th point is left out of the fit
(`holdout_mask`) and only predicted: ``max_rel_error`` is taken over those points, so it
measures how well the model interpolates, not how well it memorises.

Compute times are measured as training runs them, forward and backward; the cost model
prices a pass as ``expert_time`` (+ the roofline floor and the GEMM step) / ``attention_of_sums`` and counts
``COMPUTE_PASSES`` = 3 of them for the default ``passes`` (forward + backward; docs/design.md,
"Passes"), so the predicted time of a point is 3 × the per-pass formula.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from routepack.errors import RoutepackError
from routepack.model import CostModel, Hardware, ModelShape

#: Forward + backward ≈ 3 forward passes: the multiplier `simulate` puts on compute terms.
COMPUTE_PASSES = 3.0


def holdout_mask(n: int, every: int) -> np.ndarray:
    """bool ``[n]``: points ``every//2, every//2 + every, ...`` are held out. The first and
    the last point are always fitted, so a held-out point is interpolated, never extrapolated."""
    mask = np.zeros(n, dtype=bool)
    if every >= 2:
        mask[every // 2::every] = True
    if n:
        mask[0] = mask[-1] = False
    return mask


def nnls_relative(features: np.ndarray, measured: np.ndarray, offset: Optional[np.ndarray] = None) -> np.ndarray:
    """Non-negative ``c`` minimising Σ ((features·c + offset − measured) / measured)²
    (``offset``: a known part of each point's time, default 0).

    Exact for the handful of coefficients a kernel has: the optimum is the unconstrained
    least-squares solution on some subset of the columns whose coefficients are all >= 0,
    so every subset is tried (2^p − 1 small solves) and the best feasible one kept, unless
    the solution on all columns is feasible already."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise RoutepackError(f"fit: features {x.shape} and measured {y.shape} do not match")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise RoutepackError("fit: measured times must be finite and > 0")
    a = x / y[:, None]
    ones = np.ones_like(y) if offset is None else 1.0 - np.asarray(offset, dtype=np.float64) / y
    whole, *_ = np.linalg.lstsq(a, ones, rcond=None)
    if np.all(whole >= 0):  # the unconstrained optimum is feasible, so no subset does better
        return whole
    best, best_err = np.zeros(x.shape[1]), float(np.sum(ones ** 2))
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            sub = a[:, cols]
            coef, *_ = np.linalg.lstsq(sub, ones, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - ones) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(x.shape[1])
                best[list(cols)] = coef
    return best


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

    def _max_abs(self, held_out: bool) -> Optional[float]:
        errs = [abs(e) for e, h in zip(self.rel_error, self.held_out) if h == held_out]
        return max(errs) if errs else None

    @property
    def max_rel_error(self) -> Optional[float]:
        """Largest |relative error| over the held-out points (None when none was held out)."""
        return self._max_abs(True)

    @property
    def max_rel_error_fit(self) -> Optional[float]:
        """Largest |relative error| over the points the fit saw."""
        return self._max_abs(False)

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "formula": self.formula, "sweep": self.sweep,
                "measured_s": self.measured_s, "predicted_s": self.predicted_s, "held_out": self.held_out,
                "rel_error": self.rel_error, "max_rel_error": self.max_rel_error,
                "max_rel_error_fit": self.max_rel_error_fit, "held_out_points": int(sum(self.held_out)),
                "coefficients": self.coefficients, "cost_fields": self.cost_fields, "notes": self.notes,
                **self.extra}


def _points(measurement: Mapping[str, Any], kind: str) -> Tuple[List[Dict[str, Any]], np.ndarray]:
    sweep = list(measurement.get("sweep", ()))
    measured = np.asarray(measurement.get("measured_s", ()), dtype=np.float64)
    if not sweep or measured.shape != (len(sweep),):
        raise RoutepackError(f"{kind}: needs one measured time per sweep point, got {measured.shape[0]} "
                             f"for {len(sweep)} points")
    return sweep, measured


def _linear_fit(kind: str, measurement: Mapping[str, Any], holdout_every: int, names: Sequence[str],
                features: np.ndarray, mask: Optional[np.ndarray] = None,
                offset: Optional[np.ndarray] = None) -> Tuple[Dict[str, float], np.ndarray, np.ndarray]:
    """Coefficients fitted on the points not held out, predictions at every point, the mask.
    ``offset``: a known part of every point's time, added to the fitted part."""
    _, measured = _points(measurement, kind)
    held = holdout_mask(len(measured), holdout_every) if mask is None else mask
    if int((~held).sum()) < len(names):
        raise RoutepackError(f"{kind}: {int((~held).sum())} fitted points cannot determine "
                             f"{len(names)} coefficients {list(names)}; measure more points")
    known = np.zeros(len(measured)) if offset is None else np.asarray(offset, dtype=np.float64)
    coef = nnls_relative(features[~held], measured[~held], known[~held])
    return dict(zip(names, map(float, coef))), features @ coef + known, held


def _knees(tokens: np.ndarray) -> np.ndarray:
    """Candidate roofline knees (tokens per expert): 1 (no floor inside the sweep) and a
    geometric grid of 8 points per doubling up to the largest swept count."""
    hi = float(tokens.max()) if tokens.size else 1.0
    return np.unique(np.concatenate([[1.0], np.geomspace(1.0, max(hi, 1.0), 1 + int(8 * np.log2(max(hi, 2.0))))]))


#: The expert curve the calibration commits (`fit_expert_gemm`): one kernel call (`CostModel.c_call`)
#: plus, per active expert, the roofline and ``c_gemm`` where it has >= 2 tokens
#: (`CostModel.c_gemm`), three passes.
GEMM_STEP_FORMULA = ("3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights) "
                     "+ c_gemm·[tokens_per_expert ≥ 2]))")
#: The expert curve without the GEMM step (convex in tokens per expert), reported alongside.
ROOFLINE_FORMULA = "3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights)))"
#: The GEMM step is committed only where it cuts the fitted points' squared relative error to
#: below this share of the roofline's. Measured: on timings of the roofline with 0.1–5% noise
#: the step's extra parameter buys a ratio of 0.83–1.0 (400 draws; 0.88–1.0 in 150 with the
#: call's column); on this CPU's sweeps 0.02–0.12 at the tiny profile's shapes and 0.33–0.44
#: at the measured run's (H = I = 256, a stack of 10), where ½ had refused the step in some
#: runs and committed a roofline 21–54% off at held-out points.
STEP_MIN_GAIN = 0.75


def _roofline(measurement: Mapping[str, Any], holdout_every: int, per: np.ndarray, active: np.ndarray,
              step: bool, call: bool) -> Tuple[float, float, Dict[str, float], np.ndarray, np.ndarray]:
    """The best knee on the `_knees` grid: (squared relative error on the fitted points, knee,
    coefficients, predictions, held-out mask); ``step`` adds the ``c_gemm`` column, ``call``
    the ``c_call`` column (one per point: a kernel call whatever its experts)."""
    _, measured = _points(measurement, "expert_gemm")
    names = ("c_tok", "c_exp") + (("c_gemm",) if step else ()) + (("c_call",) if call else ())
    best: Optional[Tuple[float, float, Dict[str, float], np.ndarray, np.ndarray]] = None
    for knee in _knees(per):
        # (with the step, a knee in (1, 2] lifts only the 1-token points, which c_exp + c_gemm
        # can too: ties go to the lower knee, so such a knee wins only where it fits better)
        cols = ([active * np.maximum(per, knee), active] + ([active * (per >= 2)] if step else [])
                + ([np.ones_like(active)] if call else []))
        coef, pred, held = _linear_fit("expert_gemm", measurement, holdout_every, names,
                                       COMPUTE_PASSES * np.stack(cols, axis=1))
        err = float(np.sum(((pred - measured) / measured)[~held] ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, float(knee), coef, pred, held)
    assert best is not None
    return best


def convex_bound(x: np.ndarray, measured: np.ndarray) -> float:
    """The least max |relative error| over all points that any curve convex in ``x`` can
    reach: float ``x`` ``[n]`` (distinct), ``measured`` ``[n]`` (> 0). A convex g keeps every
    middle point under the chord of two outer ones, g(x_j) <= λ g(x_i) + (1 − λ) g(x_k), so
    with each g within e of its measurement, m_j (1 − e) <= L (1 + e), L = λ m_i + (1 − λ) m_k:
    e >= (m_j − L) / (m_j + L); the largest over all triples bounds every convex fit from below
    (a lower bound: it is exact for three points, not always for more)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    o = np.argsort(x)
    x, m = x[o], m[o]
    best = 0.0
    for j in range(1, len(x) - 1):
        xi, mi = x[:j, None], m[:j, None]
        xk, mk = x[None, j + 1:], m[None, j + 1:]
        lam = (xk - x[j]) / (xk - xi)
        chord = lam * mi + (1 - lam) * mk
        best = max(best, float(np.max((m[j] - chord) / (m[j] + chord))))
    return best


def monotone_bound(x: np.ndarray, measured: np.ndarray) -> float:
    """The least max |relative error| over all points that any curve non-decreasing in ``x``
    can reach: float ``x`` ``[n]``, ``measured`` ``[n]`` (> 0). Where a point measures more
    than one at a larger ``x`` (m_i > m_j, x_i < x_j), a non-decreasing g with g(x_i) <= g(x_j)
    and each within e of its measurement needs m_i (1 − e) <= m_j (1 + e): e >= (m_i − m_j) /
    (m_i + m_j); the largest over all such pairs (exact: a curve that meets it exists). Every
    cost-model expert curve is non-decreasing in tokens, so this is what the machine's
    non-monotone timings cost any of them."""
    x = np.asarray(x, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    o = np.argsort(x, kind="stable")
    x, m = x[o], m[o]
    best = 0.0
    for i in range(len(x) - 1):
        later = m[i + 1:][x[i + 1:] > x[i]]
        if later.size:
            best = max(best, float((m[i] - later.min()) / (m[i] + later.min())))
    return best


def curve_bound(tokens: np.ndarray, active: np.ndarray, measured: np.ndarray) -> float:
    """The least max |relative error| over all points that any expert curve of the cost model
    without a call's cost (``c_call = 0``) can reach: float ``tokens`` ``[n]`` (tokens per
    expert t), ``active`` ``[n]`` (active experts a), ``measured`` ``[n]`` (> 0). Every such
    curve prices a point as a·f(t) with f non-decreasing in t (`GEMM_STEP_FORMULA` and
    `ROOFLINE_FORMULA` with ``c_call = 0`` both are; `call_curve_bound` adds the call), so with each
    point within e, every pair with t_i <= t_j (equal t included: two active counts of one t
    share f(t)) needs p_i (1 − e) <= p_j (1 + e) for the per-expert times p = m / (3a):
    e >= (p_i − p_j) / (p_i + p_j); the largest over all pairs. Exact: f(t) = the largest
    p_i (1 − e) over t_i <= t meets it. Unlike `monotone_bound` it also counts the spread
    between active counts, so it bounds what any form without the call, tabulated or not, can
    reach."""
    t = np.asarray(tokens, dtype=np.float64)
    p = np.asarray(measured, dtype=np.float64) / (COMPUTE_PASSES * np.asarray(active, dtype=np.float64))
    o = np.argsort(t, kind="stable")
    t, p = t[o], p[o]
    best = 0.0
    for i in range(len(t)):
        later = p[t >= t[i]]  # t sorted: every j with t_j >= t_i, i itself included (gives 0)
        best = max(best, float((p[i] - later.min()) / (p[i] + later.min())))
    return best


def call_curve_feasible(tokens: np.ndarray, active: np.ndarray, measured: np.ndarray,
                        error: float) -> Optional[float]:
    """The least call time c >= 0 for which some curve 3·(c + a·f(t)), f >= 0 non-decreasing in
    t, is within ``error`` (relative) of every point, or None where none is: float ``tokens``
    ``[n]``, ``active`` ``[n]`` (> 0), ``measured`` ``[n]`` (> 0). With each point within e,
    f(t_i) lies in [(L_i − c)/a_i, (U_i − c)/a_i], L, U = m·(1 ∓ e)/3, and f(t_i) >= 0 needs
    c <= U_i; a non-decreasing f through those intervals exists exactly when every pair with
    t_i <= t_j has (L_i − c)/a_i <= (U_j − c)/a_j (then f(t) = the largest lower end at or
    below t meets them), a condition linear in c: c·(1/a_j − 1/a_i) <= U_j/a_j − L_i/a_i. So
    the feasible c form an interval, and its lower end is returned."""
    t = np.asarray(tokens, dtype=np.float64)
    a = np.asarray(active, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    lo, hi = m * (1.0 - error) / COMPUTE_PASSES, m * (1.0 + error) / COMPUTE_PASSES
    pair = t[:, None] <= t[None, :]  # [i, j]: t_i <= t_j
    coef = (1.0 / a)[None, :] - (1.0 / a)[:, None]
    rhs = (hi / a)[None, :] - (lo / a)[:, None]
    tol = 1e-12 * float(np.abs(rhs).max(initial=0.0))
    if np.any(pair & (coef == 0) & (rhs < -tol)):
        return None
    up = pair & (coef > 0)
    down = pair & (coef < 0)
    c_hi = min(float(hi.min()), float(np.min(rhs[up] / coef[up], initial=np.inf)))
    c_lo = max(0.0, float(np.max(rhs[down] / coef[down], initial=-np.inf)))
    return c_lo if c_lo <= c_hi + tol else None


def call_curve_bound(tokens: np.ndarray, active: np.ndarray, measured: np.ndarray) -> float:
    """The least max |relative error| over all points that any expert curve of the cost model
    with a kernel call's cost can reach: float ``tokens`` ``[n]``, ``active`` ``[n]``,
    ``measured`` ``[n]`` (> 0). Every such curve prices a point as 3·(c + a·f(t)), c = c_call
    >= 0 and f >= 0 non-decreasing in t (`GEMM_STEP_FORMULA`, `ROOFLINE_FORMULA`); whether
    some (c, f) is within e of every point is decided exactly by `call_curve_feasible`, and
    feasibility only grows with e, so the least e is found by bisection (to 1e-7). With c = 0
    the curves are `curve_bound`'s, so this is never above it."""
    if call_curve_feasible(tokens, active, measured, 0.0) is not None:
        return 0.0
    lo, hi = 0.0, 1.0  # e = 1 admits every point: c = 0, f = 0 (each within 100%)
    while hi - lo > 1e-7:
        mid = 0.5 * (lo + hi)
        if call_curve_feasible(tokens, active, measured, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _max_abs(rel: np.ndarray, mask: np.ndarray) -> Optional[float]:
    return float(np.abs(rel[mask]).max()) if mask.any() else None


def fit_expert_gemm(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """Forward + backward of ``active`` experts with ``tokens_per_expert`` t tokens each in one
    kernel call: 3·(c_call + active·(c_exp + max(c_tok·t, c_weights) + c_gemm·[t ≥ 2]))
    (`GEMM_STEP_FORMULA`), the cost model's expert term of one rank over three passes. The knee
    ``c_weights / c_tok`` is searched on a grid (`_knees`); for each knee the rest is linear in
    (c_tok, c_exp, c_gemm, c_call) and fitted by `nnls_relative`; the knee with the least
    squared relative error on the fitted points wins (knee 1: no floor).

    ``c_call`` is what a call costs whatever its experts (the kernel's set-up, the framework's
    per-operator work around it, an idle stack slot's zero gradient): it is what makes one
    expert's call dearer per expert than a share of eight experts' at the same tokens per
    expert, which no curve active·f(t) can follow (``curve_bound``). It can be told from
    ``c_exp`` only where the fitted points have two active counts or more (otherwise it is 0);
    ``call_curve_bound`` is the least max error any curve of the cost model, call included,
    can reach on these timings.

    ``c_gemm`` is the fixed cost of a GEMM beyond a matrix-vector product: on CPU one token per
    expert runs as a matrix-vector product (and its weight gradient as an outer product),
    which skips it, so the measured curve steps up from 1 to 2 tokens and is concave there,
    which no convex curve follows (``convex_bound``). It can be fitted only where the fitted
    points have experts on both sides of the step (some with 1 token, some with >= 2;
    otherwise it is ``c_exp`` over again), and it is committed only where it earns its
    parameter: its squared relative error on the fitted points is at most `STEP_MIN_GAIN`
    times the roofline's. Otherwise the few 1-token points' noise would set ``c_exp`` and the
    step together and price the held-out points worse than the roofline does; the committed
    form is then `ROOFLINE_FORMULA` with ``c_gemm = 0``. The form not committed is reported in
    ``alternative_forms`` (``"roofline"`` or ``"gemm_step"``), held out the same way, so the
    report says what the step buys or would have bought."""
    sweep, measured = _points(measurement, "expert_gemm")
    if all("tokens_per_expert" in p for p in sweep):
        per = np.array([p["tokens_per_expert"] for p in sweep], dtype=np.float64)
    else:  # an older measurement: tokens / active
        per = np.array([p["tokens"] / p["active_experts"] for p in sweep], dtype=np.float64)
    active = np.array([p["active_experts"] for p in sweep], dtype=np.float64)
    fitted = ~holdout_mask(len(sweep), holdout_every)
    eligible = bool(fitted.sum() >= 3 and (per[fitted] < 2).any() and (per[fitted] >= 2).any())
    # a call's cost and c_exp are one column over a single active count
    call = bool(np.unique(active[fitted]).size >= 2)

    def form(step: bool) -> Tuple[float, Dict[str, float], np.ndarray, np.ndarray]:
        sq, knee, coef, pred, held = _roofline(measurement, holdout_every, per, active, step=step, call=call)
        coef = {**coef, "c_gemm": coef.get("c_gemm", 0.0), "c_call": coef.get("c_call", 0.0),
                "c_weights": coef["c_tok"] * knee if knee > per.min() else 0.0, "knee_tokens_per_expert": knee}
        return sq, coef, pred, held

    roof_sq, coef, pred, held = form(False)
    stepped, other, ratio = False, None, None
    if eligible:
        step_fit = form(True)
        ratio = step_fit[0] / roof_sq if roof_sq > 0 else None
        # (and by more than rounding, so timings the roofline fits exactly keep the roofline)
        stepped = step_fit[0] < STEP_MIN_GAIN * roof_sq and roof_sq - step_fit[0] > 1e-18
        other = ("roofline", ROOFLINE_FORMULA, (roof_sq, coef, pred, held))
        if stepped:
            (_, coef, pred, held) = step_fit
        else:
            other = ("gemm_step", GEMM_STEP_FORMULA, step_fit)
    knee, c_weights = coef["knee_tokens_per_expert"], coef["c_weights"]
    notes = [f"roofline knee at {knee:.3g} tokens per expert (c_weights = c_tok * knee; "
             f"{'no floor inside the sweep' if c_weights == 0 else 'weights-bound below it'})"]
    if stepped:
        notes.append(f"GEMM step c_gemm = {coef['c_gemm']:.3g} s per expert with >= 2 tokens (1 token runs as a "
                     f"matrix-vector product)")
    elif eligible:
        notes.append(f"no GEMM step committed (c_gemm = 0): with it the fitted points' squared relative error "
                     f"would not fall below {STEP_MIN_GAIN:.0%} of the roofline's (alternative_forms.gemm_step)")
    else:
        notes.append("no GEMM step fitted: the fitted points do not have experts on both sides of 2 tokens "
                     "(c_gemm = 0)")
    if call:
        notes.append(f"kernel call c_call = {coef['c_call']:.3g} s per call and pass, whatever its experts")
    else:
        notes.append("no call cost fitted: the fitted points have one active count, where c_call and c_exp are "
                     "one column (c_call = 0)")
    extra = _forward(measurement)
    # the curve without the step is convex in tokens per expert: no fit of it beats this on all points
    extra["convex_bound"] = max(convex_bound(per[active == a], measured[active == a]) for a in np.unique(active))
    if extra["convex_bound"] > 0.05:
        notes.append(f"measured times are not convex in tokens per expert: every convex curve (the roofline "
                     f"without c_gemm) misses some point of one active count by >= {extra['convex_bound']:.1%}")
    # and every curve of the cost model is non-decreasing in tokens per expert
    extra["monotone_bound"] = max(monotone_bound(per[active == a], measured[active == a]) for a in np.unique(active))
    if extra["monotone_bound"] > 0.05:
        notes.append(f"measured times are not non-decreasing in tokens per expert: every curve of the cost model "
                     f"(non-decreasing) misses some point of one active count by >= {extra['monotone_bound']:.1%}")
    # without a call's cost every curve prices a·f(t): the spread between active counts at one t
    # counts too; with it, c + a·f(t)
    extra["curve_bound"] = curve_bound(per, active, measured)
    extra["call_curve_bound"] = call_curve_bound(per, active, measured)
    if extra["call_curve_bound"] > 0.05:
        notes.append(f"no expert curve of the cost model (a call plus active experts × a non-decreasing curve in "
                     f"tokens per expert, tabulated or not) fits every point within {extra['call_curve_bound']:.1%}")
    if other is not None:
        name, formula, (_, o_coef, o_pred, _) = other
        rel = (o_pred - measured) / measured
        alt = {"formula": formula, "coefficients": o_coef, "predicted_s": o_pred.tolist(),
               "max_rel_error": _max_abs(rel, held), "max_rel_error_fit": _max_abs(rel, ~held), "priced": False}
        extra["alternative_forms"] = {name: alt}
        extra["step_sq_error_ratio"] = ratio
        own = _max_abs((pred - measured) / measured, held)
        if alt["max_rel_error"] is not None and own is not None:
            what = "without the GEMM step (c_gemm = 0, a convex curve)" if stepped else "with the GEMM step"
            notes.append(f"{what} the held-out max rel. error would be {alt['max_rel_error']:.1%} instead of "
                         f"{own:.1%} (alternative_forms.{name})")
    fields = {"c_tok": coef["c_tok"], "c_exp": coef["c_exp"], "c_weights": c_weights, "c_gemm": coef["c_gemm"],
              "c_call": coef["c_call"]}
    return KernelFit("expert_gemm", GEMM_STEP_FORMULA if stepped else ROOFLINE_FORMULA, sweep,
                     measured.tolist(), pred.tolist(), held.tolist(), coef, fields, notes, extra=extra)


def fit_attention(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """Forward + backward of one full-attention layer on one sample of ``length`` n:
    3·(a_lin·n + a_quad·n²). ``a_quad`` goes to the model's full-attention layers; the
    linear-attention layers get 0, as `CostModel.from_model` gives them."""
    sweep, measured = _points(measurement, "attention")
    n = np.array([p["length"] for p in sweep], dtype=np.float64)
    coef, pred, held = _linear_fit("attention", measurement, holdout_every, ("a_lin", "a_quad"),
                                   COMPUTE_PASSES * np.stack([n, n * n], axis=1))
    a_quad = [coef["a_quad"] if kind == "full" else 0.0 for kind in model.attention]
    notes = ["a_lin is fitted on full-attention layers and applies to every layer (the cost model "
             "has one a_lin); linear-attention layers get a_quad = 0"]
    if "parts" in measurement:
        notes.append(f"timed per token: {', '.join(measurement['parts'])} (moe_origin: the MoE layer's gather, "
                     f"gate-weighted combine and residual at the origin rank)")
    return KernelFit("attention", "3·(a_lin·length + a_quad·length²)", sweep, measured.tolist(), pred.tolist(),
                     held.tolist(), coef, {"a_lin": coef["a_lin"], "a_quad": a_quad}, notes,
                     extra={**_forward(measurement), **{k: measurement[k] for k in ("heads", "head_dim", "top_k", "parts")
                                                        if k in measurement}})


LINK_OPS = ("p2p", "all_to_all", "all_reduce")


def fit_links(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """One-way time of a message of ``bytes`` per rank, per op (``p2p``: half a ping-pong
    between two ranks; ``all_to_all``: every rank sends ``bytes`` to the others in all;
    ``all_reduce``: every rank sums ``bytes`` over the ranks): latency + bytes / bandwidth,
    fitted per op. ``bw_intra`` is the all-to-all's bandwidth and ``a2a_latency`` its latency,
    since the cost model prices exchanges (all-to-alls) with them; ``bw_reduce`` is the
    all-reduce's, in the bytes a ring sends from each rank (``2·(ranks−1)/ranks`` of the
    buffer), where it was measured (reports before it have no ``all_reduce`` points)."""
    sweep, measured = _points(measurement, "links")
    ops = np.array([p["op"] for p in sweep])
    nbytes = np.array([p["bytes"] for p in sweep], dtype=np.float64)
    pred = np.zeros_like(measured)
    held = np.zeros(len(sweep), dtype=bool)
    coef: Dict[str, float] = {}
    for op in LINK_OPS:
        idx = np.flatnonzero(ops == op)
        if idx.size == 0:
            continue
        sub = {"sweep": [sweep[i] for i in idx], "measured_s": measured[idx]}
        c, p, h = _linear_fit(f"links.{op}", sub, holdout_every, ("latency_s", "s_per_byte"),
                              np.stack([np.ones(idx.size), nbytes[idx]], axis=1))
        if c["s_per_byte"] <= 0:
            raise RoutepackError(f"links.{op}: time does not grow with message size; cannot fit a bandwidth")
        coef[f"latency_{op}_s"] = c["latency_s"]
        coef[f"bw_{op}"] = 1.0 / c["s_per_byte"]
        pred[idx], held[idx] = p, h
    if "bw_all_to_all" not in coef:
        raise RoutepackError("links: no all_to_all points measured; cannot fit bw_intra")
    fields = {"bw_intra": coef["bw_all_to_all"], "a2a_latency": coef["latency_all_to_all_s"]}
    notes = [f"bw_intra = the all-to-all's bandwidth between {measurement.get('ranks', '?')} local processes "
             f"({measurement.get('backend', '?')}); a2a_latency = its latency "
             f"({coef['latency_all_to_all_s']:.3g} s per all-to-all); the p2p figures are reported only"]
    if "bw_all_reduce" in coef:
        ranks = int(measurement.get("ranks", 2))
        fields["bw_reduce"] = 2.0 * (ranks - 1) / ranks * coef["bw_all_reduce"]
        notes.append(f"bw_reduce = the all-reduce's bandwidth in a ring's bytes sent per rank "
                     f"(2·({ranks}−1)/{ranks} of the buffer): {fields['bw_reduce']:.3g} B/s")
    return KernelFit("links", "latency_<op> + bytes / bw_<op>", sweep, measured.tolist(), pred.tolist(),
                     held.tolist(), coef, fields, notes,
                     extra={k: measurement[k] for k in ("ranks", "backend", "clock") if k in measurement})


#: All-to-alls of one MoE layer's forward and backward: dispatch and combine, each pass.
LAYER_ALL_TO_ALLS = 4.0


def fit_exchange(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape,
                 priced: CostModel) -> KernelFit:
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
    sweep, measured = _points(measurement, "exchange")
    tokens = np.array([p["tokens"] for p in sweep], dtype=np.float64)
    nbytes = np.array([p["remote_bytes"] for p in sweep], dtype=np.float64)
    origin = COMPUTE_PASSES * priced.a_lin * tokens
    calls = np.full(tokens.size, LAYER_ALL_TO_ALLS)
    formula = "4·(a2a_latency + remote_bytes / bw_intra) + 3·(a_lin + a_lin_extra)·tokens"
    coef, pred, held = _linear_fit("exchange", measurement, holdout_every, ("a2a_latency", "s_per_byte", "a_lin_extra"),
                                   np.stack([calls, LAYER_ALL_TO_ALLS * nbytes, COMPUTE_PASSES * tokens], axis=1),
                                   offset=origin)
    # a share of every point's time below a millionth is the solver's rounding, not a cost
    if np.any(LAYER_ALL_TO_ALLS * nbytes * coef["s_per_byte"] > 1e-6 * measured):
        bw, how = 1.0 / coef["s_per_byte"], "fitted"
    else:
        bw, how = priced.bw_intra, "the links' (the bytes fitted no cost of their own)"
        coef, pred, held = _linear_fit("exchange", measurement, holdout_every, ("a2a_latency", "a_lin_extra"),
                                       np.stack([calls, COMPUTE_PASSES * tokens], axis=1),
                                       offset=origin + LAYER_ALL_TO_ALLS * nbytes / bw)
    coef = {"a2a_latency": coef["a2a_latency"], "bw_intra": bw, "a_lin_extra": coef["a_lin_extra"]}
    # what the other kinds' model charged the layer: the links' latency and bandwidth, the origin work
    charged = origin + LAYER_ALL_TO_ALLS * (priced.a2a_latency + nbytes / priced.bw_intra)
    before = float(np.max(np.abs(charged / measured - 1.0)))
    notes = [f"bw_intra {how}: {bw:.3g} B/s (the links': {priced.bw_intra:.3g}); a2a_latency {coef['a2a_latency']:.3g} s "
             f"(the links': {priced.a2a_latency:.3g}); a_lin = {priced.a_lin:.3g} (origin) + {coef['a_lin_extra']:.3g}; "
             f"the links' and origin's model alone missed the layer by up to {before:.0%}"]
    return KernelFit("exchange", formula, sweep, measured.tolist(), pred.tolist(), held.tolist(),
                     {**coef, "a_lin": priced.a_lin},
                     {"a2a_latency": coef["a2a_latency"], "bw_intra": bw, "a_lin": priced.a_lin + coef["a_lin_extra"]},
                     notes, extra={"priced_before_s": charged.tolist(), "max_rel_error_before": before,
                                   **{k: measurement[k] for k in ("layer_s", "kernel_s", "ranks", "backend", "clock",
                                                                  "dtype") if k in measurement}})


#: Per-point and per-sweep timer figures a fit passes through to the report unchanged.
TIMER_KEYS = ("spread", "calls_per_visit", "loadavg", "drift")


def _forward(measurement: Mapping[str, Any]) -> Dict[str, Any]:
    """The forward-only times measured alongside, and their median share of forward +
    backward (what the cost model's 1 : 3 pass ratio assumes to be 1/3); the timer's figures
    (`TIMER_KEYS`) where the measurement has them."""
    out = {k: measurement[k] for k in TIMER_KEYS if k in measurement}
    fwd = measurement.get("forward_s")
    if fwd is None:
        return out
    share = np.asarray(fwd, dtype=np.float64) / np.asarray(measurement["measured_s"], dtype=np.float64)
    return {**out, "forward_s": list(map(float, fwd)), "forward_share": float(np.median(share))}


#: kernel kind -> its fitting function ``(measurement, holdout_every, model) -> KernelFit``.
FITS: Dict[str, Callable[[Mapping[str, Any], int, ModelShape], KernelFit]] = {
    "expert_gemm": fit_expert_gemm,
    "attention": fit_attention,
    "links": fit_links,
}


def fit_all(measurements: Mapping[str, Mapping[str, Any]], holdout_every: int, model: ModelShape,
            hardware: Optional[Hardware] = None,
            bw_inter: Optional[float] = None) -> Tuple[Dict[str, KernelFit], CostModel, Dict[str, str]]:
    """Every measured kind fitted (`FITS`), the cost model they give (`to_cost_model`) and
    where each field came from; then the ``exchange`` (where measured) against that model
    (`fit_exchange`), its fields in place."""
    fits = {kind: FITS[kind](m, holdout_every, model) for kind, m in measurements.items() if kind in FITS}
    cost, sources = to_cost_model(model, fits, hardware, bw_inter)
    if "exchange" in measurements:
        fits["exchange"] = fit_exchange(measurements["exchange"], holdout_every, model, cost)
        cost = replace(cost, **fits["exchange"].cost_fields)
        for name in fits["exchange"].cost_fields:
            sources[name] = "measured: exchange" + (f" (on {sources[name]})" if name == "a_lin" else "")
    return fits, cost, sources


def to_cost_model(model: ModelShape, fits: Mapping[str, KernelFit], hardware: Optional[Hardware] = None,
                  bw_inter: Optional[float] = None, weight_bytes: float = 2) -> Tuple[CostModel, Dict[str, str]]:
    """`CostModel.from_model` (byte counts and whatever was not measured, from ``hardware``,
    default `Hardware.h200`) with the fitted fields in place, and where each field came
    from: ``measured: <kind>``, ``given`` (``bw_inter``) or ``preset <name>``."""
    hardware = hardware or Hardware.h200()
    base = CostModel.from_model(model, hardware, weight_bytes)
    sources = {name: f"preset {hardware.name}" for name in base.__dataclass_fields__}
    for name in ("token_bytes", "expert_weight_bytes", "expert_grad_bytes", "expert_state_bytes", "expert_groups",
                 "num_experts"):
        if name in sources:
            sources[name] = "model shape"
    fields: Dict[str, Any] = {}
    for kind, fit in fits.items():
        for name, value in fit.cost_fields.items():
            if name in fields:
                raise RoutepackError(f"fits: {kind} and {sources[name]} both set cost.{name}")
            fields[name] = value
            sources[name] = f"measured: {kind}"
    if bw_inter is not None:
        fields["bw_inter"] = bw_inter
        sources["bw_inter"] = "given (--bw-inter)"
    return replace(base, **fields), sources
