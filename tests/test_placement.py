"""Placement stage (issue 3): the EPLB baseline and routepack's placement.

Every plan produced here goes through `Plan.validate`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.placement import aggregate_imbalance, imbalance_lower_bound, rebalance_experts

sys.path.insert(0, str(Path(__file__).parent))
import eplb_reference  # noqa: E402

EPLB = rp.Policy("eplb", "sequential", "none", "window")
EPLB_PREV = rp.Policy("eplb", "sequential", "none", "previous")
ROUTEPACK = rp.Policy("routepack", "sequential", "none", "window")

#: A small profile so that hypothesis can afford many plans: 4 layers, 24 experts, 2 nodes.
SMALL = replace(
    rp.traces.profile("tiny"),
    name="small",
    num_layers=4,
    num_experts=24,
    attention=("linear", "linear", "linear", "full"),
    dp=8,
    ep=4,
    gpus_per_node=2,
    slots_per_rank=7,
    token_cap=8192,
    samples=64,
    group_size=4,
    prompt_median=200.0,
    response_median=600.0,
    max_response=4096,
)


@lru_cache(maxsize=None)
def windows(name: str, n: int = 2, seed: int = 0):
    return list(rp.traces.synthetic(rp.traces.profile(name) if name != "small" else SMALL, n, seed))


def setup(name: str):
    prof = SMALL if name == "small" else rp.traces.profile(name)
    return prof, prof.topology(), prof.cost()


# --------------------------------------------------------------------------- EPLB port
def test_readme_example():
    w = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    phy2log, log2phy, logcnt = rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.dtype == np.int64 and phy2log.shape == (2, 16)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.sum(axis=1).tolist() == [16, 16]
    assert log2phy.shape == (2, 12, int(logcnt.max()))


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    nodes=st.sampled_from([1, 2, 4]),
    gpus_per_node=st.sampled_from([1, 2, 4]),
    groups_per_node=st.integers(1, 3),
    group_size=st.integers(1, 6),
    extra_per_gpu=st.integers(0, 3),
    hierarchical=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_eplb_port_matches_reference(
    layers, nodes, gpus_per_node, groups_per_node, group_size, extra_per_gpu, hierarchical, seed
):
    """The Rust port against a line-by-line numpy transcription of DeepSeek's eplb.py."""
    num_gpus = nodes * gpus_per_node
    num_groups = nodes * groups_per_node if hierarchical else nodes * groups_per_node + 1
    experts = num_groups * group_size
    per_gpu = -(-experts // num_gpus) + extra_per_gpu
    replicas = per_gpu * num_gpus
    if not hierarchical and replicas < experts:
        return
    if hierarchical and (experts % nodes or replicas % nodes):
        return
    weight = np.random.default_rng(seed).random((layers, experts)) * 100  # no ties
    ours = rebalance_experts(weight, replicas, num_groups, nodes, num_gpus)
    ref = eplb_reference.rebalance_experts(weight, replicas, num_groups, nodes, num_gpus)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        assert np.array_equal(a, b)


def test_eplb_errors_name_the_argument():
    w = np.ones((1, 12))
    with pytest.raises(rp.RoutepackError, match="num_replicas"):
        rebalance_experts(w, 10, 1, 1, 2)
    with pytest.raises(rp.RoutepackError, match="num_gpus"):
        rebalance_experts(w, 15, 5, 5, 10)
    with pytest.raises(rp.RoutepackError, match="weight"):
        rebalance_experts(np.full((1, 12), -1.0), 12, 1, 1, 2)
    with pytest.raises(ValueError, match="weight"):
        rebalance_experts(np.ones(12), 12, 1, 1, 2)


# --------------------------------------------------------------------- plans validate
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    ep=st.sampled_from([2, 4, 8]),
    gpn=st.sampled_from([1, 2, 4, 8]),
    extra=st.integers(0, 3),
    experts=st.integers(9, 30),  # the synthetic traces need E > top_k (8)
    chunks=st.integers(0, 8),
)
def test_plans_validate_on_random_shapes(seed, ep, gpn, extra, experts, chunks):
    prof = replace(
        SMALL,
        num_experts=experts,
        dp=ep * 2,
        ep=ep,
        gpus_per_node=gpn,
        slots_per_rank=-(-experts // ep) + extra,
        samples=32,
        group_size=4,
    )
    topo, cost = prof.topology(), prof.cost()
    w0, w1 = list(rp.traces.synthetic(prof, 2, seed))
    first = rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK, placement_chunks=chunks)
    first.validate(w0, topo, prof.token_cap)
    assert (first.placement.phy2log >= 0).all()
    nxt = rp.plan_window(
        w1, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK, previous=first.placement, placement_chunks=chunks
    )
    nxt.validate(w1, topo, prof.token_cap)
    base = rp.plan_window(
        w1, topo, cost, token_cap=prof.token_cap, policy=EPLB_PREV, previous_window=w0, previous=first.placement
    )
    base.validate(w1, topo, prof.token_cap)
    # network moves reported by the stage are the plan's migration rows with bytes
    rep = nxt.report["stage_reports"]["placement"]
    assert int(rep["moves"].sum()) == int((nxt.migration["bytes"] > 0).sum())


