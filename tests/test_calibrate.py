"""`routepack.calibrate`: the fit recovers the coefficients timings were made from, the report
has the structure the issue asks for, and a real ``--quick`` run on CPU writes a cost model
`CostModel.load` reads. The fit and report tests need no torch; the real runs skip without it.
No assertion is on a measured time (the machine is shared): only on structure and on
synthetic data."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.fit import (
    COMPUTE_PASSES,
    FITS,
    ROOFLINE_FORMULA,
    fit_attention,
    fit_expert_gemm,
    fit_links,
    holdout_mask,
    nnls_relative,
    to_cost_model,
)
from routepack.calibrate.report import build, write_json
from routepack.calibrate.sweeps import Sweeps, log_points

PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
MODEL = rp.traces.profile("tiny").model()
SWEEPS = Sweeps.default("cpu")


# ------------------------------------------------------------------ synthetic timings
def expert_measurement(c_tok: float, c_exp: float, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sweep = [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in SWEEPS.expert_grid()]
    true = [COMPUTE_PASSES * (c_tok * p["tokens"] + c_exp * p["active_experts"]) for p in sweep]
    measured = [v * (1 + noise * rng.uniform(-1, 1)) for v in true]
    return {"sweep": sweep, "measured_s": measured, "forward_s": [m / 3 for m in measured]}


def attention_measurement(a_lin: float, a_quad: float, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sweep = [{"length": n} for n in SWEEPS.lengths]
    measured = [
        COMPUTE_PASSES * (a_lin * n + a_quad * n * n) * (1 + noise * rng.uniform(-1, 1)) for n in SWEEPS.lengths
    ]
    return {"sweep": sweep, "measured_s": measured, "forward_s": measured, "heads": 16, "head_dim": 128}


def links_measurement(lat: float, bw_p2p: float, bw_a2a: float, bw_ar: float = 0.0) -> dict:
    """Timings of the links' ops (the all-reduce's where ``bw_ar`` is given; reports before
    it have none)."""
    sweep, measured = [], []
    for op, bw in (("p2p", bw_p2p), ("all_to_all", bw_a2a)) + ((("all_reduce", bw_ar),) if bw_ar else ()):
        for b in SWEEPS.message_bytes:
            sweep.append({"op": op, "bytes": b})
            measured.append(lat + b / bw)
    return {"sweep": sweep, "measured_s": measured, "ranks": 2, "backend": "gloo"}


def synthetic_fits() -> dict:
    return {
        "expert_gemm": fit_expert_gemm(expert_measurement(1e-6, 2e-4), 3, MODEL),
        "attention": fit_attention(attention_measurement(5e-5, 1e-9), 3, MODEL),
        "links": fit_links(links_measurement(1e-4, 2e9, 1e9, 5e8), 3, MODEL),
    }


positive = st.floats(1e-10, 1e-2, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(c_tok=positive, c_exp=st.one_of(st.just(0.0), positive), every=st.integers(2, 6))
def test_the_expert_fit_recovers_its_coefficients(c_tok, c_exp, every):
    fit = fit_expert_gemm(expert_measurement(c_tok, c_exp), every, MODEL)
    assert fit.coefficients["c_tok"] == pytest.approx(c_tok, rel=1e-6)
    assert fit.coefficients["c_exp"] == pytest.approx(c_exp, rel=1e-6, abs=1e-9 * c_tok)
    assert fit.max_rel_error < 1e-6 and fit.max_rel_error_fit < 1e-6
    # linear timings: no floor, no GEMM step (the step buys nothing: the roofline is committed),
    # no table and no call cost
    assert set(fit.cost_fields) == {"c_tok", "c_exp", "c_weights", "c_gemm", "c_call", "expert_table"}
    assert fit.cost_fields["expert_table"] == []
    assert fit.cost_fields["c_call"] == pytest.approx(0.0, abs=1e-6 * (c_exp + c_tok))
    assert fit.cost_fields["c_tok"] == fit.coefficients["c_tok"] and fit.cost_fields["c_weights"] == 0.0
    assert fit.formula == ROOFLINE_FORMULA and fit.cost_fields["c_gemm"] == 0.0
    assert fit.extra["forward_share"] == pytest.approx(1 / 3)


@settings(max_examples=60, deadline=None)
@given(a_lin=positive, a_quad=st.one_of(st.just(0.0), positive), every=st.integers(2, 4))
def test_the_attention_fit_recovers_its_coefficients_and_zeroes_linear_layers(a_lin, a_quad, every):
    fit = fit_attention(attention_measurement(a_lin, a_quad), every, MODEL)
    scale = a_lin / SWEEPS.lengths[-1]  # a_quad's size below which it cannot be seen
    assert fit.coefficients["a_lin"] == pytest.approx(a_lin, rel=1e-5)
    assert fit.coefficients["a_quad"] == pytest.approx(a_quad, rel=1e-5, abs=1e-6 * scale)
    assert fit.max_rel_error < 1e-6
    aq = fit.cost_fields["a_quad"]
    assert len(aq) == MODEL.num_layers
    assert all(v == 0.0 for v, kind in zip(aq, MODEL.attention) if kind == "linear")
    assert all(v == fit.coefficients["a_quad"] for v, kind in zip(aq, MODEL.attention) if kind == "full")


@settings(max_examples=40, deadline=None)
@given(lat=st.floats(1e-7, 1e-3), bw_p2p=st.floats(1e7, 1e12), bw_a2a=st.floats(1e7, 1e12))
def test_the_links_fit_recovers_bandwidth_and_latency_per_op(lat, bw_p2p, bw_a2a):
    fit = fit_links(links_measurement(lat, bw_p2p, bw_a2a, bw_a2a / 3), 3, MODEL)
    assert fit.coefficients["bw_p2p"] == pytest.approx(bw_p2p, rel=1e-5)
    assert fit.coefficients["bw_all_to_all"] == pytest.approx(bw_a2a, rel=1e-5)
    assert fit.coefficients["bw_all_reduce"] == pytest.approx(bw_a2a / 3, rel=1e-5)
    assert fit.coefficients["latency_all_to_all_s"] == pytest.approx(lat, rel=1e-4, abs=1e-12)
    # two ranks: a ring sends 2·(2−1)/2 = all of the buffer from each rank
    assert fit.cost_fields == {
        "bw_intra": fit.coefficients["bw_all_to_all"],
        "a2a_latency": fit.coefficients["latency_all_to_all_s"],
        "bw_reduce": fit.coefficients["bw_all_reduce"],
    }
    before = fit_links(links_measurement(lat, bw_p2p, bw_a2a), 3, MODEL)  # a report without the all-reduce
    assert "bw_reduce" not in before.cost_fields and "bw_all_reduce" not in before.coefficients
    for op in ("p2p", "all_to_all", "all_reduce"):  # each op has held-out points of its own
        assert any(h for h, p in zip(fit.held_out, fit.sweep) if p["op"] == op)


@settings(max_examples=40, deadline=None)
@given(noise=st.floats(0.001, 0.05), seed=st.integers(0, 2**31))
def test_on_noisy_timings_the_held_out_error_stays_near_the_noise(noise, seed):
    fit = fit_expert_gemm(expert_measurement(1e-6, 1e-4, noise, seed), 3, MODEL)
    # the fit is at most as far from the noisy points as the truth plus the noise: 2·noise (+ slack)
    assert fit.max_rel_error <= 2.2 * noise + 1e-9
    assert fit.coefficients["c_tok"] == pytest.approx(1e-6, rel=4 * noise)


def test_the_fit_keeps_coefficients_non_negative():
    x = np.stack([np.arange(1.0, 11.0), np.ones(10)], axis=1)
    y = 2.0 * x[:, 0] - 0.5  # the unconstrained intercept would be negative
    coef = nnls_relative(x, y)
    assert coef[1] == 0.0 and coef[0] > 0
    with pytest.raises(rp.RoutepackError, match="measured times"):
        nnls_relative(x, -y)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 200), every=st.integers(2, 10))
def test_holdout_mask_interpolates_every_kth_point(n, every):
    mask = holdout_mask(n, every)
    assert mask.shape == (n,)
    if n:
        assert not mask[0] and not mask[-1]
    held = np.flatnonzero(mask)
    assert all(i % every == every // 2 for i in held)
    assert len(held) >= (n - 2) // every - 1


def test_too_few_points_to_fit_is_an_error_naming_the_kernel():
    m = {"sweep": [{"length": 128}, {"length": 256}], "measured_s": [1.0, 2.0]}
    with pytest.raises(rp.RoutepackError, match="attention: 1 fitted points cannot determine 2"):
        fit_attention({"sweep": m["sweep"][:1], "measured_s": [1.0]}, 2, MODEL)
    with pytest.raises(rp.RoutepackError, match="attention: needs one measured time per sweep point"):
        fit_attention({"sweep": m["sweep"], "measured_s": [1.0]}, 3, MODEL)


# ------------------------------------------------------------------ the cost model
def test_to_cost_model_sets_the_fitted_fields_and_keeps_the_rest_from_the_preset():
    fits = synthetic_fits()
    cost, sources = to_cost_model(MODEL, fits)
    preset = rp.CostModel.from_model(MODEL, rp.Hardware.h200())
    assert cost.c_tok == fits["expert_gemm"].coefficients["c_tok"]
    assert cost.c_gemm == fits["expert_gemm"].cost_fields["c_gemm"] and sources["c_gemm"] == "measured: expert_gemm"
    assert cost.bw_intra == fits["links"].coefficients["bw_all_to_all"]
    assert cost.bw_reduce == fits["links"].coefficients["bw_all_reduce"] and sources["bw_reduce"] == "measured: links"
    assert cost.a_quad == fits["attention"].cost_fields["a_quad"]
    for name in (
        "token_bytes",
        "expert_weight_bytes",
        "expert_grad_bytes",
        "expert_state_bytes",
        "bw_inter",
        "expert_groups",
    ):
        assert getattr(cost, name) == getattr(preset, name)
    assert sources["c_tok"] == "measured: expert_gemm" and sources["bw_inter"] == "preset h200"
    assert sources["token_bytes"] == "model shape"
    assert cost.num_experts == preset.num_experts == MODEL.num_experts
    given_inter, src = to_cost_model(MODEL, fits, bw_inter=12.5e9)
    assert given_inter.bw_inter == 12.5e9 and src["bw_inter"].startswith("given")
    partial, src = to_cost_model(MODEL, {"expert_gemm": fits["expert_gemm"]})
    assert partial.a_lin == preset.a_lin and src["a_lin"] == "preset h200"
    assert set(FITS) == {"expert_gemm", "attention", "links"}


def _report(fits: dict) -> dict:
    cost, sources = to_cost_model(MODEL, fits)
    return build(
        fits=fits,
        cost=cost,
        preset=rp.CostModel.from_model(MODEL, rp.Hardware.h200()),
        hardware=rp.Hardware.h200(),
        sources=sources,
        device={"device": "cpu", "threads": 1},
        settings={},
        model={"hidden": MODEL.hidden, "expert_ffn": MODEL.expert_ffn},
        profile="tiny",
        skipped={},
        elapsed_s=1.0,
        version=rp.__version__,
    )


def check_report(rep: dict, kinds=("expert_gemm", "attention", "links")) -> None:
    """The structure the issue asks for: ``kernels`` maps each kind to its sweep, measured and
    predicted times and the held-out max relative error, plus device/torch/thread info."""
    for key in ("kernels", "cost_model", "preset", "sources", "device", "settings", "model"):
        assert key in rep, key
    assert set(kinds) <= set(rep["kernels"])
    for kind in kinds:
        k = rep["kernels"][kind]
        n = len(k["sweep"])
        assert n > 0 and len(k["measured_s"]) == len(k["predicted_s"]) == len(k["held_out"]) == n
        assert k["held_out_points"] == sum(k["held_out"]) > 0
        assert k["max_rel_error"] == pytest.approx(max(abs(e) for e, h in zip(k["rel_error"], k["held_out"]) if h))
        assert k["coefficients"] and k["formula"]
    rp.CostModel.from_json(json.dumps(rep["cost_model"]))
    json.dumps(rep, allow_nan=False)


def test_report_structure_and_json(tmp_path):
    rep = _report(synthetic_fits())
    check_report(rep)
    assert rep["preset"]["ratio"]["token_bytes"] == 1.0
    path = write_json(rep, tmp_path / "r.json")
    assert json.loads(path.read_text())["kernels"].keys() == rep["kernels"].keys()


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_the_figure_is_a_png(tmp_path):
    from routepack.calibrate.report import plot

    path = plot(_report(synthetic_fits()), tmp_path / "f.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 10),
    warmup=st.integers(0, 3),
    repeats=st.integers(1, 6),
    seed=st.integers(0, 99),
    visit_s=st.sampled_from([0.0, 0.004, 0.02, 0.1]),
    visit_calls=st.integers(1, 5),
)
def test_run_rounds_visits_every_point_each_round_and_polishes_the_visit_medians(
    n, warmup, repeats, seed, visit_s, visit_calls
):
    from routepack.calibrate.timing import polish, run_rounds

    rng = np.random.default_rng(seed)
    log, ticks = [], []

    def step(i):
        def f():
            v = float(rng.uniform(0.001, 0.03))
            log.append((i, v))
            return v, 2 * v

        return f

    got = run_rounds(
        [step(i) for i in range(n)],
        warmup,
        repeats,
        lambda: ticks.append(1),
        seed,
        visit_s=visit_s,
        visit_calls=visit_calls,
    )
    # the warm-up rounds: one call per point each, every point once a round
    warm = log[: warmup * n]
    assert all(sorted(i for i, _ in warm[r * n : (r + 1) * n]) == list(range(n)) for r in range(warmup))
    last = {i: v for i, v in warm}  # each point's last warm-up time sets its calls per visit

    def calls_for(v: float) -> int:
        return max(1, min(visit_calls, int(np.ceil(visit_s / v))))

    calls = [1 if i not in last else calls_for(last[i]) for i in range(n)]
    table = np.zeros((repeats, n, 2))
    pos = warmup * n
    for r in range(repeats):
        seen = []
        for _ in range(n):
            i = log[pos][0]
            vals = [v for j, v in log[pos : pos + calls[i]]]
            assert all(j == i for j, _ in log[pos : pos + calls[i]])  # a visit's calls are back to back
            table[r, i] = (np.median(vals), 2 * np.median(vals))
            seen.append(i)
            pos += len(vals)
            if len(vals) == 1:  # a point called once: its timed visit decides from then on
                calls[i] = calls_for(float(np.median(vals)))
        assert sorted(seen) == list(range(n))  # every point once a round
    assert got.calls == calls
    assert pos == len(log) and len(ticks) == n * repeats
    want = polish(table)
    assert np.allclose(got.figures, want.figures, rtol=1e-12)
    assert np.allclose(got.drift, want.drift, rtol=1e-12) and len(got.drift) == repeats
    assert np.allclose(got.spread, want.spread, rtol=1e-9, atol=1e-12)
    for i in range(n):  # a figure is the median of its visits with their round's factor divided out
        assert got.figures[i][0] == pytest.approx(float(np.median(table[:, i, 0] / want.drift)), rel=1e-12)
        assert got.spread[i] >= 0
    assert got.loadavg is None or got.loadavg[0] <= got.loadavg[1]


@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.sampled_from([0.001, 0.004, 0.05, 0.2]), min_size=1, max_size=8),
    repeats=st.integers(1, 4),
    short=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_run_rounds_gives_the_short_points_more_rounds(times, repeats, short, seed):
    """``short_repeats`` more rounds visit exactly the steps called more than once a visit."""
    from routepack.calibrate.timing import run_rounds

    visits = [0] * len(times)
    ticks = []

    def step(i):
        def f():
            visits[i] += 1
            return times[i], times[i] / 3

        return f

    got = run_rounds(
        [step(i) for i in range(len(times))],
        1,
        repeats,
        lambda: ticks.append(1),
        seed,
        visit_s=0.01,
        visit_calls=5,
        short_repeats=short,
    )
    want_calls = [min(5, int(np.ceil(0.01 / t))) for t in times]
    assert got.calls == want_calls
    is_short = [c > 1 for c in want_calls]
    extra = short if any(is_short) else 0
    assert visits == [1 + c * (repeats + (extra if s else 0)) for c, s in zip(want_calls, is_short)]
    assert len(ticks) == repeats * len(times) + extra * sum(is_short)
    assert len(got.drift) == repeats + extra
    assert np.allclose([f[0] for f in got.figures], times, rtol=1e-9)  # constant times: no drift
    assert np.allclose([f[1] for f in got.figures], np.array(times) / 3, rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(
    times=st.lists(st.sampled_from([0.001, 0.004, 0.05]), min_size=3, max_size=6),
    slow=st.data(),
    repeats=st.integers(1, 3),
    short=st.integers(1, 4),
    seed=st.integers(0, 99),
)
def test_a_slow_first_call_does_not_keep_a_short_point_out_of_the_short_rounds(times, slow, repeats, short, seed):
    """A step whose first call pays a one-off set-up (above ``visit_s``: the warm-up would call
    it once a visit) is called as its timed visits say from its second visit on, and the short
    rounds visit it when those are short."""
    from routepack.calibrate.timing import run_rounds

    first = slow.draw(st.integers(0, len(times) - 1))
    visits = [0] * len(times)

    def step(i):
        def f():
            visits[i] += 1
            t = 0.5 if (i == first and visits[i] == 1) else times[i]
            return t, t / 3

        return f

    got = run_rounds(
        [step(i) for i in range(len(times))], 1, repeats, seed=seed, visit_s=0.01, visit_calls=5, short_repeats=short
    )
    want = [min(5, int(np.ceil(0.01 / t))) for t in times]
    assert got.calls == want
    is_short = [c > 1 for c in want]
    extra = short if any(is_short) else 0
    # the slow step: its warm-up call, one call at its first timed visit, then `want` a visit
    rounds = [repeats + (extra if s else 0) for s in is_short]
    expect = [1 + c * r for c, r in zip(want, rounds)]
    expect[first] = 1 + 1 + want[first] * (rounds[first] - 1)
    assert visits == expect
    assert np.allclose([f[0] for f in got.figures], times, rtol=1e-9)


@settings(max_examples=80, deadline=None)
@given(
    true=st.lists(st.floats(1e-4, 1.0), min_size=3, max_size=10),
    drift=st.lists(st.floats(0.5, 2.0), min_size=2, max_size=9),
)
def test_polish_divides_out_a_factor_common_to_every_point_of_a_round(true, drift):
    """A machine that runs a whole round slower (or faster) moves no figure: every figure is
    its true time at the median round's speed, and the round factors are the drift."""
    from routepack.calibrate.timing import polish

    t, s = np.array(true), np.array(drift)
    level = float(np.exp(np.median(np.log(s))))
    got = polish((s[:, None] * t[None, :])[:, :, None] * np.array([1.0, 0.25])[None, None, :])
    assert np.allclose(got.figures[:, 0], t * level, rtol=1e-9)
    assert np.allclose(got.figures[:, 1], 0.25 * t * level, rtol=1e-9)  # every figure of a visit alike
    assert np.allclose(got.drift, s / level, rtol=1e-9)
    assert np.allclose(got.spread, 0.0, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    true=st.lists(st.floats(1e-3, 1.0), min_size=6, max_size=12), rounds=st.integers(5, 9), seed=st.integers(0, 2**31)
)
def test_polish_keeps_the_median_of_noisy_rounds(true, rounds, seed):
    """With no drift in the table, a slow visit of every point (a spell of interference, 3×)
    moves no figure off its true time by more than the visits' noise allows, and every figure
    stays between the point's visits. (Six points and five rounds or more: on a smaller table
    a median polish can take such spells for drift.)"""
    from routepack.calibrate.timing import polish

    rng = np.random.default_rng(seed)
    t = np.array(true)[None, :] * rng.uniform(0.95, 1.05, (rounds, len(true)))
    slow = rng.integers(0, rounds, len(true))
    t[slow, np.arange(len(true))] *= 3.0  # a spell of interference on one visit of each point
    got = polish(t[:, :, None])
    assert np.all(got.figures[:, 0] >= t.min(axis=0) * (1 - 1e-9))
    assert np.all(got.figures[:, 0] <= t.max(axis=0) * (1 + 1e-9))
    assert np.allclose(got.figures[:, 0], true, rtol=0.25)
    assert abs(float(np.median(np.log(got.drift)))) < 1e-9


