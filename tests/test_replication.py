"""Replication planners (hot_n, relibra, routepack) and ReLibra's reordering placement.

Every plan goes through `Plan.validate`. routepack's replication must never make the
simulated step slower than no replication; hot_n must follow MindSpeed's counting rule
(checked against an independent numpy implementation); relibra copies stay inside nodes;
the relibra placement balances node loads with a permutation of experts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import _core
from routepack.policies import PLACEMENTS, REPLICATIONS, Policy

REPLICATION_NAMES = ("hot_n", "relibra", "routepack")
#: (dp, ep, gpus_per_node, slots_per_rank, E): one node per group, groups over 2 and 4 nodes,
#: several groups per node, one GPU per node.
SHAPES = [(8, 8, 8, 3, 16), (8, 4, 2, 5, 16), (16, 8, 2, 3, 20), (8, 2, 8, 9, 13), (8, 4, 1, 4, 14)]


def cost_for(num_layers: int, cheap_copies: bool = True) -> rp.CostModel:
    """Coefficients at the scale of the small windows: expert work, all-to-all and copies
    of comparable size (so every planner has something to trade); a_quad on every 4th layer."""
    return rp.CostModel(
        a_lin=2e-9,
        a_quad=[1e-12 if l % 4 == 3 else 0.0 for l in range(num_layers)],
        c_tok=4e-9,
        c_exp=2e-7,
        token_bytes=2048.0,
        bw_intra=4e11,
        bw_inter=5e10,
        expert_weight_bytes=2e4 if cheap_copies else 6e6,
        expert_grad_bytes=4e4 if cheap_copies else 12e6,
        expert_state_bytes=1.4e5,
    )


def make_case(seed: int, shape: int, layers: int = 3):
    """A window with topic-like skew: each sample sends a third of its routed tokens to a
    per-sample hot expert. Returns (window, topo, cost, cap)."""
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr, E = SHAPES[shape % len(SHAPES)]
    topo = rp.Topology(dp, ep, gpn, spr)
    S = dp * int(rng.integers(2, 5))
    cap = 300
    seq_lens = rng.integers(1, cap + 1, size=S)
    k = 2
    tokens = np.zeros((S, layers, E), dtype=np.int32)
    for s in range(S):
        hot = int(rng.integers(E))
        for l in range(layers):
            n = int(seq_lens[s]) * k
            n_hot = n // 3
            tokens[s, l, (hot + l) % E] += n_hot
            tokens[s, l] += rng.multinomial(n - n_hot, np.full(E, 1.0 / E)).astype(np.int32)
    tokens = np.minimum(tokens, seq_lens[:, None, None])  # a token picks an expert once
    return rp.Window(seq_lens, tokens), topo, cost_for(layers), cap


def plan(window, topo, cost, cap, replication, placement="static", **options):
    return rp.plan_window(window, topo, cost, cap, policy=Policy(placement, "sequential", replication), **options)


def keys(rows: np.ndarray, *fields: str) -> np.ndarray:
    """One int64 key per row from the given int32 fields (each < 2**12)."""
    out = np.zeros(len(rows), dtype=np.int64)
    for f in fields:
        out = out * 4096 + rows[f].astype(np.int64)
    return out


def host_ranks(placement: rp.Placement, layer: int, expert: int) -> set:
    slots = np.flatnonzero(placement.phy2log[layer] == expert)
    return {int(p) // placement.slots_per_rank for p in slots}


def test_registered():
    for name in REPLICATION_NAMES:
        assert name in REPLICATIONS
    assert "relibra" in PLACEMENTS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    shape=st.integers(0, len(SHAPES) - 1),
    replication=st.sampled_from(REPLICATION_NAMES),
    placement=st.sampled_from(["static", "relibra"]),
)
def test_every_plan_is_valid(seed, shape, replication, placement):
    window, topo, cost, cap = make_case(seed, shape)
    p = plan(window, topo, cost, cap, replication, placement)
    p.validate(window, topo, cap)
    rows = p.replicas
    assert rows.dtype == rp.REPLICA_DTYPE
    assert ((rows["share"] >= 0) & (rows["share"] <= 1)).all()
    assert (rows["src_rank"] != rows["dst_rank"]).all()
    for r in rows:
        assert int(r["src_rank"]) in host_ranks(p.placement, int(r["layer"]), int(r["expert"]))
    if replication != "hot_n":
        # at most replication_slots (default 2) copies on a rank per (group, micro, layer)
        _, counts = np.unique(keys(rows, "group", "micro", "layer", "dst_rank"), return_counts=True)
        assert (counts <= 2).all()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), shape=st.integers(0, len(SHAPES) - 1), slots=st.integers(1, 3), cheap=st.booleans())
def test_routepack_never_slower_than_none(seed, shape, slots, cheap):
    window, topo, _, cap = make_case(seed, shape)
    cost = cost_for(window.num_layers, cheap_copies=cheap)
    none = plan(window, topo, cost, cap, "none")
    ours = plan(window, topo, cost, cap, "routepack", replication_slots=slots)
    ours.validate(window, topo, cap)
    a = rp.simulate(none, window, topo, cost, cap)
    b = rp.simulate(ours, window, topo, cost, cap)
    assert b.step_time <= a.step_time
    assert (b.group_times <= a.group_times).all()


def test_routepack_gains_on_skewed_windows():
    gains = []
    for seed in range(6):
        window, topo, cost, cap = make_case(seed, 1)
        a = plan(window, topo, cost, cap, "none").report["predicted"]["step_time"]
        b = plan(window, topo, cost, cap, "routepack").report["predicted"]["step_time"]
        gains.append(a / b)
    assert min(gains) >= 1.0 and np.median(gains) > 1.05, gains


def cell_origin(window, p, topo, g, m, l) -> np.ndarray:
    """int64 [ep, E]: tokens of each expert sent by each EP-local rank of group g at step m."""
    out = np.zeros((topo.ep, window.num_experts), dtype=np.int64)
    for r in range(topo.ep):
        members = p.cell_samples(g * topo.ep + r, m)
        out[r] = window.expert_tokens[members, l].sum(axis=0)
    return out


def mindspeed_hot(origin: np.ndarray, owner: np.ndarray, n: int) -> list:
    """MindSpeed's selection, written from its description: rank loads from per-rank counts;
    n times take the most loaded rank and its largest expert, subtract that expert's total
    from the owner, add back each rank's own tokens of it, and zero it."""
    ep, E = origin.shape
    total = origin.sum(axis=0)
    load = np.zeros(ep, dtype=np.int64)
    np.add.at(load, owner, total)
    counts = total.copy()
    hot = []
    for _ in range(n):
        p = int(np.argmax(load))
        mine = np.flatnonzero(owner == p)
        if len(mine) == 0 or counts[mine].max() <= 0:
            break
        e = int(mine[np.argmax(counts[mine])])
        hot.append(e)
        load[p] -= total[e]
        load += origin[:, e]
        counts[e] = 0
    return hot


