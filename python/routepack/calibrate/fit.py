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
prices a pass as ``expert_time`` (+ the roofline floor, the GEMM step and the table) / ``attention_of_sums`` and counts
``COMPUTE_PASSES`` = 3 of them for the default ``passes`` (forward + backward; docs/design.md,
"Passes"), so the predicted time of a point is 3 × the per-pass formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from routepack.calibrate.curve_bounds import call_curve_bound, convex_bound, curve_bound, monotone_bound
from routepack.calibrate.expert_table import table_columns, table_knots
from routepack.errors import RoutepackError
from routepack.model import CostModel, Hardware, ModelShape

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


def _points(measurement: Mapping[str, Any], kind: str) -> Tuple[List[Dict[str, Any]], np.ndarray]:
    sweep = list(measurement.get("sweep", ()))
    measured = np.asarray(measurement.get("measured_s", ()), dtype=np.float64)
    if not sweep or measured.shape != (len(sweep),):
        raise RoutepackError(
            f"{kind}: needs one measured time per sweep point, got {measured.shape[0]} for {len(sweep)} points"
        )
    return sweep, measured


def _linear_fit(
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
    _, measured = _points(measurement, kind)
    held = holdout_mask(len(measured), holdout_every) if mask is None else mask
    if int((~held).sum()) < len(names):
        raise RoutepackError(
            f"{kind}: {int((~held).sum())} fitted points cannot determine "
            f"{len(names)} coefficients {list(names)}; measure more points"
        )
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
GEMM_STEP_FORMULA = (
    "3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights) + c_gemm·[tokens_per_expert ≥ 2]))"
)
#: The expert curve without the GEMM step (convex in tokens per expert), reported alongside.
ROOFLINE_FORMULA = "3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights)))"
#: The GEMM step is committed only where it cuts the fitted points' squared relative error to
#: below this share of the roofline's. Measured: on timings of the roofline with 0.1–5% noise
#: the step's extra parameter buys a ratio of 0.83–1.0 (400 draws; 0.88–1.0 in 150 with the
#: call's column); on this CPU's sweeps 0.02–0.12 at the tiny profile's shapes and 0.33–0.44
#: at the measured run's (H = I = 256, a stack of 10), where ½ had refused the step in some
#: runs and committed a roofline 21–54% off at held-out points.
STEP_MIN_GAIN = 0.75


#: The expert curve with a tabulated part (`CostModel.expert_table`): a line (no floor: the table
#: takes it) plus a non-negative table of knots in tokens per expert, 0 at the last.
TABLE_FORMULA = (
    "3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights) + table(tokens_per_expert)))"
)
#: The table is committed only where it cuts the fitted points' squared relative error to below
#: this share of the closed form's (the roofline or the GEMM step, whichever was committed):
#: its knots are parameters too. On timings of the closed forms with 0.1–10% noise (240 draws
#: at the CPU sweep's points) its 7 free knots buy a ratio of 0.70–1.06, median 0.91 (4 draws
#: under ¾); on this CPU's sweeps, whose curve climbs from 2 to 4 tokens per expert and bends
#: up past 128, 0.24–0.43 at tiny's shapes and 0.53 at the measured run's.
TABLE_MIN_GAIN = 0.75


def _table(
    measurement: Mapping[str, Any],
    holdout_every: int,
    per: np.ndarray,
    active: np.ndarray,
    knots: np.ndarray,
    call: bool,
) -> Tuple[float, Dict[str, float], np.ndarray, np.ndarray, List[float]]:
    """The table form: (squared relative error on the fitted points, coefficients, predictions,
    held-out mask, the knots' seconds). No floor (the table takes it, knot by knot). The last
    knot's hat is left out: the table is 0 there, so ``c_tok`` is the slope at the sweep's top.

    The line and the table are told apart only up to one direction: on the knots' span a line
    ``λ·(1 − t/top)`` is a table too (0 at the last knot, linear between the others), so
    ``c_exp + λ``, ``c_tok − λ/top``, ``table − λ·(1 − t/top)`` price every swept point the
    same. Of those, the one with the largest ``c_exp`` whose table stays >= 0 and ``c_tok`` >= 0
    is kept (its table is 0 at some knot before the last, or ``c_tok`` is 0): the per-expert
    cost the planner's proxies see (``c_exp``; they leave the table out) is as much of it as
    the timings allow."""
    _, measured = _points(measurement, "expert_gemm")
    hats = table_columns(per, knots)[:, :-1]
    names = ("c_tok", "c_exp") + tuple(f"table_{k:g}" for k in knots[:-1]) + (("c_call",) if call else ())
    cols = (
        [active * per, active]
        + [active * hats[:, k] for k in range(hats.shape[1])]
        + ([np.ones_like(active)] if call else [])
    )
    coef, pred, held = _linear_fit(
        "expert_gemm", measurement, holdout_every, names, COMPUTE_PASSES * np.stack(cols, axis=1)
    )
    err = float(np.sum(((pred - measured) / measured)[~held] ** 2))
    top = float(knots[-1])
    seconds = np.array([coef.pop(f"table_{k:g}") for k in knots[:-1]])
    lam = max(0.0, float(np.min(seconds / (1.0 - knots[:-1] / top))))
    lam = min(lam, coef["c_tok"] * top)  # (c_tok stays >= 0)
    coef["c_exp"] += lam
    coef["c_tok"] -= lam / top
    seconds = np.maximum(seconds - lam * (1.0 - knots[:-1] / top), 0.0)
    return err, coef, pred, held, [*map(float, seconds), 0.0]


def _roofline(
    measurement: Mapping[str, Any], holdout_every: int, per: np.ndarray, active: np.ndarray, step: bool, call: bool
) -> Tuple[float, float, Dict[str, float], np.ndarray, np.ndarray]:
    """The best knee on the `_knees` grid: (squared relative error on the fitted points, knee,
    coefficients, predictions, held-out mask); ``step`` adds the ``c_gemm`` column, ``call``
    the ``c_call`` column (one per point: a kernel call whatever its experts)."""
    _, measured = _points(measurement, "expert_gemm")
    names = ("c_tok", "c_exp") + (("c_gemm",) if step else ()) + (("c_call",) if call else ())
    best: Optional[Tuple[float, float, Dict[str, float], np.ndarray, np.ndarray]] = None
    for knee in _knees(per):
        # (with the step, a knee in (1, 2] lifts only the 1-token points, which c_exp + c_gemm
        # can too: ties go to the lower knee, so such a knee wins only where it fits better)
        cols = (
            [active * np.maximum(per, knee), active]
            + ([active * (per >= 2)] if step else [])
            + ([np.ones_like(active)] if call else [])
        )
        coef, pred, held = _linear_fit(
            "expert_gemm", measurement, holdout_every, names, COMPUTE_PASSES * np.stack(cols, axis=1)
        )
        err = float(np.sum(((pred - measured) / measured)[~held] ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, float(knee), coef, pred, held)
    assert best is not None
    return best


def _earns(richer_sq: float, simpler_sq: float, gain: float) -> bool:
    """Whether a richer form earns its parameters: its squared relative error on the fitted
    points below ``gain`` times the simpler form's, and by more than rounding (so timings the
    simpler form fits exactly keep it)."""
    return richer_sq < gain * simpler_sq and simpler_sq - richer_sq > 1e-18


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
    report says what the step buys or would have bought.

    Then the table form (`TABLE_FORMULA`, `_table`): a line plus a non-negative table of
    seconds per expert at knots in tokens per expert (`table_knots`), linear between them
    (`CostModel.expert_table`), for what no closed form follows (on this CPU the time climbs
    from 2 to 4 tokens per expert, levels off to 16 and bends up past 128). It is committed
    where its squared relative error on the fitted points is below `TABLE_MIN_GAIN` times the
    closed form's (the one committed above, named in ``closed_form``; ``table_sq_error_ratio``
    the ratio), with ``c_gemm = 0`` and no floor (its knots carry both); otherwise it is
    reported in ``alternative_forms["table"]``."""
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
        coef = {
            **coef,
            "c_gemm": coef.get("c_gemm", 0.0),
            "c_call": coef.get("c_call", 0.0),
            "c_weights": coef["c_tok"] * knee if knee > per.min() else 0.0,
            "knee_tokens_per_expert": knee,
        }
        return sq, coef, pred, held

    # name -> (squared relative error on the fitted points, coefficients, predictions, held out, table)
    forms: Dict[str, Tuple[float, Dict[str, float], np.ndarray, np.ndarray, List[List[float]]]] = {
        "roofline": (*form(False), [])
    }
    ratio = None
    committed = "roofline"
    if eligible:
        forms["gemm_step"] = (*form(True), [])
        roof_sq, step_sq = forms["roofline"][0], forms["gemm_step"][0]
        ratio = step_sq / roof_sq if roof_sq > 0 else None
        if _earns(step_sq, roof_sq, STEP_MIN_GAIN):
            committed = "gemm_step"
    closed = committed
    knots = table_knots(per, fitted)
    table_ratio = None
    if knots.size >= 3:  # two knots past the first at least (one would be the GEMM step again)
        t_sq, t_coef, t_pred, t_held, seconds = _table(measurement, holdout_every, per, active, knots, call)
        t_coef = {
            **t_coef,
            "c_gemm": 0.0,
            "c_call": t_coef.get("c_call", 0.0),
            "c_weights": 0.0,
            "knee_tokens_per_expert": float(per.min()),
        }
        forms["table"] = (t_sq, t_coef, t_pred, t_held, [[float(k), float(v)] for k, v in zip(knots, seconds)])
        closed_sq = forms[closed][0]
        table_ratio = t_sq / closed_sq if closed_sq > 0 else None
        if _earns(t_sq, closed_sq, TABLE_MIN_GAIN):
            committed = "table"
    _, coef, pred, held, table = forms[committed]
    knee = coef["knee_tokens_per_expert"]
    c_weights = coef["c_weights"]
    notes = [
        f"roofline knee at {knee:.3g} tokens per expert (c_weights = c_tok * knee; "
        f"{'no floor inside the sweep' if c_weights == 0 else 'weights-bound below it'})"
    ]
    if committed == "gemm_step":
        notes.append(
            f"GEMM step c_gemm = {coef['c_gemm']:.3g} s per expert with >= 2 tokens (1 token runs as a "
            f"matrix-vector product)"
        )
    elif eligible and closed == "roofline":
        notes.append(
            f"no GEMM step committed (c_gemm = 0): with it the fitted points' squared relative error "
            f"would not fall below {STEP_MIN_GAIN:.0%} of the roofline's (alternative_forms.gemm_step)"
        )
    elif not eligible:
        notes.append(
            "no GEMM step fitted: the fitted points do not have experts on both sides of 2 tokens (c_gemm = 0)"
        )
    if committed == "table":
        notes.append(
            "expert table committed (its knots carry the GEMM step, c_gemm = 0): "
            + ", ".join(f"{k:g} tokens {v:.3g} s" for k, v in table)
            + f" per expert and pass beyond the roofline; it cut the fitted points' squared relative "
            f"error to {table_ratio:.2f} of the {closed} form's"
        )
    elif "table" in forms:
        notes.append(
            f"no expert table committed: with it the fitted points' squared relative error would not fall "
            f"below {TABLE_MIN_GAIN:.0%} of the {closed} form's (alternative_forms.table)"
        )
    if call:
        notes.append(f"kernel call c_call = {coef['c_call']:.3g} s per call and pass, whatever its experts")
    else:
        notes.append(
            "no call cost fitted: the fitted points have one active count, where c_call and c_exp are "
            "one column (c_call = 0)"
        )
    extra = _forward(measurement)
    # the curve without the step is convex in tokens per expert: no fit of it beats this on all points
    extra["convex_bound"] = max(convex_bound(per[active == a], measured[active == a]) for a in np.unique(active))
    if extra["convex_bound"] > 0.05:
        notes.append(
            f"measured times are not convex in tokens per expert: every convex curve (the roofline "
            f"without c_gemm) misses some point of one active count by >= {extra['convex_bound']:.1%}"
        )
    # and every curve of the cost model is non-decreasing in tokens per expert
    extra["monotone_bound"] = max(monotone_bound(per[active == a], measured[active == a]) for a in np.unique(active))
    if extra["monotone_bound"] > 0.05:
        notes.append(
            f"measured times are not non-decreasing in tokens per expert: every curve of the cost model "
            f"(non-decreasing) misses some point of one active count by >= {extra['monotone_bound']:.1%}"
        )
    # without a call's cost every curve prices a·f(t): the spread between active counts at one t
    # counts too; with it, c + a·f(t)
    extra["curve_bound"] = curve_bound(per, active, measured)
    extra["call_curve_bound"] = call_curve_bound(per, active, measured)
    if extra["call_curve_bound"] > 0.05:
        notes.append(
            f"no expert curve of the cost model (a call plus active experts × a non-decreasing curve in "
            f"tokens per expert, tabulated or not) fits every point within {extra['call_curve_bound']:.1%}"
        )
    extra["closed_form"] = closed
    if len(forms) > 1:
        own = _max_abs((pred - measured) / measured, held)
        alternatives = {}
        for name, (_, o_coef, o_pred, _, o_table) in forms.items():
            if name == committed:
                continue
            rel = (o_pred - measured) / measured
            alternatives[name] = {
                "formula": _FORMULAS[name],
                "coefficients": o_coef,
                "expert_table": o_table,
                "predicted_s": o_pred.tolist(),
                "max_rel_error": _max_abs(rel, held),
                "max_rel_error_fit": _max_abs(rel, ~held),
                "priced": False,
            }
            if alternatives[name]["max_rel_error"] is not None and own is not None:
                notes.append(
                    f"{_AS_ALTERNATIVE[name]} the held-out max rel. error would be "
                    f"{alternatives[name]['max_rel_error']:.1%} instead of {own:.1%} "
                    f"(alternative_forms.{name})"
                )
        extra["alternative_forms"] = alternatives
        if ratio is not None or "gemm_step" in forms:
            extra["step_sq_error_ratio"] = ratio
        if "table" in forms:
            extra["table_sq_error_ratio"] = table_ratio
    fields = {
        "c_tok": coef["c_tok"],
        "c_exp": coef["c_exp"],
        "c_weights": c_weights,
        "c_gemm": coef["c_gemm"],
        "c_call": coef["c_call"],
        "expert_table": table,
    }
    return KernelFit(
        "expert_gemm",
        _FORMULAS[committed],
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        coef,
        fields,
        notes,
        extra=extra,
    )


#: The expert fit's forms by name (`fit_expert_gemm`'s ``alternative_forms`` keys).
_FORMULAS = {"roofline": ROOFLINE_FORMULA, "gemm_step": GEMM_STEP_FORMULA, "table": TABLE_FORMULA}
#: How a note names a form not committed.
_AS_ALTERNATIVE = {
    "roofline": "without the GEMM step (c_gemm = 0, a convex curve)",
    "gemm_step": "with the GEMM step",
    "table": "with the expert table",
}


def fit_attention(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """Forward + backward of one full-attention layer on one sample of ``length`` n:
    3·(a_lin·n + a_quad·n²). ``a_quad`` goes to the model's full-attention layers; the
    linear-attention layers get 0, as `CostModel.from_model` gives them."""
    sweep, measured = _points(measurement, "attention")
    n = np.array([p["length"] for p in sweep], dtype=np.float64)
    coef, pred, held = _linear_fit(
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
            **_forward(measurement),
            **{k: measurement[k] for k in ("heads", "head_dim", "top_k", "parts") if k in measurement},
        },
    )


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
        c, p, h = _linear_fit(
            f"links.{op}",
            sub,
            holdout_every,
            ("latency_s", "s_per_byte"),
            np.stack([np.ones(idx.size), nbytes[idx]], axis=1),
        )
        if c["s_per_byte"] <= 0:
            raise RoutepackError(f"links.{op}: time does not grow with message size; cannot fit a bandwidth")
        coef[f"latency_{op}_s"] = c["latency_s"]
        coef[f"bw_{op}"] = 1.0 / c["s_per_byte"]
        pred[idx], held[idx] = p, h
    if "bw_all_to_all" not in coef:
        raise RoutepackError("links: no all_to_all points measured; cannot fit bw_intra")
    fields = {"bw_intra": coef["bw_all_to_all"], "a2a_latency": coef["latency_all_to_all_s"]}
    notes = [
        f"bw_intra = the all-to-all's bandwidth between {measurement.get('ranks', '?')} local processes "
        f"({measurement.get('backend', '?')}); a2a_latency = its latency "
        f"({coef['latency_all_to_all_s']:.3g} s per all-to-all); the p2p figures are reported only"
    ]
    if "bw_all_reduce" in coef:
        ranks = int(measurement.get("ranks", 2))
        fields["bw_reduce"] = 2.0 * (ranks - 1) / ranks * coef["bw_all_reduce"]
        notes.append(
            f"bw_reduce = the all-reduce's bandwidth in a ring's bytes sent per rank "
            f"(2·({ranks}−1)/{ranks} of the buffer): {fields['bw_reduce']:.3g} B/s"
        )
    return KernelFit(
        "links",
        "latency_<op> + bytes / bw_<op>",
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        coef,
        fields,
        notes,
        extra={k: measurement[k] for k in ("ranks", "backend", "clock") if k in measurement},
    )


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
    sweep, measured = _points(measurement, "exchange")
    tokens = np.array([p["tokens"] for p in sweep], dtype=np.float64)
    nbytes = np.array([p["remote_bytes"] for p in sweep], dtype=np.float64)
    origin = COMPUTE_PASSES * priced.a_lin * tokens
    calls = np.full(tokens.size, LAYER_ALL_TO_ALLS)
    formula = "4·(a2a_latency + remote_bytes / bw_intra) + 3·(a_lin + a_lin_extra)·tokens"
    coef, pred, held = _linear_fit(
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
        coef, pred, held = _linear_fit(
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


def fit_all(
    measurements: Mapping[str, Mapping[str, Any]],
    holdout_every: int,
    model: ModelShape,
    hardware: Optional[Hardware] = None,
    bw_inter: Optional[float] = None,
) -> Tuple[Dict[str, KernelFit], CostModel, Dict[str, str]]:
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


def to_cost_model(
    model: ModelShape,
    fits: Mapping[str, KernelFit],
    hardware: Optional[Hardware] = None,
    bw_inter: Optional[float] = None,
    weight_bytes: float = 2,
) -> Tuple[CostModel, Dict[str, str]]:
    """`CostModel.from_model` (byte counts and whatever was not measured, from ``hardware``,
    default `Hardware.h200`) with the fitted fields in place, and where each field came
    from: ``measured: <kind>``, ``given`` (``bw_inter``) or ``preset <name>``."""
    hardware = hardware or Hardware.h200()
    base = CostModel.from_model(model, hardware, weight_bytes)
    sources = {name: f"preset {hardware.name}" for name in base.__dataclass_fields__}
    for name in (
        "token_bytes",
        "expert_weight_bytes",
        "expert_grad_bytes",
        "expert_state_bytes",
        "expert_groups",
        "num_experts",
    ):
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