def test_polish_of_one_round_or_one_point_and_bad_tables():
    from routepack.calibrate.timing import polish

    one_round = polish(np.array([[[2.0, 1.0], [4.0, 3.0]]]))
    assert one_round.figures.tolist() == [[2.0, 1.0], [4.0, 3.0]] and one_round.drift.tolist() == [1.0]
    one_point = polish(np.array([[[3.0]], [[1.0]], [[2.0]]]))
    assert one_point.figures.tolist() == [[2.0]] and one_point.drift.tolist() == [1.0, 1.0, 1.0]
    assert one_point.spread.tolist() == [1.0]
    with_zero = polish(np.array([[[0.0], [1.0], [1.0]], [[2.0], [3.0], [3.0]]]))  # a zero time: no logs, no drift
    assert with_zero.drift.tolist() == [1.0, 1.0]
    two = polish(np.array([[[1.0], [2.0]], [[3.0], [2.0]], [[1.0], [2.0]]]))  # two points: no drift read
    assert two.drift.tolist() == [1.0, 1.0, 1.0] and two.figures[:, 0].tolist() == [1.0, 2.0]
    # rounds that skip points (the short points' extra rounds): the second round ran at half
    # speed, the third visits one point and reads no drift; the centre is the median of the two
    nan = np.nan
    gaps = polish(np.array([[1.0, 2.0, 4.0, 8.0], [2.0, 4.0, 8.0, nan], [nan, 2.0, nan, nan]])[:, :, None])
    assert np.allclose(gaps.drift, [2**-0.5, 2**0.5, 1.0])
    assert np.allclose(gaps.figures[:, 0], 2**0.5 * np.array([1.0, 2.0, 4.0, 8.0]))
    # a lone full round and extra rounds of the short points only: the full round's drift is
    # read against the short points it shares with them, not from the long points' times
    mixed = np.array([[0.001] * 3 + [0.05] * 4] + [[0.001] * 3 + [nan] * 4] * 2)[:, :, None]
    assert np.allclose(polish(mixed).figures[:, 0], [0.001] * 3 + [0.05] * 4)
    assert np.allclose(polish(mixed).drift, 1.0)
    for bad in (
        np.zeros((0, 2, 1)),
        np.zeros((2, 0, 1)),
        np.zeros((2, 2)),
        np.ones((2, 2, 0)),
        np.array([[[1.0], [np.nan]], [[1.0], [np.nan]]]),
        np.array([[[1.0], [1.0]], [[np.nan], [np.nan]]]),
    ):
        with pytest.raises(rp.RoutepackError, match="times"):
            polish(bad)


