"""`_core.route_cell` / `_core.rank_tokens`: the bindings the torch remapper is built on."""

import numpy as np
import pytest

import routepack as rp
from routepack import _core
from routepack.plan import REPLICA_DTYPE, Placement, Plan


def _cell(expert=(), dst=(), share=()):
    return (np.asarray(expert, np.int32), np.asarray(dst, np.int32), np.asarray(share, np.float32))


def test_route_cell_follows_route_expert():
    topo = rp.Topology(4, 4, 2, 2)
    origin = np.array([[5, 0], [7, 1], [0, 0], [3, 2]], dtype=np.int64)
    row = np.array([0, 1, -1, -1, 0, 1, -1, 1], dtype=np.int32)
    o, d, slot, rep, e, n = _core.route_cell(origin, row, topo, *_cell([0], [2], [0.5]))
    # expert 0: round(0.5 * 15) = 8 tokens to the copy on rank 2, node mate 3 first, then rank 0;
    # the rest (rank 1's 7) to slots 0 and 4 (ranks 0 and 2) with quotas 3 and 4, node first:
    # 4 cross to rank 2, 3 stay on node 0
    assert e.tolist() == [0, 0, 0, 0, 1, 1]
    assert (o[:2].tolist(), d[:2].tolist(), rep[:2].tolist(), n[:2].tolist()) == ([3, 0], [2, 2], [0, 0], [3, 5])
    assert (o[2:4].tolist(), d[2:4].tolist(), n[2:4].tolist()) == ([1, 1], [2, 0], [4, 3])
    # expert 1 (slots on ranks 0, 2, 3; quotas 1, 2, 0): each node feeds its own slots, nothing crosses
    assert (o[4:].tolist(), d[4:].tolist(), n[4:].tolist()) == ([1, 3], [0, 2], [1, 2])
    for i in range(len(n)):
        assert (slot[i] >= 0) != (rep[i] >= 0)
        if slot[i] >= 0:
            assert row[slot[i]] == e[i] and slot[i] // 2 == d[i]
    got = np.zeros_like(origin)
    np.add.at(got, (o, e), n)
    assert np.array_equal(got, origin)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(origin=np.ones((3, 2), np.int64)), "origin"),
        (dict(origin=-np.ones((4, 2), np.int64)), "negative count"),
        (dict(row=np.array([0, 0, -1, -1, 0, 0, -1, 0], np.int32)), "logical expert 1"),
        (dict(row=np.zeros(6, np.int32)), "phy2log"),
        (dict(cell=_cell([0], [4], [0.5])), "dst_rank"),
        (dict(cell=_cell([0], [2], [1.5])), "share 1.5"),
        (dict(cell=_cell([2], [2], [0.5])), "expert 2"),
        (dict(cell=_cell([0, 1], [2], [0.5])), "differ in length"),
    ],
)
def test_route_cell_refuses_bad_input(args, match):
    topo = rp.Topology(4, 4, 2, 2)
    origin = args.get("origin", np.ones((4, 2), np.int64))
    row = args.get("row", np.array([0, 1, -1, -1, 0, 1, -1, 1], np.int32))
    with pytest.raises(rp.RoutepackError, match=match):
        _core.route_cell(origin, row, topo, *args.get("cell", _cell()))


def test_rank_tokens_conserves_and_matches_simulate():
    topo = rp.Topology(4, 4, 2, 3)
    rng = np.random.default_rng(3)
    routed = np.argsort(rng.random((60, 2, 8)), axis=2)[..., :2].astype(np.int32)  # 2 distinct ids a token
    cu = np.array([0, 5, 12, 20, 26, 33, 40, 47, 53, 60])
    window = rp.Window.from_routed_experts(routed, cu, 8)
    rank = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0], np.int32)
    micro = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1], np.int32)
    phy = np.tile(np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, -1], np.int32), (2, 1))
    reps = np.array([(0, 0, 1, 4, 1, 0, 0.4)], dtype=REPLICA_DTYPE)
    plan = Plan(Placement(phy, 8, 3), rank, micro, 2, reps).validate(window, topo, 10_000)
    got = _core.rank_tokens(plan, window.seq_lens, window.expert_tokens, topo)
    assert got.shape == (1, 2, 2, 4) and got.dtype == np.int64
    for m in range(2):
        for l in range(2):
            sel = micro == m
            assert got[0, m, l].sum() == window.expert_tokens[sel, l].sum()
    cost = rp.CostModel.from_model(rp.ModelShape(2, 8, 2, 16, 8), rp.Hardware.h200())
    sim = rp.simulate(plan, window, topo, cost)
    imb = got.max(-1) * 4.0 / got.sum(-1)
    assert np.array_equal(imb, sim.imbalance)
