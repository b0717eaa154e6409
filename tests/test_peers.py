"""The per-microbatch exact balancers as baselines (docs/design.md, Baselines): MoonEP and UltraEP.

Every plan goes through `Plan.validate`. MoonEP's plans give every rank of an NVLink domain
exactly its share of the domain's tokens in every exchange; UltraEP's keep at most its spare
slots a rank and never raise a domain's peak; both copy inside a domain only; their plans say
``replica_timing="after_router"`` and `simulate` exposes their forward weight copies, which a
prefetched plan hides behind attention.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_replication import SHAPES, make_case

import routepack as rp
from routepack import _core
from routepack.compare import BASELINES
from routepack.policies import PRESETS, Policy


def exchange_loads(plan: rp.Plan, window: rp.Window, topo: rp.Topology) -> np.ndarray:
    """int64 [G, M, L, ep]: tokens each EP rank computes under the plan (the flow's counts)."""
    g_n = topo.num_groups
    return np.asarray(_core.rank_tokens(plan, window.seq_lens, window.counts, topo)).reshape(
        g_n, plan.num_micro, window.num_layers, topo.ep
    )


def domains(topo: rp.Topology) -> list:
    rpn = min(topo.domain, topo.ep)
    return [slice(d * rpn, (d + 1) * rpn) for d in range(topo.ep // rpn)]


def test_presets_and_best_baseline():
    assert PRESETS["moonep"] == Policy("static", "kk", "moonep", loads="window")
    assert PRESETS["ultraep"] == Policy("static", "kk", "ultraep", loads="window")
    assert {"moonep", "ultraep"} <= set(BASELINES)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), shape=st.integers(0, len(SHAPES) - 1))
def test_moonep_balances_every_domain_exactly(seed, shape):
    window, topo, cost, cap = make_case(seed, shape)
    topo = dataclasses.replace(topo, replica_slots=64)
    plan = rp.plan_window(window, topo, cost, cap, policy="moonep")
    plan.validate(window, topo, cap)
    assert plan.replica_timing == "after_router"
    base = rp.plan_window(window, topo, cost, cap, policy=Policy("static", "kk", "none"))
    after, before = exchange_loads(plan, window, topo), exchange_loads(base, window, topo)
    for d in domains(topo):
        a, b = after[..., d], before[..., d]
        assert (a.max(-1) - a.min(-1) <= 1).all()
        assert (a.sum(-1) == b.sum(-1)).all()  # tokens stay in their domain
    for r in plan.replicas:
        assert r["src_rank"] // min(topo.domain, topo.ep) == r["dst_rank"] // min(topo.domain, topo.ep)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), shape=st.integers(0, len(SHAPES) - 1), redundant=st.integers(0, 3))
def test_ultraep_keeps_its_slots_and_lowers_peaks(seed, shape, redundant):
    window, topo, cost, cap = make_case(seed, shape)
    plan = rp.plan_window(
        window, topo, cost, cap, policy="ultraep", replication_redundant=redundant, replication_min_tokens=4
    )
    plan.validate(window, topo, cap)
    base = rp.plan_window(window, topo, cost, cap, policy=Policy("static", "kk", "none"))
    after, before = exchange_loads(plan, window, topo), exchange_loads(base, window, topo)
    for d in domains(topo):
        assert (after[..., d].max(-1) <= before[..., d].max(-1)).all()
    rows = plan.replicas
    if redundant == 0:
        assert len(rows) == 0
    cells = {}
    for r in rows:
        key = (r["group"], r["micro"], r["layer"], r["dst_rank"])
        cells[key] = cells.get(key, 0) + 1
    assert max(cells.values(), default=0) <= min(redundant, topo.replica_slots)


def test_ultraep_min_tokens_and_gain():
    window, topo, cost, cap = make_case(3, 0)
    none = rp.plan_window(window, topo, cost, cap, policy=Policy("static", "kk", "none"))
    small = rp.plan_window(window, topo, cost, cap, policy="ultraep", replication_min_tokens=1)
    large = rp.plan_window(window, topo, cost, cap, policy="ultraep", replication_min_tokens=10**6)
    assert len(large.replicas) == 0  # no quota reaches a million tokens
    assert len(small.replicas) > 0
    imb = lambda p: rp.simulate(p, window, topo, cost, cap).mean_imbalance  # noqa: E731
    assert imb(small) < imb(none)


def test_after_router_copies_are_exposed():
    """The same copies cost more when fetched after the router: the forward copies no longer
    hide behind the layer's attention; the backward return still does."""
    window, topo, cost, cap = make_case(5, 0)
    cost = dataclasses.replace(cost, expert_weight_bytes=4e6, expert_grad_bytes=8e6, a_lin=2e-6)
    topo = dataclasses.replace(topo, replica_slots=64)
    live = rp.plan_window(window, topo, cost, cap, policy="moonep")
    assert len(live.replicas) > 0
    pre = dataclasses.replace(live, replica_timing="prefetch")
    s_live, s_pre = rp.simulate(live, window, topo, cost, cap), rp.simulate(pre, window, topo, cost, cap)
    assert s_live.replication > s_pre.replication >= 0.0
    assert s_live.step_time - s_pre.step_time == pytest.approx(s_live.replication - s_pre.replication, rel=1e-9)
    # with replica_prefetch off both are exposed in full: the timing makes no difference
    full = dataclasses.replace(cost, replica_prefetch=False)
    assert rp.simulate(live, window, topo, full, cap).step_time == rp.simulate(pre, window, topo, full, cap).step_time


def test_replica_timing_is_saved_and_hashed():
    window, topo, cost, cap = make_case(1, 1)
    plan = rp.plan_window(window, topo, cost, cap, policy="ultraep", replication_min_tokens=1)
    buf = io.BytesIO()
    plan.save(buf)
    back = rp.Plan.load(io.BytesIO(buf.getvalue()))
    assert back.replica_timing == "after_router" and back.same_as(plan) and back.digest() == plan.digest()
    assert dataclasses.replace(plan, replica_timing="prefetch").digest() != plan.digest()
    with pytest.raises(rp.RoutepackError, match="replica_timing"):
        dataclasses.replace(plan, replica_timing="later")


def test_moonep_buffers_cap_copies():
    window, topo, cost, cap = make_case(7, 0)
    topo = dataclasses.replace(topo, replica_slots=64)
    plan = rp.plan_window(window, topo, cost, cap, policy="moonep", replication_buffers=1)
    per = {}
    for r in plan.replicas:
        key = (r["group"], r["micro"], r["layer"], r["dst_rank"])
        per.setdefault(key, set()).add(int(r["expert"]))
    assert per and max(len(v) for v in per.values()) == 1
    with pytest.raises(rp.RoutepackError, match="replication_buffers"):
        rp.plan_window(window, topo, cost, cap, policy="moonep", replication_buffers=-1)
    with pytest.raises(rp.RoutepackError, match="replication_min_tokens"):
        rp.plan_window(window, topo, cost, cap, policy="ultraep", replication_min_tokens=0)


def test_rack_scale_domain_lets_copies_cross_nodes():
    """On nodes of 2 GPUs joined into one NVLink domain the copies go anywhere in the group;
    with every node its own domain they stay in the node."""
    window, topo, cost, cap = make_case(11, 1)  # (8, 4, 2, 5, 16): ep 4 over nodes of 2
    topo = dataclasses.replace(topo, replica_slots=64)
    per_node = rp.plan_window(window, topo, cost, cap, policy="moonep")
    rack = dataclasses.replace(topo, nvlink_domain=8)
    whole = rp.plan_window(window, rack, cost, cap, policy="moonep")
    whole.validate(window, rack, cap)
    crossing = lambda p: sum(int(r["src_rank"]) // 2 != int(r["dst_rank"]) // 2 for r in p.replicas)  # noqa: E731
    assert crossing(per_node) == 0 and crossing(whole) > 0
    loads = exchange_loads(whole, window, rack)
    assert (loads.max(-1) - loads.min(-1) <= 1).all()
