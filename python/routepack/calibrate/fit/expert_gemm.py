"""The expert kernel's fit (`fit_expert_gemm`): the roofline, the GEMM step and the expert
table, each fitted and held out alike; one form committed, the others reported."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from routepack.calibrate.curve_bounds import call_curve_bound, convex_bound, curve_bound, monotone_bound
from routepack.calibrate.expert_table import table_columns, table_knots
from routepack.calibrate.fit.common import (
    COMPUTE_PASSES,
    KernelFit,
    forward_figures,
    holdout_mask,
    linear_fit,
    max_abs,
    points,
)
from routepack.model import ModelShape


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
#: Folds of the cross-validation that chooses the committed form (`fit_expert_gemm`): the
#: fitted points are left out in turn, a fifth at a time, each fold's points predicted by the
#: form fitted on the others.
CV_FOLDS = 5
#: A richer form's cross-validated error must be below the simpler one's by this share (and by
#: 1e-6, rounding) to be committed: ties go to the simpler form.
TIE = 1e-3


def choose_form(tried: Sequence[str], cv_rel: Mapping[str, np.ndarray]) -> str:
    """The committed form: the simplest of ``tried`` (simplest first) whose cross-validated
    mean squared relative error is within one standard error of the best form's (the
    one-standard-error rule). ``cv_rel[name]`` float ``[m]``: each left-out point's relative
    error under ``name``, the same points in the same order for every form.

    The standard error is that of the paired per-point difference of squared errors, so it
    measures how much of the richer form's gain the draw of the points could explain: on timings
    of the roofline with 0.1% noise the GEMM step's extra column won by 0.5% of the error (a
    smaller error by chance, 2.7× the noise on held-out points), where a real GEMM step or table
    wins by many standard errors. Within `TIE` of the best (or 1e-6, rounding) is a tie too.
    Forms without left-out points: the simplest."""
    scored = [name for name in tried if cv_rel[name].size]
    if not scored:
        return tried[0]
    mse = {name: float(np.mean(cv_rel[name] ** 2)) for name in scored}
    best = min(scored, key=lambda name: mse[name])
    for name in tried:
        if name not in mse:
            continue
        d = cv_rel[name] ** 2 - cv_rel[best] ** 2
        se = float(np.std(d, ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0
        if float(np.mean(d)) <= max(se, mse[best] * (2 * TIE), 1e-12):
            return name
    return best


#: The expert curve with a tabulated part (`CostModel.expert_table`): a line (no floor: the table
#: takes it) plus a non-negative table of knots in tokens per expert, 0 at the last.
TABLE_FORMULA = (
    "3·(c_call + active_experts·(c_exp + max(c_tok·tokens_per_expert, c_weights) + table(tokens_per_expert)))"
)


def _table(
    measurement: Mapping[str, Any],
    held: np.ndarray,
    per: np.ndarray,
    active: np.ndarray,
    knots: np.ndarray,
    call: bool,
) -> Tuple[float, Dict[str, float], np.ndarray, List[float]]:
    """The table form fitted on the points not in ``held``: (squared relative error on the fitted
    points, coefficients, predictions, the knots' seconds). No floor (the table takes it, knot by knot). The last
    knot's hat is left out: the table is 0 there, so ``c_tok`` is the slope at the sweep's top.

    The line and the table are told apart only up to one direction: on the knots' span a line
    ``λ·(1 − t/top)`` is a table too (0 at the last knot, linear between the others), so
    ``c_exp + λ``, ``c_tok − λ/top``, ``table − λ·(1 − t/top)`` price every swept point the
    same. Of those, the one with the largest ``c_exp`` whose table stays >= 0 and ``c_tok`` >= 0
    is kept (its table is 0 at some knot before the last, or ``c_tok`` is 0): the per-expert
    cost the planner's proxies see (``c_exp``; they leave the table out) is as much of it as
    the timings allow."""
    _, measured = points(measurement, "expert_gemm")
    hats = table_columns(per, knots)[:, :-1]
    names = ("c_tok", "c_exp") + tuple(f"table_{k:g}" for k in knots[:-1]) + (("c_call",) if call else ())
    cols = (
        [active * per, active]
        + [active * hats[:, k] for k in range(hats.shape[1])]
        + ([np.ones_like(active)] if call else [])
    )
    coef, pred, _ = linear_fit("expert_gemm", measurement, 0, names, COMPUTE_PASSES * np.stack(cols, axis=1), mask=held)
    err = float(np.sum(((pred - measured) / measured)[~held] ** 2))
    top = float(knots[-1])
    seconds = np.array([coef.pop(f"table_{k:g}") for k in knots[:-1]])
    lam = max(0.0, float(np.min(seconds / (1.0 - knots[:-1] / top))))
    lam = min(lam, coef["c_tok"] * top)  # (c_tok stays >= 0)
    coef["c_exp"] += lam
    coef["c_tok"] -= lam / top
    seconds = np.maximum(seconds - lam * (1.0 - knots[:-1] / top), 0.0)
    return err, coef, pred, [*map(float, seconds), 0.0]


def _roofline(
    measurement: Mapping[str, Any], held: np.ndarray, per: np.ndarray, active: np.ndarray, step: bool, call: bool
) -> Tuple[float, float, Dict[str, float], np.ndarray]:
    """The best knee on the `_knees` grid, fitted on the points not in ``held``: (squared
    relative error on the fitted points, knee, coefficients, predictions); ``step`` adds the ``c_gemm`` column, ``call``
    the ``c_call`` column (one per point: a kernel call whatever its experts)."""
    _, measured = points(measurement, "expert_gemm")
    names = ("c_tok", "c_exp") + (("c_gemm",) if step else ()) + (("c_call",) if call else ())
    best: Optional[Tuple[float, float, Dict[str, float], np.ndarray]] = None
    for knee in _knees(per):
        # (with the step, a knee in (1, 2] lifts only the 1-token points, which c_exp + c_gemm
        # can too: ties go to the lower knee, so such a knee wins only where it fits better)
        cols = (
            [active * np.maximum(per, knee), active]
            + ([active * (per >= 2)] if step else [])
            + ([np.ones_like(active)] if call else [])
        )
        coef, pred, _ = linear_fit(
            "expert_gemm", measurement, 0, names, COMPUTE_PASSES * np.stack(cols, axis=1), mask=held
        )
        err = float(np.sum(((pred - measured) / measured)[~held] ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, float(knee), coef, pred)
    assert best is not None
    return best


def cv_folds(fitted: np.ndarray, per: np.ndarray, active: np.ndarray, folds: int = CV_FOLDS) -> List[np.ndarray]:
    """bool ``[n]`` masks, one per fold, of the fitted points (``fitted`` bool ``[n]``) it leaves
    out: the fitted points in sweep order, each ``folds``-th one to a fold, except each active
    count's fewest and most tokens per expert, which every fold fits (so a left-out point is
    interpolated, never extrapolated, as the held-out points are). Fewer folds where fewer
    points can be left out; none where none can."""
    idx = np.flatnonzero(fitted)
    ends = set()
    for a in np.unique(active[idx]):
        sel = idx[active[idx] == a]
        ends |= {int(sel[np.argmin(per[sel])]), int(sel[np.argmax(per[sel])])}
    inner = np.array([i for i in idx.tolist() if i not in ends], dtype=np.int64)
    k = min(folds, inner.size)
    out = []
    for f in range(k):
        m = np.zeros(fitted.shape, dtype=bool)
        m[inner[f::k]] = True
        out.append(m)
    return out


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
    otherwise it is ``c_exp`` over again).

    And the table form (`TABLE_FORMULA`, `_table`): a line plus a non-negative table of seconds
    per expert at knots in tokens per expert (`table_knots`), linear between them
    (`CostModel.expert_table`), with ``c_gemm = 0`` and no floor (its knots carry both), for
    what no closed form follows (on this CPU the time climbs from 2 to 4 tokens per expert,
    levels off to 16 and bends up past 128).

    **The committed form is the one that predicts best**: each form (the roofline, the GEMM
    step where it can be fitted, the table where its knots can) is cross-validated on the fitted
    points (`cv_folds`: `CV_FOLDS` folds, each predicted by the form fitted on the rest, every
    active count's end points always fitted, so a fold is interpolated) and the simplest form
    within one standard error of the least mean square of those relative errors wins
    (`choose_form`): a richer form must predict better by more than the draw of the points
    explains. A form with more parameters
    than some fold's fit has points is not tried. The error on the fitted points would always
    prefer the form with the most parameters: the table's knots fit the noise of the points they
    sit on, and missed held-out points by 9–21% where a closed form missed them by 2–5%. The
    report's held-out points stay out of the choice too (they judge it: ``max_rel_error``). The
    forms not committed are reported in ``alternative_forms`` (fitted on all the fitted points,
    held out the same way), every form's cross-validated errors in ``cross_validation``."""
    sweep, measured = points(measurement, "expert_gemm")
    if all("tokens_per_expert" in p for p in sweep):
        per = np.array([p["tokens_per_expert"] for p in sweep], dtype=np.float64)
    else:  # an older measurement: tokens / active
        per = np.array([p["tokens"] / p["active_experts"] for p in sweep], dtype=np.float64)
    active = np.array([p["active_experts"] for p in sweep], dtype=np.float64)
    held = holdout_mask(len(sweep), holdout_every)
    fitted = ~held
    eligible = bool(fitted.sum() >= 3 and (per[fitted] < 2).any() and (per[fitted] >= 2).any())
    # a call's cost and c_exp are one column over a single active count
    call = bool(np.unique(active[fitted]).size >= 2)
    knots = table_knots(per, fitted)

    def fit_form(name: str, out: np.ndarray) -> Tuple[Dict[str, float], np.ndarray, List[List[float]]]:
        """Form ``name`` fitted on the points not in ``out``: (coefficients, predictions, table)."""
        if name == "table":
            _, coef, pred, seconds = _table(measurement, out, per, active, knots, call)
            coef = {
                **coef,
                "c_gemm": 0.0,
                "c_call": coef.get("c_call", 0.0),
                "c_weights": 0.0,
                "knee_tokens_per_expert": float(per.min()),
            }
            return coef, pred, [[float(k), float(v)] for k, v in zip(knots, seconds)]
        _, knee, coef, pred = _roofline(measurement, out, per, active, step=name == "gemm_step", call=call)
        coef = {
            **coef,
            "c_gemm": coef.get("c_gemm", 0.0),
            "c_call": coef.get("c_call", 0.0),
            "c_weights": coef["c_tok"] * knee if knee > per.min() else 0.0,
            "knee_tokens_per_expert": knee,
        }
        return coef, pred, []

    folds = cv_folds(fitted, per, active)
    # the columns each form fits; a form is tried where every fold's fit has as many points
    columns = {"roofline": 2 + call, "gemm_step": 3 + call, "table": 1 + knots.size + call}
    least = int(fitted.sum()) - max((int(f.sum()) for f in folds), default=0)
    tried = [
        name
        for name in ("roofline", "gemm_step", "table")
        if (name != "gemm_step" or eligible) and (name != "table" or knots.size >= 3) and columns[name] <= least
    ]
    if "roofline" not in tried:  # too few points to cross-validate even the roofline: fit it alone
        tried, folds = ["roofline"], []
    # name -> (coefficients, predictions, table), fitted on every fitted point
    forms = {name: fit_form(name, held) for name in tried}
    cv: Dict[str, Dict[str, Optional[float]]] = {}
    cv_rel: Dict[str, np.ndarray] = {}
    for name in tried:
        rel = np.concatenate([((fit_form(name, held | f)[1] - measured) / measured)[f] for f in folds] or [[]])
        cv_rel[name] = rel
        cv[name] = {
            "rms_rel_error": float(np.sqrt(np.mean(rel**2))) if rel.size else None,
            "max_rel_error": float(np.abs(rel).max()) if rel.size else None,
        }
    committed = choose_form(tried, cv_rel)
    coef, pred, table = forms[committed]
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
    elif not eligible:
        notes.append(
            "no GEMM step fitted: the fitted points do not have experts on both sides of 2 tokens (c_gemm = 0)"
        )
    if committed == "table":
        notes.append(
            "expert table committed (its knots carry the GEMM step, c_gemm = 0): "
            + ", ".join(f"{k:g} tokens {v:.3g} s" for k, v in table)
            + " per expert and pass beyond the roofline"
        )
    if folds:
        notes.append(
            f"committed: the {committed} form, the least cross-validated error ({len(folds)} folds of the fitted "
            "points; RMS relative error "
            + ", ".join(f"{n} {c['rms_rel_error']:.1%}" for n, c in cv.items() if c["rms_rel_error"] is not None)
            + ")"
        )
    untried = [n for n in ("gemm_step", "table") if n not in tried and (n != "gemm_step" or eligible)]
    if untried:
        notes.append(
            f"not tried: {', '.join(untried)} (more parameters than a cross-validation fold's fit has points: "
            "measure more points)"
        )
    if call:
        notes.append(f"kernel call c_call = {coef['c_call']:.3g} s per call and pass, whatever its experts")
    else:
        notes.append(
            "no call cost fitted: the fitted points have one active count, where c_call and c_exp are "
            "one column (c_call = 0)"
        )
    extra = forward_figures(measurement)
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
    extra["cross_validation"] = {"folds": len(folds), "chosen": committed, "forms": cv}
    if len(forms) > 1:
        own = max_abs((pred - measured) / measured, held)
        alternatives = {}
        for name, (o_coef, o_pred, o_table) in forms.items():
            if name == committed:
                continue
            rel = (o_pred - measured) / measured
            alternatives[name] = {
                "formula": _FORMULAS[name],
                "coefficients": o_coef,
                "expert_table": o_table,
                "predicted_s": o_pred.tolist(),
                "max_rel_error": max_abs(rel, held),
                "max_rel_error_fit": max_abs(rel, ~held),
                "cv_rms_rel_error": cv[name]["rms_rel_error"],
                "priced": False,
            }
            if alternatives[name]["max_rel_error"] is not None and own is not None:
                notes.append(
                    f"{_AS_ALTERNATIVE[name]} the held-out max rel. error would be "
                    f"{alternatives[name]['max_rel_error']:.1%} instead of {own:.1%} "
                    f"(alternative_forms.{name})"
                )
        extra["alternative_forms"] = alternatives
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
