"""What bounds every fit of a kind's form, whatever its coefficients: the least max relative
error over a sweep's points that any curve of a class can reach (convex, non-decreasing, the
cost model's expert curves with and without a call's cost). The expert fit
(`routepack.calibrate.fit.fit_expert_gemm`) reports them beside its own error, so a reader
can tell what the form costs from what the timings' noise does.

Every bound is of relative errors, so it does not change when all times are scaled: the
times may be per pass or, as measured, of all passes (a point's ``measured`` seconds), and the
curves below are written in those units (``c + a·f(t)``: the cost model's ``3·(c_call +
a·f(t))`` with the 3 folded into c and f).
"""

from __future__ import annotations

from typing import Optional

import numpy as np


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
        xk, mk = x[None, j + 1 :], m[None, j + 1 :]
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
        later = m[i + 1 :][x[i + 1 :] > x[i]]
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
    share f(t)) needs p_i (1 − e) <= p_j (1 + e) for the per-expert times p = m / a:
    e >= (p_i − p_j) / (p_i + p_j); the largest over all pairs. Exact: f(t) = the largest
    p_i (1 − e) over t_i <= t meets it. Unlike `monotone_bound` it also counts the spread
    between active counts, so it bounds what any form without the call, tabulated or not, can
    reach."""
    t = np.asarray(tokens, dtype=np.float64)
    p = np.asarray(measured, dtype=np.float64) / np.asarray(active, dtype=np.float64)
    o = np.argsort(t, kind="stable")
    t, p = t[o], p[o]
    best = 0.0
    for i in range(len(t)):
        later = p[t >= t[i]]  # t sorted: every j with t_j >= t_i, i itself included (gives 0)
        best = max(best, float((p[i] - later.min()) / (p[i] + later.min())))
    return best


def call_curve_feasible(tokens: np.ndarray, active: np.ndarray, measured: np.ndarray, error: float) -> Optional[float]:
    """The least call time c >= 0 (in ``measured``'s units: all passes) for which some curve
    c + a·f(t), f >= 0 non-decreasing in t, is within ``error`` (relative) of every point, or
    None where none is: float ``tokens``
    ``[n]``, ``active`` ``[n]`` (> 0), ``measured`` ``[n]`` (> 0). With each point within e,
    f(t_i) lies in [(L_i − c)/a_i, (U_i − c)/a_i], L, U = m·(1 ∓ e), and f(t_i) >= 0 needs
    c <= U_i; a non-decreasing f through those intervals exists exactly when every pair with
    t_i <= t_j has (L_i − c)/a_i <= (U_j − c)/a_j (then f(t) = the largest lower end at or
    below t meets them), a condition linear in c: c·(1/a_j − 1/a_i) <= U_j/a_j − L_i/a_i. So
    the feasible c form an interval, and its lower end is returned."""
    t = np.asarray(tokens, dtype=np.float64)
    a = np.asarray(active, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    lo, hi = m * (1.0 - error), m * (1.0 + error)
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
    ``measured`` ``[n]`` (> 0). Every such curve prices a point as c + a·f(t), c >= 0 (the
    call, all passes) and f >= 0 non-decreasing in t (`GEMM_STEP_FORMULA`, `ROOFLINE_FORMULA`,
    `TABLE_FORMULA` of `routepack.calibrate.fit`, whose table and line are non-decreasing
    together only where the timings are; the bound is of the non-decreasing curves); whether
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
