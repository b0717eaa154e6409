"""`routepack.calibrate.expert_table`: the table's knots and its hat columns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routepack.calibrate.expert_table import table_columns, table_knots
from routepack.calibrate.fit.common import holdout_mask
from routepack.calibrate.sweeps import log_points


@settings(max_examples=40, deadline=None)
@given(top=st.integers(1, 100_000), every=st.integers(2, 5))
def test_table_knots_and_columns(top, every):
    """The knots are 1, 2, the powers of 4 and the top, among the counts a fitted point
    measures; each column is its knot's hat (1 there, 0 at the other knots), so the columns
    interpolate as np.interp does, constant outside the knots."""
    per = np.array(log_points(1, top + 1, 2.0), dtype=np.float64)
    fitted = ~holdout_mask(len(per), every)
    knots = table_knots(per, fitted)
    assert np.all(np.diff(knots) > 0) and set(knots) <= set(per[fitted])
    for k in knots:
        assert k in (1, 2, per.max()) or np.log(k) / np.log(4) == pytest.approx(round(np.log(k) / np.log(4)))
    cols = table_columns(per, knots)
    assert np.allclose(table_columns(knots, knots), np.eye(len(knots)))
    values = np.random.default_rng(top).uniform(0, 1, len(knots))
    probe = np.concatenate([per, [0.5, per.max() * 2]])
    assert np.allclose(table_columns(probe, knots) @ values, np.interp(probe, knots, values))
    assert cols.shape == (len(per), len(knots))
