"""`routepack.calibrate.fit.attention`: ``a_lin`` and ``a_quad`` recovered from synthetic timings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routepack.calibrate.fit.attention import fit_attention
from synthetic import MODEL, SWEEPS, positive, attention_measurement


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
