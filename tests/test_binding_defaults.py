"""The bindings' option defaults (src/py_*.rs): an option left None takes the Rust core's default,
the number `_core.defaults()` reports, so a call without it plans exactly what a call passing
that number plans."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest

import routepack as rp
from routepack import _core

PROFILE = replace(rp.traces.profile("tiny"), samples=64)


@pytest.fixture(scope="module")
def setup():
    window = next(iter(rp.traces.synthetic(PROFILE, 1, 0)))
    topo, cost = PROFILE.topology(), PROFILE.cost()
    static = rp.Placement.static(window.num_layers, window.num_experts, topo)
    rank, micro, m, _ = _core.pack_sequential(window.seq_lens, PROFILE.token_cap, topo.dp)
    return window, topo, cost, static, (rank, micro, m)


def test_pack_rows_node_limit(setup):
    window, *_ = setup
    d = _core.defaults()["packing"]
    assert _core.pack_rows(window.seq_lens, PROFILE.token_cap, 1) == _core.pack_rows(
        window.seq_lens, PROFILE.token_cap, 1, node_limit=d["packing_exact_nodes"]
    )


def test_pack_routepack_options(setup):
    window, topo, cost, static, _ = setup
    d = _core.defaults()["packing"]
    args = (window.seq_lens, window.expert_tokens, topo, cost, static.phy2log, PROFILE.token_cap)
    implicit = _core.pack_routepack(*args)
    explicit = _core.pack_routepack(
        *args,
        seed=0,
        anneal_moves=d["anneal_moves"],
        chains=d["anneal_chains"],
        steps=d["anneal_steps"],
        exact_nodes=d["packing_exact_nodes"],
        lambda_=d["anneal_lambda"],
        start_accept=d["anneal_start_accept"],
        cooling=d["anneal_cooling"],
        mix=d["anneal_mix"],
    )
    for a, b in zip(implicit[:2], explicit[:2]):
        np.testing.assert_array_equal(a, b)
    assert implicit[2] == explicit[2]
    assert implicit[3]["moves"] == explicit[3]["moves"]
    assert implicit[3]["annealed_cost"] == explicit[3]["annealed_cost"]


@pytest.mark.parametrize(
    "gpus_per_node, key", [(8, "anneal_moves"), (4, "anneal_moves_across_nodes"), (1, "anneal_moves_across_nodes")]
)
def test_pack_routepack_default_moves_follow_the_topology(setup, gpus_per_node, key):
    """No anneal_moves: the core's budget for the topology (ep 8: one node per EP group with 8
    GPUs per node, two or eight nodes with fewer), the number `_core.defaults()` reports."""
    window, topo, cost, _, _ = setup
    topo = rp.Topology(dp=topo.dp, ep=topo.ep, gpus_per_node=gpus_per_node, slots_per_rank=topo.slots_per_rank)
    static = rp.Placement.static(window.num_layers, window.num_experts, topo)
    args = (window.seq_lens, window.expert_tokens, topo, cost, static.phy2log, PROFILE.token_cap)
    moves = _core.defaults()["packing"][key]
    implicit = _core.pack_routepack(*args)
    explicit = _core.pack_routepack(*args, anneal_moves=moves)
    for a, b in zip(implicit[:2], explicit[:2]):
        np.testing.assert_array_equal(a, b)
    assert implicit[3]["moves"] == explicit[3]["moves"] == moves


def test_routepack_placement_options(setup):
    window, topo, cost, static, _ = setup
    d = _core.defaults()["placement"]
    loads = window.expert_tokens.sum(axis=0).astype(np.float64)
    chunks = _core.chunk_demand(window.seq_lens, window.expert_tokens, d["placement_chunks"])
    implicit = _core.routepack_placement(loads, chunks, topo, cost, static.phy2log)
    explicit = _core.routepack_placement(
        loads,
        chunks,
        topo,
        cost,
        static.phy2log,
        cells=0,
        slack=d["placement_slack"],
        explore=d["placement_explore"],
        fluct_evals=d["placement_fluct_evals"],
        migration_aware=d["placement_migration_aware"],
    )
    np.testing.assert_array_equal(implicit[0], explicit[0])
    assert list(implicit[1]["choice"]) == list(explicit[1]["choice"])


def test_routepack_placement_explore_follows_the_slack(setup):
    """No explore: the core's rule (`placement::routepack::Options::explore`), the larger of
    the default room (`defaults()["placement"]["placement_explore"]`) and the slack; Python
    passes None and writes no rule of its own."""
    window, topo, cost, static, _ = setup
    room = _core.defaults()["placement"]["placement_explore"]
    loads = window.expert_tokens.sum(axis=0).astype(np.float64)
    chunks = _core.chunk_demand(window.seq_lens, window.expert_tokens, 4)
    for slack in (room / 2, 0.5):
        implicit = _core.routepack_placement(loads, chunks, topo, cost, slack=slack)
        explicit = _core.routepack_placement(loads, chunks, topo, cost, slack=slack, explore=max(room, slack))
        np.testing.assert_array_equal(implicit[0], explicit[0])
    with pytest.raises(rp.RoutepackError, match="placement_explore"):
        _core.routepack_placement(loads, chunks, topo, cost, slack=0.5, explore=0.25)
    opts = rp.stages.placement.RoutepackPlacementOptions(placement_slack=0.5)
    assert opts.placement_explore is None and not hasattr(opts, "explore")


def test_replication_options(setup):
    window, topo, cost, static, (rank, micro, m) = setup
    d = _core.defaults()["replication"]
    args = (rp.Plan(static, rank, micro, m), window.seq_lens, window.expert_tokens, topo, cost)
    pairs = [
        (_core.replicate_hot_n(*args), _core.replicate_hot_n(*args, d["replication_hot_experts"])),
        (_core.replicate_relibra(*args), _core.replicate_relibra(*args, d["replication_slots"])),
        (
            _core.replicate_routepack(*args),
            _core.replicate_routepack(
                *args, d["replication_slots"], d["replication_candidates"], d["replication_candidates"]
            ),
        ),
    ]
    for implicit, explicit in pairs:
        for a, b in zip(implicit, explicit):
            np.testing.assert_array_equal(a, b)


def test_migration_diff_ranks_per_node(setup):
    window, topo, cost, static, _ = setup
    rng = np.random.default_rng(0)
    nxt = static.phy2log.copy()
    for row in nxt:
        rng.shuffle(row)
    args = (static.phy2log, nxt, window.num_experts, topo.slots_per_rank, 1.0)
    for a, b in zip(_core.migration_diff(*args), _core.migration_diff(*args, 1)):
        np.testing.assert_array_equal(a, b)


def test_cost_options_are_the_cores():
    """Every cost model option has one default, the core's `CostModel::default()`: the
    bindings report exactly the Python class's optional coefficients (its two planner-only
    fields aside) and Python's defaults are those values."""
    d = _core.cost_defaults()
    optional = {
        f.name: f.default
        for f in dataclasses.fields(rp.CostModel)
        if f.default is not dataclasses.MISSING and f.name not in ("expert_groups", "num_experts")
    }
    assert set(optional) == set(d)
    for name, default in optional.items():
        want = d[name]
        if isinstance(want, list):
            want = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in want)
        assert default == want, name
    required = [f.name for f in dataclasses.fields(rp.CostModel) if f.default is dataclasses.MISSING]
    assert required and not set(required) & set(d)


@pytest.mark.parametrize("slack", [None, 0.0, 0.004, 0.05, 0.3])
def test_placement_explore_defaults_to_the_larger_of_the_core_default_and_the_slack(slack):
    """No ``placement_explore``: the band the first microbatch pass explores is the core's
    default or ``placement_slack``, whichever is larger (a band below the slack would be no
    band). A plan without it equals one passing that number, wherever the rule lives."""
    window = next(iter(rp.traces.synthetic(PROFILE, 1, 3)))
    topo, cost = PROFILE.topology(), PROFILE.cost()
    d = _core.defaults()["placement"]
    opts = {} if slack is None else {"placement_slack": slack}
    want = max(d["placement_explore"], d["placement_slack"] if slack is None else slack)
    implicit = rp.plan_window(window, topo, cost, PROFILE.token_cap, policy="routepack_placement", **opts)
    explicit = rp.plan_window(
        window, topo, cost, PROFILE.token_cap, policy="routepack_placement", placement_explore=want, **opts
    )
    assert implicit.digest() == explicit.digest()
    assert (
        implicit.report["stage_reports"]["placement"]["choice"]
        == explicit.report["stage_reports"]["placement"]["choice"]
    )
