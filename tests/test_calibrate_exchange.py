"""The exchange calibration: one `EPMoE` layer between local processes, its time outside the
expert kernel (`routepack.calibrate.exchange`), fitted beyond what the links and the origin
work price (`routepack.calibrate.fit.fit_exchange`, `fit_all`)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate import ALL_KERNELS, KERNELS, refit
from routepack.calibrate.fit import (
    COMPUTE_PASSES,
    LAYER_ALL_TO_ALLS,
    fit_all,
    fit_exchange,
    nnls_relative,
    to_cost_model,
)
from routepack.calibrate.report import build
from routepack.calibrate.exchange import ROUTINGS
from routepack.calibrate.sweeps import Sweeps
from routepack.errors import RoutepackError
from test_calibrate import MODEL, SWEEPS, attention_measurement, check_report, links_measurement

HAS_TORCH = importlib.util.find_spec("torch") is not None


def priced_model(bw: float = 1e9, a_lin: float = 1e-6, latency: float = 1e-4) -> rp.CostModel:
    return replace(rp.CostModel.from_model(MODEL, rp.Hardware.h200()), bw_intra=bw, a_lin=a_lin, a2a_latency=latency)


def exchange_measurement(
    priced: rp.CostModel, lat: float, extra: float, bw: float = 4e9, noise: float = 0.0, seed: int = 0
) -> dict:
    """What the layer would measure if the cost model's exchange were exact (top-2 on two
    ranks: 0, t or 2t rows leave a rank of t tokens, by routing); ``bw`` 0 for bytes that
    cost nothing of their own."""
    rng = np.random.default_rng(seed)
    sweep, measured = [], []
    for t in SWEEPS.exchange_tokens:
        for rows, routing in zip((0, t, 2 * t), ("local", "uniform", "remote")):
            remote = rows * priced.token_bytes
            sweep.append(
                {"tokens": t, "routing": routing, "routed": 2 * t, "remote_rows": rows, "remote_bytes": remote}
            )
            true = (
                LAYER_ALL_TO_ALLS * (lat + (remote / bw if bw else 0.0)) + COMPUTE_PASSES * (priced.a_lin + extra) * t
            )
            measured.append(true * (1 + noise * rng.uniform(-1, 1)))
    return {
        "sweep": sweep,
        "measured_s": measured,
        "layer_s": [2 * m for m in measured],
        "kernel_s": measured,
        "ranks": 2,
        "backend": "gloo",
        "clock": "cpu",
    }


@settings(max_examples=60, deadline=None)
@given(lat=st.floats(1e-6, 1e-2), extra=st.floats(1e-9, 1e-5), bw=st.floats(1e8, 1e11))
def test_the_exchange_fit_recovers_the_latency_the_bandwidth_and_the_extra_token_work(lat, extra, bw):
    priced = priced_model(bw=1e9)
    fit = fit_exchange(exchange_measurement(priced, lat, extra, bw), 3, MODEL, priced)
    assert fit.coefficients["a2a_latency"] == pytest.approx(lat, rel=1e-5)
    assert fit.coefficients["bw_intra"] == pytest.approx(bw, rel=1e-4)
    assert fit.coefficients["a_lin_extra"] == pytest.approx(extra, rel=1e-4, abs=1e-12)
    assert fit.cost_fields == {
        "a2a_latency": fit.coefficients["a2a_latency"],
        "bw_intra": fit.coefficients["bw_intra"],
        "a_lin": priced.a_lin + fit.coefficients["a_lin_extra"],
    }
    assert fit.max_rel_error == pytest.approx(0.0, abs=1e-6)
    # the held-out points are the uniformly routed ones: interpolated between the extremes
    assert {p["routing"] for p, h in zip(fit.sweep, fit.held_out) if h} == {"uniform"}
    # what the other kinds priced (the links' latency and bandwidth) is reported beside the fit
    charged = np.array(fit.extra["priced_before_s"])
    assert fit.extra["max_rel_error_before"] == pytest.approx(
        float(np.max(np.abs(charged / np.array(fit.measured_s) - 1)))
    )


def test_bytes_that_cost_nothing_of_their_own_keep_the_links_bandwidth():
    priced = priced_model(bw=1e9, a_lin=1e-6, latency=1e-4)
    fit = fit_exchange(exchange_measurement(priced, 5e-4, 2e-6, bw=0.0), 3, MODEL, priced)
    assert fit.cost_fields["bw_intra"] == priced.bw_intra
    assert "the links'" in fit.notes[0]
    assert fit.coefficients["a2a_latency"] >= 0 and fit.coefficients["a_lin_extra"] >= 0
    assert fit.max_rel_error > 0.01  # the links' bytes do not fit a layer whose bytes are free: reported


def test_the_exchange_fit_is_not_negative_where_the_origin_work_overprices_the_layer():
    priced = priced_model(bw=1e9, a_lin=1e-6, latency=1e-4)
    m = exchange_measurement(priced, 0.0, 0.0, bw=2e9)
    m["measured_s"] = [0.5 * v for v in m["measured_s"]]  # faster than the origin work alone
    fit = fit_exchange(m, 3, MODEL, priced)
    assert min(fit.coefficients[k] for k in ("a2a_latency", "a_lin_extra", "bw_intra")) >= 0
    assert fit.cost_fields["a_lin"] == priced.a_lin + fit.coefficients["a_lin_extra"]
    assert fit.max_rel_error > 0.1  # reported, not hidden


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), scale=st.floats(0.0, 0.9))
def test_nnls_with_an_offset_recovers_the_rest(seed, scale):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 1.0, size=(12, 3))
    c = rng.uniform(0.0, 2.0, size=3)
    rest = x @ c
    offset = scale * rest * rng.uniform(0.5, 1.5, size=12)
    assert np.allclose(nnls_relative(x, rest + offset, offset), c, rtol=1e-7, atol=1e-9)
    assert np.array_equal(nnls_relative(x, rest), nnls_relative(x, rest, np.zeros(12)))


def test_fit_all_puts_the_exchange_in_place_of_the_links_latency_and_refits_the_same():
    measured = {"attention": attention_measurement(5e-5, 1e-9), "links": links_measurement(1e-4, 2e9, 1e9, 5e8)}
    _, first, _ = fit_all(measured, 3, MODEL)
    measured["exchange"] = exchange_measurement(first, 8e-4, 2e-6)
    fits, cost, sources = fit_all(measured, 3, MODEL)
    assert fits["links"].cost_fields["a2a_latency"] == pytest.approx(1e-4)
    assert cost.a2a_latency == fits["exchange"].coefficients["a2a_latency"] == pytest.approx(8e-4)
    assert cost.a_lin == pytest.approx(fits["attention"].cost_fields["a_lin"] + 2e-6)
    assert cost.bw_intra == fits["exchange"].coefficients["bw_intra"] == pytest.approx(4e9)
    assert fits["links"].cost_fields["bw_intra"] == pytest.approx(1e9)
    assert sources["a2a_latency"] == sources["bw_intra"] == "measured: exchange"
    assert cost.bw_reduce == pytest.approx(5e8) and sources["bw_reduce"] == "measured: links"
    assert sources["a_lin"] == "measured: exchange (on measured: attention)"
    # without it, the links' model is what `to_cost_model` gives
    assert first == to_cost_model(MODEL, {k: f for k, f in fits.items() if k != "exchange"})[0]
    rep = build(
        fits=fits,
        cost=cost,
        preset=rp.CostModel.from_model(MODEL, rp.Hardware.h200()),
        hardware=rp.Hardware.h200(),
        sources=sources,
        device={"device": "cpu", "threads": 1},
        settings={"holdout_every": 3},
        model={f: getattr(MODEL, f) for f in MODEL.__dataclass_fields__},
        profile="tiny",
        skipped={},
        elapsed_s=1.0,
        version=rp.__version__,
    )
    check_report(rep, kinds=("attention", "links", "exchange"))
    again = refit(rep)
    assert again.cost == cost and again.report["sources"]["a2a_latency"] == "measured: exchange"


def test_the_exchange_is_measured_on_request_only():
    assert "exchange" not in KERNELS and ALL_KERNELS == KERNELS + ("exchange",)
    with pytest.raises(RoutepackError, match=r"sweeps\.exchange_tokens"):
        Sweeps(
            tokens_per_expert=(1,),
            active_experts=(1,),
            max_tokens=4,
            lengths=(8,),
            message_bytes=(64,),
            exchange_tokens=(16, 4),
        )
    assert Sweeps.default("cpu", quick=True).exchange_tokens == (4, 16, 64, 256)
    with pytest.raises(RoutepackError, match="kernels: 'exchanges'"):
        rp.calibrate("tiny", kernels=["exchanges"], progress=False)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_the_exchange_times_an_epmoe_layer_on_two_ranks():
    """Five experts on two ranks (three slots each, the last one empty), top-2: the layer runs
    forward and backward on both ranks at every point, its kernel timed apart."""
    shape = rp.ModelShape(2, 5, 2, 32, 16, attention=("linear", "linear"), shared_experts=0)
    cal = rp.calibrate(
        model=shape, kernels=["links", "exchange"], quick=True, threads=1, links_clock="cpu", progress=False
    )
    k = cal.report["kernels"]["exchange"]
    tokens = Sweeps.default("cpu", quick=True).exchange_tokens
    assert [(p["tokens"], p["routing"]) for p in k["sweep"]] == [(t, r) for t in tokens for r in ROUTINGS]
    for p, m, layer, kern in zip(k["sweep"], k["measured_s"], k["layer_s"], k["kernel_s"]):
        assert p["routed"] == 2 * p["tokens"]
        # three experts on rank 0, two on rank 1: rank 1's own take only two copies a token
        want = {"local": 0, "remote": p["routed"]}.get(p["routing"])
        if want is not None:
            assert p["remote_rows"] == want
        assert p["remote_bytes"] == 4 * 32 * p["remote_rows"]
        assert 0 < m < layer and 0 < kern < layer
    assert cal.cost.bw_intra == k["cost_fields"]["bw_intra"]
    assert k["clock"] == "cpu" and k["backend"] == "gloo" and k["ranks"] == 2
    assert cal.cost.a2a_latency == k["cost_fields"]["a2a_latency"]
    assert cal.report["sources"]["a2a_latency"] == "measured: exchange"
    check_report(cal.report, kinds=("links", "exchange"))
