"""Cross-node bytes (`SimResult.cross_node_bytes`, `intra_node_bytes`, `cross_node_bytes_per_token`)
on cases worked out by hand, and where a planned window reports them (``plan.report``, the bench
tables). The randomized check against an independent implementation is in
test_simulate_reference.py; the Rust proptest in crates/routepack-core/tests/simulate_props.rs.
"""

from __future__ import annotations

import numpy as np
import pytest

import routepack as rp
from routepack.compare import compare, format_table, summarise
from routepack.plan import REPLICA_DTYPE

TOKEN_BYTES = 1000.0


def _cost() -> rp.CostModel:
    return rp.CostModel(
        a_lin=1e-6,
        a_quad=[0.0],
        c_tok=1e-6,
        c_exp=1e-5,
        token_bytes=TOKEN_BYTES,
        bw_intra=4e11,
        bw_inter=5e10,
        expert_weight_bytes=1e3,
        expert_grad_bytes=2e3,
        expert_state_bytes=1e4,
    )


def _two_nodes():
    """ep 4 over 2 nodes of 2 GPUs (ranks 0, 1 | 2, 3), expert e on rank e, one sample per rank,
    one step, one layer."""
    topo = rp.Topology(4, 4, 2, 1)
    #                  expert:  0  1  2  3
    tokens = np.array(
        [
            [[1, 2, 3, 0]],  # rank 0: 2 → rank 1 (same node), 3 → rank 2 (other)
            [[0, 0, 0, 4]],  # rank 1: 4 → rank 3 (other node)
            [[5, 0, 0, 1]],  # rank 2: 5 → rank 0 (other node), 1 → rank 3 (same)
            [[0, 0, 0, 2]],
        ],  # rank 3: stays
        dtype=np.int32,
    )
    window = rp.Window(np.array([6, 4, 6, 2]), tokens)
    placement = rp.Placement(np.array([[0, 1, 2, 3]], dtype=np.int32), 4, 1)
    return topo, window, placement


def test_two_nodes_by_hand():
    topo, window, placement = _two_nodes()
    plan = rp.Plan(placement, np.arange(4, dtype=np.int32), np.zeros(4, dtype=np.int32), 1)
    res = rp.simulate(plan, window, topo, _cost())
    # dispatch: same node 2 + 1 = 3 tokens, across nodes 3 + 4 + 5 = 12 tokens; the cost model
    # counts each twice (dispatch, combine) in each of two passes (forward, backward)
    assert res.intra_node_bytes == 4 * 3 * TOKEN_BYTES
    assert res.cross_node_bytes == 4 * 12 * TOKEN_BYTES
    assert res.cross_node_bytes_per_token == pytest.approx(4 * 12 * TOKEN_BYTES / 18, rel=1e-15)
    assert res.summary()["cross_node_bytes_per_token"] == res.cross_node_bytes_per_token


def test_a_replica_on_the_senders_rank_keeps_its_tokens_home():
    """A copy of expert 3 on rank 1 with share 0.5: it takes round(0.5 · 7) = 4 tokens, first
    rank 1's own 4, which then move nothing; rank 2's one token still goes to rank 3."""
    topo, window, placement = _two_nodes()
    reps = np.array([(0, 0, 0, 3, 3, 1, 0.5)], dtype=REPLICA_DTYPE)
    plan = rp.Plan(placement, np.arange(4, dtype=np.int32), np.zeros(4, dtype=np.int32), 1, replicas=reps)
    plan.validate(window, topo, 10**9)
    res = rp.simulate(plan, window, topo, _cost())
    assert res.intra_node_bytes == 4 * 3 * TOKEN_BYTES
    assert res.cross_node_bytes == 4 * 8 * TOKEN_BYTES  # rank 0 → 2 (3), rank 2 → 0 (5)


def test_one_node_moves_nothing_across_nodes():
    """The same window with all four ranks on one node: every moved byte is intra-node."""
    _, window, placement = _two_nodes()
    plan = rp.Plan(placement, np.arange(4, dtype=np.int32), np.zeros(4, dtype=np.int32), 1)
    res = rp.simulate(plan, window, rp.Topology(4, 4, 8, 1), _cost())
    assert res.cross_node_bytes == 0.0 and res.cross_node_bytes_per_token == 0.0
    assert res.intra_node_bytes == 4 * 15 * TOKEN_BYTES


def test_plan_report_and_bench_table_carry_it():
    prof = rp.traces.profile("tiny")
    windows = list(rp.traces.synthetic(prof, 2, 0))
    topo, cost = prof.topology(), prof.cost()
    plan = rp.plan_window(windows[1], topo, cost, token_cap=prof.token_cap, policy="static")
    predicted = plan.report["predicted"]
    res = rp.simulate(plan, windows[1], topo, cost)
    for key in ("intra_node_bytes", "cross_node_bytes", "cross_node_bytes_per_token"):
        assert predicted[key] == getattr(res, key)
    assert predicted["cross_node_bytes"] == 0.0  # tiny's EP group is one node
    assert predicted["intra_node_bytes"] > 0.0
    rows = compare(windows, topo, cost, prof.token_cap, ["static"])
    assert rows[0].cross_node_bytes_per_token == 0.0
    table = format_table(summarise(rows))
    assert "xnode kB/tok" in table.splitlines()[0]
