"""`routepack.calibrate.fit.migration`: on timings made from the cost model's migration term
(a window's fixed cost + the link's time + a per-byte staging cost) it recovers the fixed and
per-byte costs against the link bandwidth it is given; both stay >= 0 where the link alone
over-prices; `fit_all` fits it last, against the bandwidth the links priced."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.fit import fit_all
from routepack.calibrate.fit.migration import MIGRATION_FORMULA, fit_migration
from synthetic import MODEL, links_measurement

STATE = 2_359_296.0  # bytes of one expert's state (the measured run's: 12 bytes a parameter)


def migration_measurement(latency: float, per_byte: float, bw: float, noise: float = 0.0, seed: int = 0) -> dict:
    """Swaps of k experts (each rank sends and receives k): what `fit_migration` fits, exactly
    (or with relative noise)."""
    rng = np.random.default_rng(seed)
    sweep, measured = [], []
    for k in (1, 2, 3, 4, 6, 8):
        link, staged = k * STATE, 2 * k * STATE
        sweep.append({"moves": k, "staged_bytes": staged, "link_bytes": link})
        measured.append((latency + link / bw + per_byte * staged) * (1 + noise * rng.uniform(-1, 1)))
    return {"sweep": sweep, "measured_s": measured, "state_bytes_per_expert": STATE}


def priced(bw: float) -> rp.CostModel:
    return replace(rp.CostModel.from_model(MODEL, rp.Hardware.h200()), bw_intra=bw)


@settings(max_examples=50, deadline=None)
@given(latency=st.floats(0.0, 0.05), per_byte=st.floats(0.0, 1e-8), bw=st.floats(1e8, 1e11))
def test_the_fit_recovers_the_fixed_and_per_byte_costs(latency, per_byte, bw):
    fit = fit_migration(migration_measurement(latency, per_byte, bw), 3, MODEL, priced(bw))
    scale = 1e-9 * (latency + 8 * STATE * (1 / bw + 2 * per_byte))
    assert fit.cost_fields["migration_latency"] == pytest.approx(latency, rel=1e-6, abs=scale)
    assert fit.cost_fields["c_migrate"] == pytest.approx(per_byte, rel=1e-6, abs=scale / STATE)
    assert fit.max_rel_error < 1e-6 and fit.formula == MIGRATION_FORMULA
    assert fit.coefficients["bw_intra"] == bw and sum(fit.held_out) > 0


def test_a_link_that_overprices_leaves_both_at_zero():
    m = migration_measurement(1e-3, 1e-9, 2e9)
    fit = fit_migration(m, 3, MODEL, priced(1e8))  # the link alone prices every point above its time
    assert fit.cost_fields == {"c_migrate": 0.0, "migration_latency": 0.0}
    assert fit.extra["max_rel_error_link_only"] > 1.0 and fit.max_rel_error > 1.0  # reported, not hidden


@settings(max_examples=20, deadline=None)
@given(noise=st.floats(0.001, 0.05), seed=st.integers(0, 2**31))
def test_noisy_timings_miss_held_out_points_by_about_the_noise(noise, seed):
    fit = fit_migration(migration_measurement(2e-3, 1.5e-9, 2e9, noise, seed), 3, MODEL, priced(2e9))
    assert fit.max_rel_error <= 2.5 * noise + 1e-9


def test_fit_all_fits_the_migration_against_the_links_bandwidth():
    links = links_measurement(1e-4, 2e9, 1e9, 5e8)
    fits, cost, sources = fit_all({"links": links, "migration": migration_measurement(2e-3, 1e-9, 1e9)}, 3, MODEL)
    assert cost.bw_intra == pytest.approx(1e9)
    assert cost.migration_latency == pytest.approx(2e-3, rel=1e-6)
    assert cost.c_migrate == pytest.approx(1e-9, rel=1e-6)
    assert sources["c_migrate"] == sources["migration_latency"] == "measured: migration"
    assert cost.reduce_latency == pytest.approx(1e-4, rel=1e-4) and sources["reduce_latency"] == "measured: links"
