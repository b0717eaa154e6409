"""`routepack.calibrate.timing`: `run_rounds` visits every point each round (the short ones in
more rounds) and `polish` divides the machine's drift out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 10),
    warmup=st.integers(0, 3),
    repeats=st.integers(1, 6),
    seed=st.integers(0, 99),
    visit_s=st.sampled_from([0.0, 0.004, 0.02, 0.1]),
    visit_calls=st.integers(1, 5),
)
def test_run_rounds_visits_every_point_each_round_and_polishes_the_visit_medians(
    n, warmup, repeats, seed, visit_s, visit_calls
):
    from routepack.calibrate.timing import polish, run_rounds

    rng = np.random.default_rng(seed)
    log, ticks = [], []

    def step(i):
        def f():
            v = float(rng.uniform(0.001, 0.03))
            log.append((i, v))
            return v, 2 * v

        return f

    got = run_rounds(
        [step(i) for i in range(n)],
        warmup,
        repeats,
        lambda: ticks.append(1),
        seed,
        visit_s=visit_s,
        visit_calls=visit_calls,
    )
    # the warm-up rounds: one call per point each, every point once a round
    warm = log[: warmup * n]
    assert all(sorted(i for i, _ in warm[r * n : (r + 1) * n]) == list(range(n)) for r in range(warmup))
    last = {i: v for i, v in warm}  # each point's last warm-up time sets its calls per visit

    def calls_for(v: float) -> int:
        return max(1, min(visit_calls, int(np.ceil(visit_s / v))))

    calls = [1 if i not in last else calls_for(last[i]) for i in range(n)]
    table = np.zeros((repeats, n, 2))
    pos = warmup * n
    for r in range(repeats):
        seen = []
        for _ in range(n):
            i = log[pos][0]
            vals = [v for j, v in log[pos : pos + calls[i]]]
            assert all(j == i for j, _ in log[pos : pos + calls[i]])  # a visit's calls are back to back
            table[r, i] = (np.median(vals), 2 * np.median(vals))
            seen.append(i)
            pos += len(vals)
            if len(vals) == 1:  # a point called once: its timed visit decides from then on
                calls[i] = calls_for(float(np.median(vals)))
        assert sorted(seen) == list(range(n))  # every point once a round
    assert got.calls == calls
    assert pos == len(log) and len(ticks) == n * repeats
    want = polish(table)
    assert np.allclose(got.figures, want.figures, rtol=1e-12)
    assert np.allclose(got.drift, want.drift, rtol=1e-12) and len(got.drift) == repeats
    assert np.allclose(got.spread, want.spread, rtol=1e-9, atol=1e-12)
    for i in range(n):  # a figure is the median of its visits with their round's factor divided out
        assert got.figures[i][0] == pytest.approx(float(np.median(table[:, i, 0] / want.drift)), rel=1e-12)
        assert got.spread[i] >= 0
    assert got.loadavg is None or got.loadavg[0] <= got.loadavg[1]


@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.sampled_from([0.001, 0.004, 0.05, 0.2]), min_size=1, max_size=8),
    repeats=st.integers(1, 4),
    short=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_run_rounds_gives_the_short_points_more_rounds(times, repeats, short, seed):
    """``short_repeats`` more rounds visit exactly the steps called more than once a visit."""
    from routepack.calibrate.timing import run_rounds

    visits = [0] * len(times)
    ticks = []

    def step(i):
        def f():
            visits[i] += 1
            return times[i], times[i] / 3

        return f

    got = run_rounds(
        [step(i) for i in range(len(times))],
        1,
        repeats,
        lambda: ticks.append(1),
        seed,
        visit_s=0.01,
        visit_calls=5,
        short_repeats=short,
    )
    want_calls = [min(5, int(np.ceil(0.01 / t))) for t in times]
    assert got.calls == want_calls
    is_short = [c > 1 for c in want_calls]
    extra = short if any(is_short) else 0
    assert visits == [1 + c * (repeats + (extra if s else 0)) for c, s in zip(want_calls, is_short)]
    assert len(ticks) == repeats * len(times) + extra * sum(is_short)
    assert len(got.drift) == repeats + extra
    assert np.allclose([f[0] for f in got.figures], times, rtol=1e-9)  # constant times: no drift
    assert np.allclose([f[1] for f in got.figures], np.array(times) / 3, rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(
    times=st.lists(st.sampled_from([0.001, 0.004, 0.05]), min_size=3, max_size=6),
    slow=st.data(),
    repeats=st.integers(1, 3),
    short=st.integers(1, 4),
    seed=st.integers(0, 99),
)
def test_a_slow_first_call_does_not_keep_a_short_point_out_of_the_short_rounds(times, slow, repeats, short, seed):
    """A step whose first call pays a one-off set-up (above ``visit_s``: the warm-up would call
    it once a visit) is called as its timed visits say from its second visit on, and the short
    rounds visit it when those are short."""
    from routepack.calibrate.timing import run_rounds

    first = slow.draw(st.integers(0, len(times) - 1))
    visits = [0] * len(times)

    def step(i):
        def f():
            visits[i] += 1
            t = 0.5 if (i == first and visits[i] == 1) else times[i]
            return t, t / 3

        return f

    got = run_rounds(
        [step(i) for i in range(len(times))], 1, repeats, seed=seed, visit_s=0.01, visit_calls=5, short_repeats=short
    )
    want = [min(5, int(np.ceil(0.01 / t))) for t in times]
    assert got.calls == want
    is_short = [c > 1 for c in want]
    extra = short if any(is_short) else 0
    # the slow step: its warm-up call, one call at its first timed visit, then `want` a visit
    rounds = [repeats + (extra if s else 0) for s in is_short]
    expect = [1 + c * r for c, r in zip(want, rounds)]
    expect[first] = 1 + 1 + want[first] * (rounds[first] - 1)
    assert visits == expect
    assert np.allclose([f[0] for f in got.figures], times, rtol=1e-9)


@settings(max_examples=80, deadline=None)
@given(
    true=st.lists(st.floats(1e-4, 1.0), min_size=3, max_size=10),
    drift=st.lists(st.floats(0.5, 2.0), min_size=2, max_size=9),
)
def test_polish_divides_out_a_factor_common_to_every_point_of_a_round(true, drift):
    """A machine that runs a whole round slower (or faster) moves no figure: every figure is
    its true time at the median round's speed, and the round factors are the drift."""
    from routepack.calibrate.timing import polish

    t, s = np.array(true), np.array(drift)
    level = float(np.exp(np.median(np.log(s))))
    got = polish((s[:, None] * t[None, :])[:, :, None] * np.array([1.0, 0.25])[None, None, :])
    assert np.allclose(got.figures[:, 0], t * level, rtol=1e-9)
    assert np.allclose(got.figures[:, 1], 0.25 * t * level, rtol=1e-9)  # every figure of a visit alike
    assert np.allclose(got.drift, s / level, rtol=1e-9)
    assert np.allclose(got.spread, 0.0, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    true=st.lists(st.floats(1e-3, 1.0), min_size=6, max_size=12), rounds=st.integers(5, 9), seed=st.integers(0, 2**31)
)
def test_polish_keeps_the_median_of_noisy_rounds(true, rounds, seed):
    """With no drift in the table, a slow visit of every point (a spell of interference, 3×)
    moves no figure off its true time by more than the visits' noise allows, and every figure
    stays between the point's visits. (Six points and five rounds or more: on a smaller table
    a median polish can take such spells for drift.)"""
    from routepack.calibrate.timing import polish

    rng = np.random.default_rng(seed)
    t = np.array(true)[None, :] * rng.uniform(0.95, 1.05, (rounds, len(true)))
    slow = rng.integers(0, rounds, len(true))
    t[slow, np.arange(len(true))] *= 3.0  # a spell of interference on one visit of each point
    got = polish(t[:, :, None])
    assert np.all(got.figures[:, 0] >= t.min(axis=0) * (1 - 1e-9))
    assert np.all(got.figures[:, 0] <= t.max(axis=0) * (1 + 1e-9))
    assert np.allclose(got.figures[:, 0], true, rtol=0.25)
    assert abs(float(np.median(np.log(got.drift)))) < 1e-9