@pytest.mark.parametrize("shape", [0, 1, 2])
def test_hot_n_follows_mindspeed(shape):
    window, topo, cost, cap = make_case(3, shape)
    p = plan(window, topo, cost, cap, "hot_n")
    per_rank = -(-window.num_experts // topo.ep)
    owner = np.arange(window.num_experts) // per_rank
    rows = p.replicas
    for g in range(topo.num_groups):
        for m in range(p.num_micro):
            for l in range(window.num_layers):
                origin = cell_origin(window, p, topo, g, m, l)
                cell = rows[(rows["group"] == g) & (rows["micro"] == m) & (rows["layer"] == l)]
                got = sorted(set(cell["expert"].tolist()))  # rows are listed by expert id
                assert got == sorted(mindspeed_hot(origin, owner, 3)), (g, m, l)
                for e in got:
                    mine = cell[cell["expert"] == e]
                    # weights to every other rank; each computes exactly its own tokens
                    assert sorted(mine["dst_rank"].tolist()) == [r for r in range(topo.ep) if r != owner[e]]
                    total = origin[:, e].sum()
                    taken = np.rint(mine["share"].astype(np.float64) * total).astype(np.int64)
                    assert (taken == origin[mine["dst_rank"], e]).all()


def test_hot_n_shrinks_the_all_to_all():
    window, topo, cost, cap = make_case(5, 2)
    a = rp.simulate(plan(window, topo, cost, cap, "none"), window, topo, cost, cap)
    b = rp.simulate(plan(window, topo, cost, cap, "hot_n"), window, topo, cost, cap)
    assert b.all_to_all < a.all_to_all


def test_hot_experts_option():
    window, topo, cost, cap = make_case(1, 0)
    one = plan(window, topo, cost, cap, "hot_n", replication_hot_experts=1).replicas
    hot = np.unique(keys(one, "group", "micro", "layer", "expert"))
    cells = np.unique(keys(one, "group", "micro", "layer"))
    assert len(hot) == len(cells) > 0
    with pytest.raises(rp.RoutepackError, match="replication_hot_experts"):
        plan(window, topo, cost, cap, "hot_n", replication_hot_experts=0)
    with pytest.raises(rp.RoutepackError, match="replication_slots"):
        plan(window, topo, cost, cap, "routepack", replication_slots=-1)
    with pytest.raises(rp.RoutepackTypeError, match="replication_slots"):
        plan(window, topo, cost, cap, "relibra", replication_slots=1.5)
    assert len(plan(window, topo, cost, cap, "routepack", replication_slots=0).replicas) == 0


def test_relibra_copies_stay_in_node():
    window, topo, cost, cap = make_case(2, 2)  # ep 8 over nodes of 2
    rows = plan(window, topo, cost, cap, "relibra").replicas
    assert len(rows)
    rpn = min(topo.gpus_per_node, topo.ep)
    assert (rows["src_rank"] // rpn == rows["dst_rank"] // rpn).all()


def test_relibra_placement_balances_nodes():
    window, topo, cost, cap = make_case(4, 2)  # 4 nodes per group
    static = rp.Placement.static(window.num_layers, window.num_experts, topo)
    p = plan(window, topo, cost, cap, "none", placement="relibra")
    loads = window.layer_expert_load()
    rpn = min(topo.gpus_per_node, topo.ep)
    per_node = rpn * topo.slots_per_rank

    def spread(pl):
        out = []
        for l in range(window.num_layers):
            phy = pl.phy2log[l]
            node_load = [
                loads[l, phy[n * per_node : (n + 1) * per_node][phy[n * per_node : (n + 1) * per_node] >= 0]].sum()
                for n in range(topo.ep // rpn)
            ]
            out.append(max(node_load) - min(node_load))
        return np.array(out)

    assert (spread(p.placement) <= spread(static)).all()
    assert spread(p.placement).sum() < 0.5 * spread(static).sum()
    # a permutation: every expert exactly once per layer, empty slots kept
    assert (p.placement.logcnt == 1).all()
    assert (np.sort(p.placement.phy2log, axis=1) == np.sort(static.phy2log, axis=1)).all()
    # from a previous placement, migration is planned and the result is the same placement
    q = rp.plan_window(window, topo, cost, cap, policy=Policy("relibra", "sequential", "relibra"), previous=static)
    q.validate(window, topo, cap)
    assert len(q.migration) > 0
    assert q.placement == p.placement


def test_plans_are_deterministic():
    window, topo, cost, cap = make_case(9, 1)
    for name in REPLICATION_NAMES:
        a = plan(window, topo, cost, cap, name)
        b = plan(window, topo, cost, cap, name)
        assert a.same_as(b), name


def test_bad_inputs_name_the_argument():
    window, topo, cost, cap = make_case(0, 0)
    p = plan(window, topo, cost, cap, "none")
    bad_rank = np.full_like(p.sample_rank, 99)
    with pytest.raises(rp.InvalidPlanError, match="DP rank 99"):
        _core.replicate_routepack(
            rp.Plan(p.placement, bad_rank, p.sample_micro, p.num_micro),
            window.seq_lens,
            window.expert_tokens,
            topo,
            cost,
            2,
        )
    with pytest.raises(rp.RoutepackError, match="loads"):
        _core.relibra_placement(np.full((window.num_layers, window.num_experts), -1.0), topo)


def test_tiny_profile_window():
    prof = rp.traces.profile("tiny")
    window = next(rp.traces.synthetic("tiny", 1, 0))
    topo, cost = prof.topology(), prof.cost()
    times = {}
    for name in ("none",) + REPLICATION_NAMES:
        p = plan(window, topo, cost, prof.token_cap, name)
        p.validate(window, topo, prof.token_cap)
        times[name] = p.report["predicted"]["step_time"]
    assert times["routepack"] <= times["none"]
    assert times["routepack"] <= min(times["hot_n"], times["relibra"]), times
