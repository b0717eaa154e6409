"""`routepack.calibrate.fit.exchange`: the layer's latency, bandwidth and extra token work,
fitted beyond what the links and the origin work price."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routepack.calibrate.fit.exchange import fit_exchange
from synthetic import MODEL, priced_model, exchange_measurement


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