# ------------------------------------------------------------------ sweeps and arguments
@settings(max_examples=60, deadline=None)
@given(lo=st.integers(1, 100), span=st.integers(0, 5000), per_octave=st.sampled_from([0.5, 1.0, 2.0, 3.0]))
def test_log_points_are_increasing_and_span_the_range(lo, span, per_octave):
    pts = log_points(lo, lo + span, per_octave)
    assert pts[0] == lo and pts[-1] == lo + span
    assert list(pts) == sorted(set(pts))


@pytest.mark.parametrize("device,quick", [("cpu", True), ("cpu", False), ("cuda", False)])
def test_default_sweeps_cap_the_expert_grid(device, quick):
    s = Sweeps.default(device, quick)
    assert all(a * t <= s.max_tokens for a, t in s.expert_grid())
    assert len(s.active_experts) >= 2 and s.tokens_per_expert[0] == 1
    assert s.points == len(s.expert_grid()) + len(s.lengths)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lengths=()), "sweeps.lengths: needs at least one point"),
        (dict(lengths=(64, 32)), "sweeps.lengths: must be increasing"),
        (dict(holdout_every=1), "sweeps.holdout_every: must be >= 2"),
        (dict(max_tokens=0), "sweeps.max_tokens: must be >= 1"),
        (dict(repeats=0), "sweeps.repeats: must be >= 1"),
        (dict(visit_s=-0.1), "sweeps.visit_s: must be finite and >= 0"),
        (dict(visit_s=float("nan")), "sweeps.visit_s: must be finite"),
        (dict(visit_calls=0), "sweeps.visit_calls: must be >= 1"),
    ],
)
def test_bad_sweeps_name_the_argument(kwargs, match):
    base = dict(tokens_per_expert=(1, 2), active_experts=(1,), max_tokens=8, lengths=(8, 16), message_bytes=(4,))
    with pytest.raises(rp.RoutepackError, match=match):
        Sweeps(**{**base, **kwargs})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(device="tpu"), "device: expected 'cpu' or 'cuda', got 'tpu'"),
        (dict(kernels=["softmax"]), "kernels: 'softmax' is not one of"),
        (dict(kernels=[]), "kernels: needs at least one"),
        (dict(hidden=0), "hidden: must be >= 1"),
        (dict(ranks=1), "ranks: must be >= 2"),
        (dict(bw_inter=-1.0), "bw_inter"),
        (dict(dtype="int8"), "dtype: expected one of"),
        (dict(links_clock="tsc"), "links_clock: expected 'wall'"),
        (dict(links_clock="cpu", device="cuda"), "links_clock: .* got 'cpu' on cuda"),
    ],
)
def test_bad_arguments_are_routepack_errors(kwargs, match):
    if kwargs.get("dtype") and not HAS_TORCH:
        pytest.skip("dtype is checked once torch is imported")
    with pytest.raises(rp.RoutepackError, match=match):
        rp.calibrate("tiny", quick=True, **kwargs)
    with pytest.raises(rp.RoutepackError, match="profile: unknown profile 'huge'"):
        rp.calibrate("huge")


