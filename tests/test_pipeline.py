"""The pipeline in the cost model (docs/design.md, "Pipeline parallelism") against an independent
simulator: `tests/pipeline_reference.py` runs Megatron-Core's own 1F1B and interleaved orders
(``megatron.core.pipeline_parallel.schedules``) as an event loop.

* the schedule alone: ``_core.pipeline_makespan`` (the core's schedule) and the event loop agree
  to 1e-9 on random (pp, vpp, microbatch count, operation and send times);
* the whole step: `simulate` under ``Topology(pp=..., vpp=...)`` against the numpy re-implementation
  of the cost model (`test_simulate_reference.reference`, per exchange) split by pass as the
  design says and scheduled by the event loop, with per-stage migration and gradient sums;
* ``pp = 1`` is the old simulator, bit for bit (the golden digests and every other test pin it).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import routepack as rp
from routepack import _core
from random_plans import migration_rows, random_cost, random_layout, random_phy2log, random_replicas, random_window
from test_simulate_reference import link_bytes, link_time, reference

pytest.importorskip("megatron.core.pipeline_parallel.schedules")
from pipeline_reference import simulate_pipeline, stage_order  # noqa: E402


def _times(rng: np.random.Generator, micro: int, chunks: int):
    spread = 10 ** rng.uniform(-1, 1, size=(micro, chunks))
    fwd = rng.uniform(0.1, 1.0, size=(micro, chunks)) * spread
    bwd = fwd * rng.uniform(1.0, 3.0, size=(micro, chunks))
    p2p = rng.uniform(0.0, 0.5, size=(micro, max(chunks - 1, 0))) * (rng.random() < 0.8)
    return fwd, bwd, p2p


@pytest.mark.parametrize("seed", range(300))
def test_schedule_agrees_with_megatrons_orders(seed):
    rng = np.random.default_rng(seed)
    pp = int(rng.integers(2, 6))
    vpp = int(rng.choice([1, 1, 2, 3]))
    if vpp > 1:
        micro = pp * int(rng.integers(1, 5))  # Megatron's interleaved rule
    else:
        micro = int(rng.integers(1, 3 * pp + 1))  # fewer than pp too: Megatron runs them
    kind = ["1f1b", "1f1b", "forward", "backward"][seed % 4]
    fwd, bwd, p2p = _times(rng, micro, pp * vpp)
    got, busy = _core.pipeline_makespan(pp, vpp, kind, fwd, bwd, p2p)
    want, want_busy = simulate_pipeline(pp, vpp, fwd, bwd, p2p, kind)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=0)
    np.testing.assert_allclose(busy, want_busy, rtol=1e-9, atol=0)
    assert got >= busy.max() * (1 - 1e-12)


def test_orders_by_hand():
    # Megatron's 1F1B on stage 0 of 4 with 6 microbatches: 3 warm-up forwards, then pairs
    order = stage_order(4, 1, 6, 0, "1f1b")
    assert [o[0] + str(o[1]) for o in order] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    # equal stages: (M + pp - 1)·(tf + tb); interleaving divides the bubble by vpp
    one = lambda shape, v: np.full(shape, float(v))  # noqa: E731
    assert _core.pipeline_makespan(4, 1, "1f1b", one((8, 4), 2), one((8, 4), 4), one((8, 3), 0))[0] == 66.0
    assert _core.pipeline_makespan(4, 2, "1f1b", one((8, 8), 1), one((8, 8), 2), one((8, 7), 0))[0] == 57.0


def test_pipeline_makespan_refuses_bad_input():
    z = np.zeros((4, 4))
    with pytest.raises(rp.RoutepackError, match="kind"):
        _core.pipeline_makespan(4, 1, "zigzag", z, z, np.zeros((4, 3)))
    with pytest.raises(rp.RoutepackError, match="fwd"):
        _core.pipeline_makespan(4, 2, "1f1b", z, z, np.zeros((4, 3)))
    with pytest.raises(rp.RoutepackError, match="pp"):
        _core.pipeline_makespan(1, 2, "1f1b", z, z, np.zeros((4, 1)))


# ---- the whole step ------------------------------------------------------------------------

#: (dp, ep, gpus_per_node, slots_per_rank, pp, vpp)
PIPELINES = [(4, 2, 2, 3, 2, 1), (4, 4, 8, 2, 2, 2), (8, 4, 2, 2, 4, 1), (2, 2, 1, 2, 3, 2), (4, 2, 4, 2, 2, 1)]


def _case(seed: int):
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr, pp, vpp = PIPELINES[seed % len(PIPELINES)]
    base = rp.Topology(dp, ep, gpn, spr)
    chunks = pp * vpp
    if rng.random() < 0.5:
        layers_per_stage = tuple(int(x) for x in rng.integers(1, 3, size=chunks))
        num_layers = sum(layers_per_stage)
    else:
        layers_per_stage, num_layers = None, chunks * int(rng.integers(1, 3))
    topo = replace(base, pp=pp, vpp=vpp, layers_per_stage=layers_per_stage)
    num_experts = int(rng.integers(max(1, base.num_slots // 2), base.num_slots + 1))
    micro = pp * int(rng.integers(1, 3)) if vpp > 1 else int(rng.integers(pp, 2 * pp + 1))
    samples = dp * micro + int(rng.integers(0, dp + 1))
    window = random_window(rng, samples, num_layers, num_experts)
    phy2log = random_phy2log(rng, num_layers, num_experts, base)
    rank, mic = random_layout(rng, samples, dp, micro)
    replicas = random_replicas(rng, phy2log, base, micro, num_experts)
    cost = random_cost(rng, num_layers)
    migration = migration_rows(random_phy2log(rng, num_layers, num_experts, base), phy2log, num_experts, spr, 1e6)
    plan = rp.Plan(rp.Placement(phy2log, num_experts, spr), rank, mic, micro, replicas, migration)
    return window, base, topo, cost, plan


def _expected(window, base, topo, cost, plan, passes=("forward", "backward")):
    """The step under the pipeline from the numpy reference's exchanges: each exchange split by
    pass (compute ×1 forward, ×2 backward; one dispatch + combine each; the exposed copies on
    the update's forward, the gradient reduction on its backward), summed per (microbatch,
    chunk), sends from each cell's tokens over the stages' link, scheduled by the event loop."""
    ref = reference(plan, window, base, cost, None)
    ex = ref["exchanges"]
    G, M, L = ex["attention"].shape
    compute1 = (ex["attention"] + ex["expert"]) / 3.0  # one unit of compute (the reference's ×3)
    comm1 = ex["all_to_all"] / 2.0  # one dispatch + combine (the reference's ×2)
    bounds = topo.chunk_bounds(L)
    chunks, pp, vpp = topo.pp * topo.vpp, topo.pp, topo.vpp
    chunk_of = np.searchsorted(bounds, np.arange(L), side="right") - 1
    upd_fwd = max(i for i in range(passes.index("backward")) if passes[i] == "forward")
    tokens = np.zeros((topo.dp, M))
    np.add.at(tokens, (plan.sample_rank, plan.sample_micro), window.seq_lens)
    group_times, works = [], []
    for g in range(G):
        per_pass = []
        for i, p in enumerate(passes):
            t = compute1[g] * (1 if p == "forward" else 2) + comm1[g]
            if i == upd_fwd:
                t = t + ex["replication"][g, :, :, 0]
            if i == passes.index("backward"):
                t = t + ex["replication"][g, :, :, 1]
            op = np.zeros((M, chunks))
            for l in range(L):
                op[:, chunk_of[l]] += t[:, l]
            per_pass.append(op)
        sends = np.zeros((M, chunks - 1))
        for c in range(chunks - 1):
            for r in range(topo.ep):
                d = g * topo.ep + r
                a, b = (c % pp) * topo.dp + d, ((c + 1) % pp) * topo.dp + d
                bw = cost.bw_intra if a // topo.gpus_per_node == b // topo.gpus_per_node else cost.bw_inter
                sends[:, c] = np.maximum(sends[:, c], tokens[d] * cost.token_bytes / bw)
        total, busy = 0.0, np.zeros(pp)
        if passes == ("forward", "backward"):
            runs = [("1f1b", per_pass[0], per_pass[1])]
        else:  # ("forward", "forward", "backward"): a forward-only run, then 1F1B
            runs = [("forward", per_pass[0], per_pass[0]), ("1f1b", per_pass[1], per_pass[2])]
        for kind, f, b in runs:
            t, bz = simulate_pipeline(pp, vpp, f, b, sends, kind)
            total, busy = total + t, busy + bz
        group_times.append(total)
        works.append(busy.max())
    critical = int(np.argmax(group_times))
    stage_of = chunk_of % pp
    mig = [0.0] * pp
    for s in range(pp):
        rows = plan.migration[stage_of[plan.migration["layer"]] == s]
        mig[s] = link_time(
            *link_bytes([(int(r["src_rank"]), int(r["dst_rank"]), float(r["bytes"])) for r in rows], base), cost
        )
    red = [0.0] * pp
    for s in range(pp):
        n = sum(
            int((np.bincount(row[row >= 0], minlength=window.num_experts) > 1).sum())
            for l, row in enumerate(plan.placement.phy2log)
            if stage_of[l] == s
        )
        ring = 2 * (base.ep - 1) / base.ep * n * cost.expert_grad_bytes
        bw = cost.bw_inter if base.ep > base.gpus_per_node else (cost.bw_reduce or cost.bw_intra)
        red[s] = ring / bw if base.ep > 1 else 0.0
    step = group_times[critical] + max(mig) + max(red)
    return step, np.array(group_times), critical, group_times[critical] - works[critical]


@pytest.mark.parametrize("seed", range(60))
def test_simulate_under_a_pipeline_matches_the_event_loop(seed):
    window, base, topo, cost, plan = _case(seed)
    passes = ("forward", "backward") if seed % 3 else ("forward", "forward", "backward")
    cost = replace(cost, passes=passes)
    res = rp.simulate(plan, window, topo, cost)
    step, groups, critical, bubble = _expected(window, base, topo, cost, plan, passes)
    np.testing.assert_allclose(res.step_time, step, rtol=1e-9)
    np.testing.assert_allclose(res.group_times, groups, rtol=1e-9)
    np.testing.assert_allclose(res.pipeline_bubble, bubble, rtol=1e-9, atol=1e-15 * step)
    assert res.critical_group == critical
    # the busiest stage's parts, the bubble, migration and the gradient sum make the step
    parts = res.attention + res.expert + res.all_to_all + res.replication - res.hidden
    np.testing.assert_allclose(
        parts + res.pipeline_bubble + res.migration + res.redundant_grads, res.step_time, rtol=1e-9
    )
    # every stage's work is a share of the flat step's exchanges, so a group's pipeline takes
    # at least a pp-th of its flat time (the lower bound's argument, docs/design.md)
    flat = rp.simulate(plan, window, base, cost)
    assert flat.pipeline_bubble == 0.0
    assert (res.group_times >= flat.group_times / topo.pp * (1 - 1e-12)).all()
    # and so the lower bound, divided by pp, stays a bound (docs/design.md, "Lower bound", part 8)
    assert res.lower_bound_time <= res.step_time
    np.testing.assert_allclose(res.lower_bound_time, flat.lower_bound_time / topo.pp, rtol=1e-15)


def test_topology_pipeline_fields():
    t = rp.Topology(8, 4, 4, 2, pp=4, vpp=2)
    assert (t.min_micro, t.micro_multiple) == (4, 4)
    assert t.chunk_bounds(16) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert t.stage_layers(1, 16) == [2, 3, 10, 11]
    assert rp.Topology(8, 4, 4, 2, pp=2).micro_multiple == 1
    u = rp.Topology(4, 2, 2, 2, pp=2, layers_per_stage=(3, 1))
    assert u.stage_layers(0, 4) == [0, 1, 2] and u.stage_layers(1, 4) == [3]
    for kwargs, match in [
        (dict(vpp=2), "topo.vpp"),
        (dict(pp=0), "topo.pp"),
        (dict(cp=3), "topo.cp"),
        (dict(pp=2, layers_per_stage=(1,)), "topo.layers_per_stage"),
        (dict(pp=2, layers_per_stage=(1, 0)), r"topo.layers_per_stage\[1\]"),
    ]:
        with pytest.raises(rp.RoutepackError, match=match):
            rp.Topology(4, 2, 2, 2, **kwargs)
    with pytest.raises(rp.RoutepackError, match="topo.layers_per_stage"):
        rp.Topology(4, 2, 2, 2, pp=3).chunk_bounds(4)


def test_validate_enforces_megatrons_microbatch_rule():
    window = rp.Window(np.full(12, 5), np.ones((12, 4, 4), dtype=np.int32))
    base = rp.Topology(2, 2, 2, 2)
    placement = rp.Placement.static(4, 4, base)
    cell = np.arange(12) % 6  # 2 ranks x 3 microbatches
    plan = rp.Plan(placement, (cell // 3).astype(np.int32), (cell % 3).astype(np.int32), 3)
    plan.validate(window, replace(base, pp=2), 100)
    plan.validate(window, replace(base, pp=3, layers_per_stage=(2, 1, 1)), 100)
    with pytest.raises(rp.InvalidPlanError, match="at least 4 microbatches"):
        plan.validate(window, replace(base, pp=4), 100)
    with pytest.raises(rp.InvalidPlanError, match="multiple of 2"):
        plan.validate(window, replace(base, pp=2, vpp=2), 100)
    with pytest.raises(rp.RoutepackError, match="topo.layers_per_stage"):
        plan.validate(window, replace(base, pp=3), 100)


def test_routepack_orders_each_groups_steps_to_shrink_the_bubble():
    import itertools

    from test_oversize import CAP, cost_for, window_with_long_samples

    window, _ = window_with_long_samples(share=0.0, samples=40)
    topo = rp.Topology(4, 2, 2, 4, pp=4)
    cost = cost_for(4)
    policy = rp.Policy("routepack", "routepack", "none")
    plan = rp.plan_window(window, topo, cost, token_cap=CAP, policy=policy)
    order = plan.report["packing"]["order"]
    assert order["after"] <= order["before"] and order["evaluations"] > 0
    # it prices steps as simulate does (no replicas here): its time is the plan's pipeline
    res = rp.simulate(plan, window, topo, cost)
    np.testing.assert_allclose(res.group_times.max(), order["after"], rtol=1e-12)
    # against every order of each group's steps, with the other groups' steps as planned
    M = plan.num_micro
    assert 2 <= M <= 6
    group = plan.sample_rank // topo.ep
    for g in range(topo.num_groups):
        best = np.inf
        for perm in itertools.permutations(range(M)):
            micro = np.where(group == g, np.asarray(perm)[plan.sample_micro], plan.sample_micro)
            p = rp.Plan(plan.placement, plan.sample_rank, micro, M)
            best = min(best, rp.simulate(p, window, topo, cost).group_times[g])
        assert res.group_times[g] <= best * (1 + 1e-9), (g, res.group_times[g], best)


def test_bench_tables_show_the_bubble_under_a_pipeline():
    from routepack.compare import compare, format_table, summarise
    from routepack.sweep import format_sweep, summarise_sweep, sweep_policies
    from test_oversize import CAP, cost_for, window_with_long_samples

    windows = [window_with_long_samples(seed=s, share=0.0, samples=48)[0] for s in range(3)]
    topo = rp.Topology(4, 2, 2, 4, pp=2, vpp=2)
    rows = compare(windows, topo, cost_for(4), CAP, ["static", "eplb_oracle", "routepack"])
    summary = summarise(rows)
    table = format_table(summary)
    assert "bubble" in table and "pipeline bubble / step time" in table
    by = {s["policy"]: s for s in summary}
    assert 0 < by["routepack"]["bubble"] < 1 and 0 < by["best baseline"]["bubble"] < 1
    flat = summarise(compare(windows, replace(topo, pp=1, vpp=1), cost_for(4), CAP, ["static", "routepack"]))
    assert "bubble" not in format_table(flat)
    assert rp.traces.profile("flash_pp").topology().pp == 4 and rp.traces.profile("flash_pp").topology().vpp == 2
    combos = [rp.Policy("static", "sequential", "none"), rp.Policy("routepack", "routepack", "routepack")]
    srows = compare(windows, topo, cost_for(4), CAP, sweep_policies(combos))
    assert "bubble" in format_sweep(summarise_sweep(srows, combos))
