"""`routepack.calibrate.fit.links`: latency and bandwidth per op recovered from synthetic timings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routepack.calibrate.fit.links import fit_links
from synthetic import MODEL, links_measurement


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
        "reduce_latency": fit.coefficients["latency_all_reduce_s"],
    }
    assert fit.cost_fields["reduce_latency"] == pytest.approx(lat, rel=1e-4, abs=1e-12)
    before = fit_links(links_measurement(lat, bw_p2p, bw_a2a), 3, MODEL)  # a report without the all-reduce
    assert "bw_reduce" not in before.cost_fields and "bw_all_reduce" not in before.coefficients
    assert "reduce_latency" not in before.cost_fields
    for op in ("p2p", "all_to_all", "all_reduce"):  # each op has held-out points of its own
        assert any(h for h, p in zip(fit.held_out, fit.sweep) if p["op"] == op)
