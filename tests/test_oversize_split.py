"""``oversize="split"`` (docs/design.md, "Samples over the cap"): a sample over the cap split over
a context-parallel group of ``topo.cp`` ranks. A window with 5% of its samples over the cap plans
with both modes ("alone" and "split", cp = 2 and 4) under every preset, with and without a
pipeline; every plan validates, each split sample sits at the first rank of a CP group with the
group's other cells at its microbatch empty, and routepack's row certificate stays true.
`simulate` prices the ring as documented (checked against the formula written out here), and bad
input is refused by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import _core
from test_oversize import CAP, cost_for

PRESETS = ["routepack", "static", "eplb_oracle", "hot_n", "relibra"]


def window_over_cap(seed: int = 0, samples: int = 200, share: float = 0.05, layers: int = 4, experts: int = 8):
    """``samples`` samples within the cap but ``share`` of them, which are 1.2-2x the cap (so a
    CP group of 2 holds each)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(20, CAP // 2, size=samples)
    over = rng.choice(samples, size=int(round(share * samples)), replace=False)
    lens[over] = rng.integers(int(1.2 * CAP), 2 * CAP + 1, size=len(over))
    counts = np.zeros((samples, layers, experts), dtype=np.int64)
    for s, n in enumerate(lens):
        for l in range(layers):
            counts[s, l] = rng.multinomial(2 * n, rng.dirichlet(np.ones(experts) * 0.5))
    counts = np.minimum(counts, lens[:, None, None])
    return rp.Window(lens, counts), np.sort(over)


def check_split_cells(plan: rp.Plan, window: rp.Window, topo: rp.Topology, over: np.ndarray) -> None:
    """Each split sample alone at the first rank of a CP group, the group's other cells at its
    microbatch holding nothing else; every other cell non-empty and within the cap."""
    m_n, cp = plan.num_micro, topo.cp
    cell = plan.sample_rank.astype(np.int64) * m_n + plan.sample_micro
    size = np.bincount(cell, minlength=topo.dp * m_n)
    tokens = np.bincount(cell, weights=window.seq_lens, minlength=topo.dp * m_n)
    owned = np.zeros(topo.dp * m_n, dtype=bool)
    for s in over:
        assert plan.sample_rank[s] % cp == 0 and size[cell[s]] == 1
        for j in range(1, cp):
            c = cell[s] + j * m_n
            assert size[c] == 0
            owned[c] = True
    rest = np.setdiff1d(np.flatnonzero(~owned), cell[over])
    assert (size[rest] >= 1).all() and (tokens[rest] <= CAP).all()


@pytest.mark.parametrize("pipeline", [dict(), dict(pp=2)])
@pytest.mark.parametrize("policy", PRESETS)
def test_a_window_5pc_over_the_cap_plans_alone_and_split(policy, pipeline):
    window, over = window_over_cap(seed=len(policy))
    assert len(over) == 10 and (window.seq_lens[over] > CAP).all()
    cost = cost_for(4)
    for mode, cp in (("alone", 1), ("split", 2), ("split", 4)):
        topo = rp.Topology(8, 4, 4, 4, cp=cp, **pipeline)
        plan = rp.plan_window(window, topo, cost, token_cap=CAP, policy=policy, oversize=mode)
        plan.validate(window, topo, CAP)  # the mode from the report
        plan.validate(window, topo, CAP, oversize=mode)
        for other in {"refuse", "alone"} - {mode}:
            with pytest.raises(rp.InvalidPlanError):
                plan.validate(window, topo, CAP, oversize=other)
        extra = {"cp": cp} if mode == "split" else {}
        assert plan.report["oversize"] == {"mode": mode, "samples": over.tolist(), "token_cap": CAP, **extra}
        if mode == "split":
            check_split_cells(plan, window, topo, over)
        res = rp.simulate(plan, window, topo, cost)
        assert res.lower_bound_time <= res.step_time
        assert res.step_time == plan.report["predicted"]["step_time"]
        assert plan.num_micro >= topo.min_micro and plan.num_micro % topo.micro_multiple == 0
        if policy == "routepack":
            # the choice may keep verl's rows where they run faster: the certificate is the
            # packing stage's own (its rows are the fewest any packing can use)
            pk = plan.report["packing"].get("own", plan.report["packing"])
            # a split sample is cp full rows in every valid plan, an alone one one
            rows = np.where(window.seq_lens > CAP, max(cp, 1) * CAP, window.seq_lens)
            assert pk["rows_lower_bound"]["L1"] == -(-int(rows.sum()) // CAP)
            assert pk["certified"] and pk["rows"] == pk["rows_lower_bound"]["rows"]
            kept = topo.dp * plan.num_micro
            assert kept == pk["rows"] if "chosen" not in plan.report["packing"] else kept >= pk["rows"]


def test_split_rows_are_certified_against_the_true_minimum():
    # 6 samples of 10 tokens under a cap of 10, one of 25 split over cp = 4 ranks (4 full rows):
    # 10 rows at least, 12 on 4 ranks; the rest fill the 8 cells left only 6 ways: infeasible
    lens = np.array([10, 10, 10, 10, 10, 10, 25])
    counts = np.zeros((7, 1, 2), dtype=np.int32)
    counts[:, 0, 0] = lens
    topo = rp.Topology(4, 4, 4, 2, cp=4)
    with pytest.raises(rp.InfeasibleError, match="cannot fill"):
        rp.plan_window(rp.Window(lens, counts), topo, cost_for(1), token_cap=10, oversize="split")
    # with 2 more samples of 5 tokens: 4 + 7 = 11 rows at least, 12 on 4 ranks
    lens = np.array([10, 10, 10, 10, 10, 10, 25, 5, 5])
    counts = np.zeros((9, 1, 2), dtype=np.int32)
    counts[:, 0, 0] = lens
    window = rp.Window(lens, counts)
    plan = rp.plan_window(window, topo, cost_for(1), token_cap=10, oversize="split").validate(window, topo, 10)
    pk = plan.report["packing"]
    assert plan.num_micro == 3 and pk["certified"] and pk["rows_lower_bound"]["rows"] == 12
    check_split_cells(plan, window, topo, np.array([6]))


@pytest.mark.parametrize("cp, n, gpus_per_node", [(2, 30, 2), (4, 70, 4), (4, 70, 2)])
def test_ring_attention_is_priced_as_documented(cp, n, gpus_per_node):
    """One sample of n tokens over a cap of 20 split over cp ranks, no routed tokens: the step is
    each layer's slowest CP rank, 3 passes of a_lin·⌈n/cp⌉ + a_quad·n²/cp plus, on a layer with
    quadratic attention, cp − 1 KV blocks of ⌈n/cp⌉ tokens at token_bytes each over the ring's
    slowest link (between nodes where the group spans two)."""
    layers = 2
    window = rp.Window(np.array([n]), np.zeros((1, layers, cp), dtype=np.int32))
    topo = rp.Topology(cp, cp, gpus_per_node, 1, cp=cp)
    cost = cost_for(layers)
    plan = rp.plan_window(window, topo, cost, token_cap=20, policy="static", oversize="split")
    plan.validate(window, topo, 20)
    assert plan.num_micro == 1 and plan.sample_rank.tolist() == [0]
    res = rp.simulate(plan, window, topo, cost)
    block = -(-n // cp)
    bw = cost.bw_intra if gpus_per_node >= cp else cost.bw_inter
    want = 0.0
    for a_quad in cost.a_quad:
        kv = (cp - 1) * block * cost.token_bytes / bw if a_quad > 0 else 0.0
        want += 3 * (cost.a_lin * block + a_quad * n * n / cp + kv)
    assert res.step_time == pytest.approx(want, rel=1e-12)
    assert res.attention == pytest.approx(want, rel=1e-12)


def test_routed_tokens_split_in_proportion():
    """Piece j of a split sample sends ⌊c·T_{j+1}/n⌋ − ⌊c·T_j/n⌋ of a count c (T_j: the tokens of
    pieces 0..j), summing to c; every other sample is its own piece."""
    rng = np.random.default_rng(3)
    lens = np.array([7, 45, 12, 31])
    counts = rng.integers(0, 40, size=(4, 2, 3)).astype(np.int32)
    counts = np.minimum(counts, lens[:, None, None]).astype(np.int32)
    window = rp.Window(lens, counts)
    rank, micro = np.array([0, 4, 1, 0], dtype=np.int32), np.array([0, 1, 1, 2], dtype=np.int32)
    plens, pcounts, prank, pmicro = _core.split_pieces(lens, window.counts, 20, 3, rank, micro)
    assert plens.tolist() == [7, 15, 15, 15, 12, 11, 10, 10]
    assert prank.tolist() == [0, 4, 5, 6, 1, 0, 1, 2] and pmicro.tolist() == [0, 1, 1, 1, 1, 2, 2, 2]
    for s, first in ((1, 1), (3, 5)):
        t = np.concatenate([[0], np.cumsum(plens[first : first + 3])])
        c = counts[s].astype(np.int64)
        want = [c * t[j + 1] // lens[s] - c * t[j] // lens[s] for j in range(3)]
        assert all((pcounts[first + j] == want[j]).all() for j in range(3))
        assert (pcounts[first : first + 3].sum(axis=0) == c).all()
    assert (pcounts[0] == counts[0]).all() and (pcounts[4] == counts[2]).all()


def test_bad_input_is_named():
    window, over = window_over_cap()
    cost = cost_for(4)
    # the default refuses, suggesting both ways out
    with pytest.raises(rp.InfeasibleError) as e:
        rp.plan_window(window, rp.Topology(8, 4, 4, 4, cp=2), cost, token_cap=CAP)
    assert f"sample {over[0]} has" in str(e.value) and 'oversize="split"' in str(e.value)
    # no CP group to split over
    with pytest.raises(rp.RoutepackError, match=r"topo.cp.*cp >= 2, got 1"):
        rp.plan_window(window, rp.Topology(8, 4, 4, 4), cost, token_cap=CAP, oversize="split")
    # a sample longer than cp x cap
    long = window.seq_lens.copy()
    long[over[1]] = 2 * CAP + 1
    w2 = rp.Window(long, window.counts)
    with pytest.raises(
        rp.InfeasibleError, match=rf"sample {over[1]} has {2 * CAP + 1} tokens, more than topo.cp x token_cap"
    ):
        rp.plan_window(w2, rp.Topology(8, 4, 4, 4, cp=2), cost, token_cap=CAP, oversize="split")
    for pack in (_core.pack_sequential, _core.pack_kk):
        with pytest.raises(rp.InfeasibleError, match=rf"sample {over[1]} has"):
            pack(long, CAP, 8, oversize="split", cp=2)
        with pytest.raises(rp.RoutepackError, match="topo.cp"):
            pack(window.seq_lens, CAP, 8, oversize="split")
    # a split plan moved off its CP group's first rank, or sharing its cells, is refused by name
    topo = rp.Topology(8, 4, 4, 4, cp=2)
    plan = rp.plan_window(window, topo, cost, token_cap=CAP, policy="static", oversize="split")
    s = int(over[0])
    bad = plan.sample_rank.copy()
    bad[s] += 1
    plan.sample_rank = bad
    with pytest.raises(rp.InvalidPlanError, match=rf"sample {s} is over the cap and split over a CP group"):
        plan.validate(window, topo, CAP)
    bad[s] -= 1
    # a sample within the cap whose cell keeps another, moved into the split sample's second cell
    cell = bad.astype(np.int64) * plan.num_micro + plan.sample_micro
    size = np.bincount(cell)
    t = next(int(x) for x in np.flatnonzero(window.seq_lens <= CAP) if size[cell[x]] >= 2)
    bad[t] = bad[s] + 1
    micro = plan.sample_micro.copy()
    micro[t] = micro[s]
    plan.sample_rank, plan.sample_micro = bad, micro
    with pytest.raises(rp.InvalidPlanError, match=rf"runs a piece of sample {s}"):
        plan.validate(window, topo, CAP)


def _refuses_split(calls, window, topo) -> None:
    plan = rp.plan_window(window, topo, cost_for(4), token_cap=CAP, policy="static", oversize="split")
    over = window_over_cap()[1]
    for call in calls:
        with pytest.raises(rp.RoutepackError, match=re.escape(f'oversize="split" (samples {over.tolist()}')) as e:
            call(plan)
        assert "context-parallel" in str(e.value)


def test_the_glue_refuses_a_split_plan_by_name():
    """No trainer glue runs context parallelism: a split plan is refused where plans enter it
    (`routepack.torch`'s `check_plan`; verl's and slime's batch mapping through `plans_list` /
    `rank_cells`), naming oversize="split"; an "alone" plan passes the same gate."""
    pytest.importorskip("torch")
    from routepack.integrations.shared.arrays import plans_list, rank_cells
    from routepack.integrations.verl.split import balance_partitions, micro_batch_indices
    from routepack.torch.runner import PlanRunner

    window, _ = window_over_cap()
    topo = rp.Topology(8, 4, 4, 4, cp=2)
    calls = [
        lambda p: plans_list(p),
        lambda p: plans_list([p]),
        lambda p: rank_cells(p, 0),
        lambda p: micro_batch_indices(p, 0),
        lambda p: balance_partitions([p]),
        # the check runs before the runner reads anything of itself
        lambda p: PlanRunner.check_plan(object.__new__(PlanRunner), p, window),
    ]
    _refuses_split(calls, window, topo)
    alone = rp.plan_window(window, topo, cost_for(4), token_cap=CAP, policy="static", oversize="alone")
    assert len(rank_cells(alone, 0)) == alone.num_micro and plans_list(alone) == [alone]


def test_the_megatron_runner_refuses_a_split_plan_by_name():
    """The Megatron runner's `check_plan` refuses a split plan the same way, before it reads
    anything of itself."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from routepack.integrations.megatron.runner import MegatronRunner

    window, _ = window_over_cap()
    topo = rp.Topology(8, 4, 4, 4, cp=2)
    _refuses_split(
        [lambda p: MegatronRunner.check_plan(object.__new__(MegatronRunner), p, window, None, CAP)], window, topo
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    shape=st.sampled_from([(4, 2, 2, 4, 2), (8, 4, 4, 2, 2), (8, 4, 2, 2, 4), (8, 8, 4, 1, 4)]),
    policy=st.sampled_from(PRESETS),
    pp=st.sampled_from([1, 2]),
)
def test_random_windows_split_validly(seed, shape, policy, pp):
    """Random windows with 1-4 samples over the cap (up to cp x cap): the split plan validates,
    its split samples sit alone at a CP group's first rank, and the step is at or above the
    bound, which the plan does not move."""
    dp, ep, gpn, spr, cp = shape
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(40, 200))
    k = int(rng.integers(1, 5))
    n = 3 * dp * pp + k + int(rng.integers(0, 3 * dp))
    lens = rng.integers(1, cap // 4 + 1, size=n)
    over = np.sort(rng.choice(n, size=k, replace=False))
    lens[over] = rng.integers(cap + 1, cp * cap + 1, size=k)
    experts = ep * spr
    counts = np.minimum(rng.integers(0, 2 * cap, size=(n, 2, experts)), lens[:, None, None]).astype(np.int32)
    window = rp.Window(lens, counts)
    topo = rp.Topology(dp, ep, gpn, spr, cp=cp, pp=pp)
    cost = cost_for(2)
    plan = rp.plan_window(window, topo, cost, token_cap=cap, policy=policy, oversize="split", previous_window=window)
    plan.validate(window, topo, cap)
    m_n = plan.num_micro
    cell = plan.sample_rank.astype(np.int64) * m_n + plan.sample_micro
    size = np.bincount(cell, minlength=dp * m_n)
    for s in over:
        assert plan.sample_rank[s] % cp == 0 and size[cell[s]] == 1
        assert all(size[cell[s] + j * m_n] == 0 for j in range(1, cp))
    res = rp.simulate(plan, window, topo, cost)
    assert res.lower_bound_time <= res.step_time
    static = rp.plan_window(window, topo, cost, token_cap=cap, policy="static", oversize="split")
    assert rp.simulate(static, window, topo, cost).lower_bound_time == pytest.approx(res.lower_bound_time, rel=1e-12)