def test_copies_of_an_expert_never_share_a_rank():
    prof, topo, cost = setup("small")
    w = windows("small")[0]
    plan = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK).validate(w, topo, prof.token_cap)
    p = plan.placement
    for layer in range(p.num_layers):
        for rank in range(p.num_ranks):
            on = p.rank_experts(layer, rank)
            assert len(set(on.tolist())) == len(on), (layer, rank, on)


# ------------------------------------------------------------------------- migration
def test_unchanged_loads_move_nothing():
    prof, topo, cost = setup("small")
    w = windows("small")[0]
    first = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK)
    again = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK, previous=first.placement)
    again.validate(w, topo, prof.token_cap)
    assert len(again.migration) == 0
    assert again.placement == first.placement
    assert again.report["predicted"]["migration"] == 0.0


def test_drifted_loads_move_fewer_than_a_naive_replacement():
    prof, topo, cost = setup("small")
    w0, w1 = windows("small")
    first = rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK)
    aware = rp.plan_window(w1, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK, previous=first.placement)
    aware.validate(w1, topo, prof.token_cap)
    fresh = rp.plan_window(w1, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK)
    naive = rp._core.migration_diff(
        first.placement.phy2log, fresh.placement.phy2log, w1.num_experts, topo.slots_per_rank, cost.expert_state_bytes
    )
    assert (aware.migration["bytes"] > 0).sum() < (naive[6] > 0).sum()
    rep = aware.report["stage_reports"]["placement"]
    assert set(rep["choice"]) <= {"keep", "fresh", "incremental"}
    assert len(rep["choice"]) == w1.num_layers


def test_from_a_static_placement_with_empty_slots():
    prof, topo, cost = setup("small")
    w = windows("small")[0]
    static = rp.Placement.static(w.num_layers, w.num_experts, topo)
    assert (static.phy2log < 0).any()
    plan = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK, previous=static)
    plan.validate(w, topo, prof.token_cap)
    assert (plan.placement.phy2log >= 0).all()
    pred = plan.report["predicted"]
    static_time = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy="static").report["predicted"][
        "step_time"
    ]
    # the new placement itself is faster; whether the first fill of the empty slots pays for
    # itself is decided on the placement proxy, which on this 4-layer toy is a near tie
    # (known limitation, see the placement report's predicted_* figures)
    assert pred["step_time"] - pred["migration"] < static_time
    assert pred["step_time"] < static_time * 1.005


def test_expensive_migration_keeps_the_placement():
    prof, topo, cost = setup("small")
    w0, w1 = windows("small")
    first = rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK)
    dear = replace(cost, expert_state_bytes=1e16)
    plan = rp.plan_window(w1, topo, dear, token_cap=prof.token_cap, policy=ROUTEPACK, previous=first.placement)
    plan.validate(w1, topo, prof.token_cap)
    assert plan.placement == first.placement and len(plan.migration) == 0


# ------------------------------------------------------------------- policies, options
def test_previous_loads_need_previous_window():
    prof, topo, cost = setup("small")
    w = windows("small")[0]
    for pol in (EPLB_PREV, rp.Policy("routepack", loads="previous")):
        with pytest.raises(ValueError, match="previous_window"):
            rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=pol)


