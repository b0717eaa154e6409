"""`routepack.calibrate.fit.replication`: on timings made from the cost model's replication term
(the link's time + a per-byte staging cost at both ends) it recovers the per-byte cost against
the link bandwidth it is given; it stays >= 0 where the link alone over-prices; `fit_all`
fits it against the bandwidth the links priced (`simulate` pricing it:
tests/test_cost_options.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.fit import fit_all
from routepack.calibrate.fit.replication import REPLICATION_FORMULA, fit_replication
from synthetic import MODEL, links_measurement

COPY = 1_572_864.0  # bytes of one copy's weights and gradient (the measured run's, fp32)


def replication_measurement(per_byte: float, bw: float, noise: float = 0.0, seed: int = 0) -> dict:
    """n copies each way: what `fit_replication` fits, exactly (or with relative noise)."""
    rng = np.random.default_rng(seed)
    sweep, measured = [], []
    for n in (1, 2, 3, 4, 6, 8):
        link, staged = n * COPY, 2 * n * COPY
        sweep.append({"copies": n, "staged_bytes": staged, "link_bytes": link})
        measured.append((link / bw + per_byte * staged) * (1 + noise * rng.uniform(-1, 1)))
    return {"sweep": sweep, "measured_s": measured}


def priced(bw: float) -> rp.CostModel:
    return replace(rp.CostModel.from_model(MODEL, rp.Hardware.h200()), bw_intra=bw)


@settings(max_examples=50, deadline=None)
@given(per_byte=st.floats(1e-12, 1e-8), bw=st.floats(1e8, 1e11))
def test_the_fit_recovers_the_per_byte_cost(per_byte, bw):
    fit = fit_replication(replication_measurement(per_byte, bw), 3, MODEL, priced(bw))
    assert fit.cost_fields["c_replica"] == pytest.approx(per_byte, rel=1e-6)
    assert fit.max_rel_error < 1e-6 and fit.formula == REPLICATION_FORMULA
    assert fit.coefficients["bw_intra"] == bw and sum(fit.held_out) > 0


def test_a_link_that_overprices_leaves_it_at_zero():
    fit = fit_replication(replication_measurement(1e-9, 2e9), 3, MODEL, priced(1e8))
    assert fit.cost_fields == {"c_replica": 0.0}
    assert fit.extra["max_rel_error_link_only"] > 1.0 and fit.max_rel_error > 1.0  # reported, not hidden


@settings(max_examples=20, deadline=None)
@given(noise=st.floats(0.001, 0.05), seed=st.integers(0, 2**31))
def test_noisy_timings_miss_held_out_points_by_about_the_noise(noise, seed):
    fit = fit_replication(replication_measurement(1.5e-9, 2e9, noise, seed), 3, MODEL, priced(2e9))
    assert fit.max_rel_error <= 2.5 * noise + 1e-9


def test_fit_all_fits_the_replication_against_the_links_bandwidth():
    links = links_measurement(1e-4, 2e9, 1e9, 5e8)
    fits, cost, sources = fit_all({"links": links, "replication": replication_measurement(8e-10, 1e9)}, 3, MODEL)
    assert cost.bw_intra == pytest.approx(1e9)
    assert cost.c_replica == pytest.approx(8e-10, rel=1e-6)
    assert sources["c_replica"] == "measured: replication"
    assert "replication" in fits
