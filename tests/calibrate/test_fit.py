"""`routepack.calibrate.fit`: `to_cost_model` and `fit_all` (the exchange fitted last, in place
of the links' fields), and `refit` of their report gives the same model."""

from __future__ import annotations

import pytest

import routepack as rp
from routepack.calibrate import refit
from routepack.calibrate.fit import FITS, fit_all, to_cost_model
from routepack.calibrate.report import build
from synthetic import (
    MODEL,
    attention_measurement,
    links_measurement,
    synthetic_fits,
    check_report,
    exchange_measurement,
)


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