def test_exported_and_torch_free_until_called():
    assert "calibrate" in rp.__all__ and "Calibration" in rp.__all__
    code = (
        "import sys; sys.modules['torch'] = None; import routepack as rp\n"
        "try:\n rp.calibrate('tiny', quick=True)\nexcept ImportError as e:\n print(e)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=PYTHON_DIR),
    )
    assert "routepack.calibrate needs PyTorch >= 2.1: pip install 'routepack[torch]'" in r.stdout, r.stderr


def _cli(args, cwd: Path, hide_torch: bool = False) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        + ("sys.modules['torch'] = None\n" if hide_torch else "")
        + "from routepack.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_without_torch_is_one_line(tmp_path):
    proc = _cli(["calibrate", "--quick"], tmp_path, hide_torch=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "routepack calibrate: error: routepack.calibrate needs PyTorch >= 2.1: pip install 'routepack[torch]'"
    ]


def test_cli_refuses_an_unwritable_out_before_measuring(tmp_path):
    proc = _cli(["calibrate", "--quick", "--out", "no/such/dir/c.json"], tmp_path)
    assert proc.returncode == 2 and "--out no/such/dir/c.json: directory" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ a real run
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_quick_cpu_run_writes_a_loadable_cost_model(tmp_path):
    """``routepack calibrate --quick`` with tiny shapes, as a user runs it (about 15 s here)."""
    proc = _cli(
        [
            "calibrate",
            "--profile",
            "tiny",
            "--quick",
            "--hidden",
            "128",
            "--expert-ffn",
            "64",
            "--threads",
            "1",
            "--out",
            "cost.json",
            "--report",
            "report.json",
            "--plot",
            "fit.png",
            "--quiet",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for text in ("expert_gemm", "attention", "links", "max rel. error (held out)", "bw_inter: preset h200"):
        assert text in proc.stdout, text
    cost = rp.CostModel.load(tmp_path / "cost.json")
    rep = json.loads((tmp_path / "report.json").read_text())
    check_report(rep)
    assert rep["model"]["hidden"] == 128 and rep["device"]["threads"] == 1 and rep["device"]["torch"]
    assert rp.CostModel.from_json(json.dumps(rep["cost_model"])) == cost
    assert cost.c_tok == rep["kernels"]["expert_gemm"]["coefficients"]["c_tok"]
    assert cost.bw_intra == rep["kernels"]["links"]["coefficients"]["bw_all_to_all"]
    assert cost.bw_reduce == rep["kernels"]["links"]["coefficients"]["bw_all_reduce"]  # two ranks: the whole buffer
    assert cost.num_layers == MODEL.num_layers
    if HAS_MPL:
        assert (tmp_path / "fit.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_api_run_of_one_kernel_keeps_the_rest_from_the_preset():
    sweeps = Sweeps(
        tokens_per_expert=(1, 4, 16, 64),
        active_experts=(1, 2),
        max_tokens=128,
        lengths=(8, 16),
        message_bytes=(4096,),
        warmup=0,
        repeats=1,
    )
    cal = rp.calibrate("tiny", hidden=64, expert_ffn=32, sweeps=sweeps, kernels=["expert_gemm"], progress=False)
    preset = rp.CostModel.from_model(replace(MODEL, hidden=64, expert_ffn=32), rp.Hardware.h200())
    assert set(cal.report["kernels"]) == {"expert_gemm"}
    assert cal.cost.a_lin == preset.a_lin and cal.cost.bw_intra == preset.bw_intra
    assert cal.report["skipped"]["links"] == "not requested"
    assert cal.report["sources"]["c_tok"] == "measured: expert_gemm"
