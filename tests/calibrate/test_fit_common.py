"""`routepack.calibrate.fit.common`: the held-out points, the non-negative least squares on
relative residuals (with a known offset) and the errors of a fit with too few points."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.fit.attention import fit_attention
from routepack.calibrate.fit.common import holdout_mask, nnls_relative
from synthetic import MODEL


def test_the_fit_keeps_coefficients_non_negative():
    x = np.stack([np.arange(1.0, 11.0), np.ones(10)], axis=1)
    y = 2.0 * x[:, 0] - 0.5  # the unconstrained intercept would be negative
    coef = nnls_relative(x, y)
    assert coef[1] == 0.0 and coef[0] > 0
    with pytest.raises(rp.RoutepackError, match="measured times"):
        nnls_relative(x, -y)


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
