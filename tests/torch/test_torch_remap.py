"""Token remapping without processes: every EP rank's `route_tokens` is computed in one
process and the send/receive sides are matched row by row."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import REPLICA_DTYPE  # noqa: E402
from routepack.torch import expert_counts, route_tokens  # noqa: E402


@st.composite
def cells(draw):
    ep = draw(st.sampled_from([1, 2, 4]))
    gpn = draw(st.sampled_from([g for g in (1, 2, 4, 8) if ep % g == 0 or g % ep == 0]))
    spr = draw(st.integers(1, 3))
    e_n = draw(st.integers(1, ep * spr))
    k = draw(st.integers(1, min(3, e_n)))
    topo = rp.Topology(ep, ep, gpn, spr)
    row = np.concatenate(
        [np.arange(e_n), draw(st.lists(st.integers(-1, e_n - 1), min_size=ep * spr - e_n, max_size=ep * spr - e_n))]
    ).astype(np.int32)
    row = row[np.asarray(draw(st.permutations(range(ep * spr))))]
    ids = []
    for _ in range(ep):
        t = draw(st.integers(0, 6))
        ids.append(np.array([draw(st.permutations(range(e_n)))[:k] for _ in range(t)], dtype=np.int64).reshape(t, k))
    reps = []
    for e in draw(st.lists(st.integers(0, e_n - 1), max_size=3, unique=True)):
        src = int(np.flatnonzero(row == e)[0]) // spr
        left = 1.0
        for d in range(ep):
            if d != src and draw(st.booleans()):
                share = min(left, draw(st.floats(0, 1, width=32)))
                left -= share
                reps.append((0, 0, 0, e, src, d, share))
    return topo, row, ids, np.array(reps, dtype=REPLICA_DTYPE), e_n, k


@settings(max_examples=80, deadline=None)
@given(cells())
def test_every_pair_reaches_a_copy_of_its_expert(case):
    topo, row, ids, reps, e_n, k = case
    ep, spr = topo.ep, topo.slots_per_rank
    origin = np.stack([expert_counts(x, e_n) for x in ids])
    routes = [route_tokens(ids[r], origin, row, topo, reps, r) for r in range(ep)]
    for r, rt in enumerate(routes):
        assert np.array_equal(np.sort(rt.send_order), np.arange(ids[r].size))
        assert sum(rt.send_splits) == ids[r].size
        assert sum(rt.recv_splits) == rt.recv_unit.size == rt.received[r]
        again = route_tokens(ids[r], origin, row, topo, reps, r)
        assert np.array_equal(again.send_order, rt.send_order) and np.array_equal(again.recv_unit, rt.recv_unit)
    for o in range(ep):
        send_off = np.concatenate([[0], np.cumsum(routes[o].send_splits)])
        flat = ids[o].reshape(-1)
        for d in range(ep):
            recv_off = np.concatenate([[0], np.cumsum(routes[d].recv_splits)])
            sent = flat[routes[o].send_order[send_off[d] : send_off[d + 1]]]
            units = routes[d].recv_unit[recv_off[o] : recv_off[o + 1]]
            # the expert each received row is computed with, row for row
            got = np.where(
                units < spr,
                row[d * spr + np.minimum(units, spr - 1)],
                reps["expert"][routes[d].replica_rows[np.maximum(units - spr, 0)]]
                if routes[d].replica_rows.size
                else -1,
            )
            assert np.array_equal(sent, got)


def test_origin_counts_must_match_the_ids():
    topo = rp.Topology(2, 2, 2, 1)
    ids = np.array([[0], [1]])
    origin = np.array([[1, 1], [0, 1]])
    row = np.array([0, 1], np.int32)
    route_tokens(ids, origin, row, topo, np.zeros(0, REPLICA_DTYPE), 0)
    with pytest.raises(rp.RoutepackError, match=r"origin\[1\]"):
        route_tokens(ids, origin, row, topo, np.zeros(0, REPLICA_DTYPE), 1)
    with pytest.raises(rp.RoutepackError, match="expert id 5"):
        expert_counts(np.array([[5]]), 2)