def test_polish_of_one_round_or_one_point_and_bad_tables():
    from routepack.calibrate.timing import polish

    one_round = polish(np.array([[[2.0, 1.0], [4.0, 3.0]]]))
    assert one_round.figures.tolist() == [[2.0, 1.0], [4.0, 3.0]] and one_round.drift.tolist() == [1.0]
    one_point = polish(np.array([[[3.0]], [[1.0]], [[2.0]]]))
    assert one_point.figures.tolist() == [[2.0]] and one_point.drift.tolist() == [1.0, 1.0, 1.0]
    assert one_point.spread.tolist() == [1.0]
    with_zero = polish(np.array([[[0.0], [1.0], [1.0]], [[2.0], [3.0], [3.0]]]))  # a zero time: no logs, no drift
    assert with_zero.drift.tolist() == [1.0, 1.0]
    two = polish(np.array([[[1.0], [2.0]], [[3.0], [2.0]], [[1.0], [2.0]]]))  # two points: no drift read
    assert two.drift.tolist() == [1.0, 1.0, 1.0] and two.figures[:, 0].tolist() == [1.0, 2.0]
    # rounds that skip points (the short points' extra rounds): the second round ran at half
    # speed, the third visits one point and reads no drift; the centre is the median of the two
    nan = np.nan
    gaps = polish(np.array([[1.0, 2.0, 4.0, 8.0], [2.0, 4.0, 8.0, nan], [nan, 2.0, nan, nan]])[:, :, None])
    assert np.allclose(gaps.drift, [2**-0.5, 2**0.5, 1.0])
    assert np.allclose(gaps.figures[:, 0], 2**0.5 * np.array([1.0, 2.0, 4.0, 8.0]))
    # a lone full round and extra rounds of the short points only: the full round's drift is
    # read against the short points it shares with them, not from the long points' times
    mixed = np.array([[0.001] * 3 + [0.05] * 4] + [[0.001] * 3 + [nan] * 4] * 2)[:, :, None]
    assert np.allclose(polish(mixed).figures[:, 0], [0.001] * 3 + [0.05] * 4)
    assert np.allclose(polish(mixed).drift, 1.0)
    for bad in (
        np.zeros((0, 2, 1)),
        np.zeros((2, 0, 1)),
        np.zeros((2, 2)),
        np.ones((2, 2, 0)),
        np.array([[[1.0], [np.nan]], [[1.0], [np.nan]]]),
        np.array([[[1.0], [1.0]], [[np.nan], [np.nan]]]),
    ):
        with pytest.raises(rp.RoutepackError, match="times"):
            polish(bad)
