"""`routepack.calibrate.sweeps`: the default sweeps and bad ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.sweeps import Sweeps, log_points


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
