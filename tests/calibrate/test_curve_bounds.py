"""`routepack.calibrate.curve_bounds`: the bounds are exact, and no fit of the expert kernel
beats them."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from routepack.calibrate.curve_bounds import (
    call_curve_bound,
    call_curve_feasible,
    convex_bound,
    curve_bound,
    monotone_bound,
)
from routepack.calibrate.fit.common import COMPUTE_PASSES
from routepack.calibrate.fit.expert_gemm import (
    fit_expert_gemm,
)
from synthetic import MODEL, SWEEPS, step_measurement


@settings(max_examples=40, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.floats(0.0, 1e-3), st.floats(1.0, 4096.0)), min_size=1, max_size=4),
    c=st.floats(1e-6, 1e-1),
)
def test_convex_timings_have_no_convexity_bound(pieces, c):
    t = np.array(SWEEPS.tokens_per_expert, dtype=np.float64)
    m = c + sum(s * np.maximum(t - k, 0.0) for s, k in pieces)  # convex in t
    assert convex_bound(t, m) <= 1e-9


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), dip=st.floats(0.3, 1.0))
def test_no_fit_of_the_convex_form_beats_the_convexity_bound(seed, dip):
    """On any timings (here: the step form, noisy, with the 1-token points scaled by ``dip``),
    the roofline without the step misses some point by at least `convex_bound` (its curve is
    convex in t), and the committed step form, which is not convex, fits the fitted points no
    worse in least squares."""
    rng = np.random.default_rng(seed)
    m = step_measurement(2e-6, 1e-4, 8.0, 2e-4)
    m["measured_s"] = [
        v * (dip if p["tokens_per_expert"] == 1 else 1.0) * (1 + 0.05 * rng.uniform(-1, 1))
        for v, p in zip(m["measured_s"], m["sweep"])
    ]
    fit = fit_expert_gemm(m, 3, MODEL)
    roof = fit.extra["alternative_forms"]["roofline"]
    assert max(roof["max_rel_error"], roof["max_rel_error_fit"]) >= fit.extra["convex_bound"] - 1e-9
    assert fit.extra["convex_bound"] >= 0
    # the step form nests the roofline (c_gemm = 0), so its least squares on the fitted points is no larger
    fitted = ~np.array(fit.held_out)
    meas = np.array(fit.measured_s)
    sq = lambda pred: float(np.sum(((np.array(pred) - meas) / meas)[fitted] ** 2))  # noqa: E731
    assert sq(fit.predicted_s) <= sq(roof["predicted_s"]) * (1 + 1e-9) + 1e-18


@settings(max_examples=40, deadline=None)
@given(m=st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=24), seed=st.integers(0, 2**31))
@example(m=[1.0000000000000002e-06, 1e-06], seed=0)  # one ulp apart (a CI draw)
def test_the_monotone_bound_is_exact(m, seed):
    """`monotone_bound` is 0 on non-decreasing timings and otherwise met by the best
    non-decreasing curve: the running max of m·(1 − e) never overshoots m·(1 + e)."""
    x = np.arange(1.0, len(m) + 1)
    y = np.array(m)
    assert monotone_bound(x, np.sort(y)) == 0.0
    e = monotone_bound(x, y)
    g = np.maximum.accumulate(y * (1 - e))  # the least non-decreasing curve above every lower end
    assert np.all(g <= y * (1 + e) * (1 + 1e-9))
    # and no smaller error works: the same curve at e·(1 − 1e-3) overshoots somewhere (where e is
    # above rounding: two timings one ulp apart give e ~ 1e-16, which no float shrink resolves)
    if e > 1e-6:
        e2 = e * (1 - 1e-3)
        assert np.any(np.maximum.accumulate(y * (1 - e2)) > y * (1 + e2))
    rng = np.random.default_rng(seed)
    fit_input = step_measurement(2e-6, 1e-4, 8.0, 2e-4)
    fit_input["measured_s"] = [v * (1 + 0.2 * rng.uniform(-1, 1)) for v in fit_input["measured_s"]]
    fit = fit_expert_gemm(fit_input, 3, MODEL)
    # the committed curve is non-decreasing in tokens, so it misses some point by the bound
    assert max(fit.max_rel_error, fit.max_rel_error_fit) >= fit.extra["monotone_bound"] - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    points=st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 8, 64]), st.sampled_from([1, 2, 4, 8]), st.floats(1e-6, 1.0)),
        min_size=1,
        max_size=30,
    ),
    seed=st.integers(0, 2**31),
)
@example(points=[(2, 1, 1.0000000000000002e-06), (2, 1, 1e-06)], seed=0)
def test_the_curve_bound_is_exact_and_bounds_every_fit(points, seed):
    """`curve_bound` is met by a curve a·f(t), f non-decreasing (the running max of the
    per-expert times' lower ends, per distinct t), no smaller error is, and every fit of the
    expert GEMM (both forms) misses some point by at least it and by at least `monotone_bound`."""
    t, a, m = (np.array(c, dtype=np.float64) for c in zip(*points))
    e = curve_bound(t, a, m)
    p = m / (COMPUTE_PASSES * a)

    def feasible(err: float, slack: float) -> bool:
        ts = np.unique(t)
        f = np.maximum.accumulate([float((p[t == v] * (1 - err)).max()) for v in ts])
        return all(np.all(f[k] <= p[t == v] * (1 + err) * (1 + slack)) for k, v in enumerate(ts))

    assert feasible(e, 1e-9)
    if e > 1e-6:  # no smaller error works (above rounding: see test_the_monotone_bound_is_exact)
        assert not feasible(e * (1 - 1e-3), 0.0)
    # times of one active count, non-decreasing in distinct t, meet no bound
    assert curve_bound(np.arange(1.0, len(m) + 1), np.full(len(m), 2.0), np.sort(m)) == 0.0
    rng = np.random.default_rng(seed)
    fit_input = step_measurement(2e-6, 1e-4, 8.0, 2e-4)
    fit_input["measured_s"] = [v * (1 + 0.2 * rng.uniform(-1, 1)) for v in fit_input["measured_s"]]
    fit = fit_expert_gemm(fit_input, 3, MODEL)
    assert fit.extra["curve_bound"] >= fit.extra["monotone_bound"] - 1e-12
    # the fits price a call too, so what bounds them is the call's curve bound, never above
    bound = fit.extra["call_curve_bound"]
    assert bound <= fit.extra["curve_bound"] + 1e-7
    for pred in [fit.predicted_s] + [f["predicted_s"] for f in fit.extra["alternative_forms"].values()]:
        meas = np.array(fit.measured_s)
        assert np.abs((np.array(pred) - meas) / meas).max() >= bound - 1e-6


@settings(max_examples=40, deadline=None)
@given(
    points=st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 8, 64]), st.sampled_from([1, 2, 4, 8]), st.floats(1e-6, 1.0)),
        min_size=1,
        max_size=30,
    )
)
@example(points=[(2, 1, 1.0000000000000002e-06), (2, 1, 1e-06)])
def test_the_call_curve_bound_is_exact(points):
    """`call_curve_bound` e is met by a curve c + a·f(t), c >= 0 and f >= 0 non-decreasing
    (c from `call_curve_feasible`, f the running max of the lower ends), no smaller error is
    (above rounding), and it is never above `curve_bound` (c = 0 is one such curve)."""
    t, a, m = (np.array(c, dtype=np.float64) for c in zip(*points))
    e = call_curve_bound(t, a, m)
    assert e <= curve_bound(t, a, m) + 1e-7
    c = call_curve_feasible(t, a, m, e)
    assert c is not None and c >= 0
    ts = np.unique(t)
    lo = np.maximum((m * (1 - e) - c) / a, 0.0)
    f = np.maximum.accumulate([float(lo[t == v].max()) for v in ts])
    got = c + a * f[np.searchsorted(ts, t)]
    assert np.all(np.abs(got - m) <= (e + 1e-6) * m)
    if e > 1e-5:
        assert call_curve_feasible(t, a, m, e * (1 - 1e-3) - 1e-7) is None