def test_previous_loads_are_used():
    prof, topo, cost = setup("small")
    w0, w1 = windows("small")
    prev = rp.plan_window(w1, topo, cost, token_cap=prof.token_cap, policy=EPLB_PREV, previous_window=w0)
    oracle0 = rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=EPLB)
    assert prev.placement == oracle0.placement
    prev.validate(w1, topo, prof.token_cap)
    rpp = rp.plan_window(
        w1, topo, cost, token_cap=prof.token_cap, policy=rp.Policy("routepack", loads="previous"), previous_window=w0
    )
    rp0 = rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK)
    assert rpp.placement == rp0.placement


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("placement_chunks", -1, "placement_chunks"),
        ("placement_slack", -0.1, "placement_slack"),
        ("placement_explore", 2.0, "placement_explore"),
        ("placement_fluct_evals", 1.5, "placement_fluct_evals"),
        ("placement_migration_aware", "yes", "placement_migration_aware"),
        ("eplb_num_groups", 0, "eplb_num_groups"),
    ],
)
def test_bad_options_are_named(key, value, match):
    prof, topo, cost = setup("small")
    w = windows("small")[0]
    pol = EPLB if key.startswith("eplb") else ROUTEPACK
    with pytest.raises((ValueError, TypeError), match=match):
        rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=pol, **{key: value})


def test_eplb_groups_option_selects_the_policy():
    prof, topo, cost = setup("small")  # 2 nodes per EP group; the model routes without groups
    w = windows("small")[0]
    default = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=EPLB)
    glob = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=EPLB, eplb_num_groups=1)
    hier = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=EPLB, eplb_num_groups=2)
    per_node = rp.plan_window(
        w, topo, cost, token_cap=prof.token_cap, policy=rp.Policy("eplb_hierarchical", "sequential", "none", "window")
    )
    loads = w.layer_expert_load()
    expect_h = rebalance_experts(loads, topo.num_slots, 2, 2, topo.ep)[0]
    expect_g = rebalance_experts(loads, topo.num_slots, 1, 2, topo.ep)[0]
    assert np.array_equal(default.placement.phy2log, expect_g)
    assert np.array_equal(glob.placement.phy2log, expect_g)
    assert np.array_equal(hier.placement.phy2log, expect_h)
    assert np.array_equal(per_node.placement.phy2log, expect_h)


# ------------------------------------------------------------------ quality on `tiny`
def test_tiny_routepack_is_at_least_as_balanced_as_eplb_on_every_layer():
    prof, topo, cost = setup("tiny")
    w = windows("tiny", 1)[0]
    loads = w.layer_expert_load()
    lb = imbalance_lower_bound(loads, topo)
    ours = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=ROUTEPACK).validate(w, topo, prof.token_cap)
    agg = aggregate_imbalance(ours.placement, loads)
    assert (agg >= lb - 1e-12).all()
    assert np.mean(agg / lb) <= 1.01
    for groups in (None, 1):
        opts = {} if groups is None else {"eplb_num_groups": groups}
        base = rp.plan_window(w, topo, cost, token_cap=prof.token_cap, policy=EPLB, **opts)
        base.validate(w, topo, prof.token_cap)
        assert (agg <= aggregate_imbalance(base.placement, loads) + 1e-12).all()
        # per-microbatch imbalance under the same static packing
        assert ours.report["predicted"]["mean_imbalance"] < base.report["predicted"]["mean_imbalance"]


# ------------------------------------------------------------------------ determinism
_HASH_SCRIPT = """
import hashlib, sys
sys.path.insert(0, {tests!r})
import test_placement as t
prof, topo, cost = t.setup("small")
w0, w1 = t.windows("small")
a = t.rp.plan_window(w0, topo, cost, token_cap=prof.token_cap, policy=t.ROUTEPACK)
b = t.rp.plan_window(w1, topo, cost, token_cap=prof.token_cap, policy=t.ROUTEPACK, previous=a.placement)
print(hashlib.sha256(a.placement.phy2log.tobytes() + b.placement.phy2log.tobytes() + b.migration.tobytes()).hexdigest())
"""


def test_byte_identical_across_runs_and_thread_counts():
    script = _HASH_SCRIPT.format(tests=str(Path(__file__).parent))
    outs = set()
    for threads in ("1", "2", "3"):
        env = dict(os.environ, RAYON_NUM_THREADS=threads)
        outs.add(
            subprocess.run(
                [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
            ).stdout.strip()
        )
    assert len(outs) == 1
