"""Issue 13, class 3 on the Python side: wrong results accepted silently. Windows whose counts
are impossible for their lengths, lengths whose total overflows int64, repeated top-k ids,
plan tables edited after their derived tables were built, and a cost model for another expert
count are all refused, naming what is wrong. Each is a hypothesis property over the class."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routepack as rp
from random_plans import TOPOLOGIES, random_case
from routepack import _npz

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


@st.composite
def possible_windows(draw, max_s=5, max_l=3, max_e=6):
    """(seq_lens, expert_tokens, top_k) of a window a router could produce: each token picks
    top_k distinct experts, so every count <= its length and each layer sums to n·k."""
    S, L, E = draw(st.integers(1, max_s)), draw(st.integers(1, max_l)), draw(st.integers(1, max_e))
    k = draw(st.integers(1, E))
    lens = draw(hnp.arrays(np.int64, S, elements=st.integers(1, 30)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = np.zeros((S, L, E), dtype=np.int32)
    for s in range(S):
        for l in range(L):
            for _ in range(lens[s]):
                counts[s, l, rng.choice(E, size=k, replace=False)] += 1
    return lens, counts, k


# ---------------------------------------------------- counts impossible for their lengths


@SETTINGS
@given(possible_windows(), st.data())
def test_possible_counts_are_accepted_and_top_k_kept(case, data):
    lens, counts, k = case
    w = rp.Window(lens, counts, top_k=k)
    assert w.top_k == k and rp.Window(lens, counts).top_k is None
    buf = io.BytesIO()
    w.save(buf)
    buf.seek(0)
    back = rp.Window.load(buf)
    assert back == w and back.top_k == k


@SETTINGS
@given(possible_windows(), st.data())
def test_a_count_above_its_length_names_sample_layer_expert(case, data):
    lens, counts, k = case
    S, L, E = counts.shape
    s, l, e = data.draw(st.integers(0, S - 1)), data.draw(st.integers(0, L - 1)), data.draw(st.integers(0, E - 1))
    bad = counts.copy()
    bad[s, l, e] = lens[s] + data.draw(st.sampled_from([1, 7, 10**6, 2**31 - 1 - int(lens[s])]))
    # the first offender in (sample, layer) order is this one: make the others possible
    with pytest.raises(rp.RoutepackError, match=rf"sample {s}, layer {l}, expert {e} has {bad[s, l, e]} tokens"):
        rp.Window(lens, bad)
    with pytest.raises(rp.RoutepackError, match=rf"sample {s}, layer {l}, expert {e}"):
        rp.Window(lens, bad, top_k=k)


@SETTINGS
@given(possible_windows(), st.data())
def test_a_layer_over_seq_len_times_top_k_names_sample_and_layer(case, data):
    lens, counts, k = case
    S, L, E = counts.shape
    s, l = data.draw(st.integers(0, S - 1)), data.draw(st.integers(0, L - 1))
    row = counts[s, l]
    # one more token on an expert below the length: per-expert fine, the layer one too many
    room = np.flatnonzero(row < lens[s])
    assume(room.size)
    bad = counts.copy()
    bad[s, l, room[0]] += 1
    rp.Window(lens, bad)  # without top_k nothing says how many experts a token picks
    with pytest.raises(
        rp.RoutepackError,
        match=rf"sample {s}, layer {l} has {int(bad[s, l].sum())} tokens over "
        rf"its experts, more than seq_len \* top_k = {lens[s]} \* {k}",
    ):
        rp.Window(lens, bad, top_k=k)


def test_the_issue_examples():
    with pytest.raises(
        rp.RoutepackError, match="sample 0, layer 0, expert 0 has 1000000 tokens but the sample's length is 5"
    ):
        rp.Window([5], np.full((1, 1, 2), [10**6, 0], dtype=np.int32))
    with pytest.raises(rp.RoutepackError, match="sample 1, layer 0 has 5 tokens over its experts"):
        rp.Window([3, 2], np.array([[[2, 2, 2]], [[2, 2, 1]]], dtype=np.int32), top_k=2)


@pytest.mark.parametrize("top_k", [0, -1, 4, 2**40])
def test_top_k_out_of_range(top_k):
    with pytest.raises(rp.RoutepackError, match="top_k"):
        rp.Window([2], np.ones((1, 1, 3), dtype=np.int32), top_k=top_k)


@pytest.mark.parametrize("top_k", [1.0, "2", True, [1]])
def test_top_k_wrong_type(top_k):
    with pytest.raises(rp.RoutepackTypeError, match="top_k"):
        rp.Window([2], np.ones((1, 1, 3), dtype=np.int32), top_k=top_k)


def test_old_window_files_load_without_top_k(tmp_path):
    lens, counts = np.array([3, 4]), np.ones((2, 1, 3), dtype=np.int32)
    _npz.write(tmp_path / "old.npz", seq_lens=lens, expert_tokens=counts)  # as files were written before
    w = rp.Window.load(tmp_path / "old.npz")
    assert w.top_k is None and w == rp.Window(lens, counts)
    _npz.write(tmp_path / "bad.npz", seq_lens=lens, expert_tokens=counts, top_k=np.array(2.5))
    with pytest.raises(rp.RoutepackFileError, match="top_k"):
        rp.Window.load(tmp_path / "bad.npz")
    _npz.write(tmp_path / "wrong.npz", seq_lens=lens, expert_tokens=counts * 3, top_k=np.int64(1))
    with pytest.raises(rp.RoutepackFileError, match="sample 0, layer 0 has 9 tokens"):
        rp.Window.load(tmp_path / "wrong.npz")


@pytest.mark.parametrize("name", ["tiny", "flash_small"])
def test_synthetic_traces_satisfy_the_checks_with_their_top_k(name):
    prof = (
        rp.traces.profile("tiny")
        if name == "tiny"
        else replace(
            rp.traces.profile("flash"),
            name="flash_small",
            num_layers=4,
            attention=("linear",) * 3 + ("full",),
            samples=512,
        )
    )
    for w in rp.traces.synthetic(prof, windows=2):
        rp.Window(w.seq_lens, w.expert_tokens, top_k=prof.top_k)


# --------------------------------------------------------------- routing replay sets top_k


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.integers(0, 2**32 - 1), st.booleans())
def test_replay_layouts_set_top_k_and_refuse_repeats(B, L, k, seed, repeat):
    rng = np.random.default_rng(seed)
    E, T = k + 3, 6
    routed = np.argsort(rng.random((B, T, L, E)), axis=3)[..., :k].astype(np.int32)
    mask = np.zeros((B, T), dtype=np.int8)
    for b in range(B):
        mask[b, rng.choice(T, size=int(rng.integers(1, T + 1)), replace=False)] = 1
    per_sample = [routed[b][mask[b] == 1] for b in range(B)]
    if repeat and k >= 2:
        b = int(rng.integers(B))
        t = int(np.flatnonzero(mask[b])[0])
        routed[b, t, L - 1, 1] = routed[b, t, L - 1, 0]
        per_sample[b][0, L - 1, 1] = per_sample[b][0, L - 1, 0]
        for make in (lambda: rp.Window.from_verl(routed, mask, E), lambda: rp.Window.from_slime(per_sample, E)):
            with pytest.raises(
                rp.RoutepackError,
                match=rf"\(sample {b}\), layer {L - 1} lists expert "
                rf"{routed[b, t, L - 1, 0]} twice",
            ):
                make()
        return
    for w in (
        rp.Window.from_verl(routed, mask, E),
        rp.Window.from_slime(per_sample, E),
        rp.Window.from_slime(per_sample, E, add_last_token=False),
    ):
        assert w.top_k == k


# ------------------------------------------------------------ totals that overflow int64


@SETTINGS
@given(st.lists(st.one_of(st.integers(1, 100), st.integers(2**60, 2**63 - 1)), min_size=1, max_size=6))
def test_total_tokens_never_wraps(lens):
    total = sum(lens)
    counts = np.zeros((len(lens), 1, 1), dtype=np.int32)
    if total > 2**63 - 1:
        with pytest.raises(rp.RoutepackError, match=rf"seq_lens: the {len(lens)} lengths add up to {total} tokens"):
            rp.Window(np.array(lens, dtype=np.int64), counts)
    else:
        assert rp.Window(np.array(lens, dtype=np.int64), counts).total_tokens == total


# ------------------------------------------------------- plan tables cannot go stale

PLAN_ARRAYS = ("sample_rank", "sample_micro", "replicas", "migration")


@SETTINGS
@given(st.integers(0, 10**6))
def test_plan_arrays_are_read_only_and_not_aliased(seed):
    case = random_case(seed, TOPOLOGIES[seed % len(TOPOLOGIES)])
    plan = case.plan
    p = plan.placement
    for arr in (p.phy2log, p.logcnt, p.log2phy, *(getattr(plan, n) for n in PLAN_ARRAYS)):
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = arr
    # the caller's arrays are copied, so editing them later changes nothing in the plan
    rank, phy2log = plan.sample_rank.copy(), p.phy2log.copy()
    mine = rp.Plan(
        rp.Placement(phy2log, p.num_experts, p.slots_per_rank),
        rank,
        plan.sample_micro,
        plan.num_micro,
        plan.replicas,
        plan.migration,
    )
    rank[:] = -1
    phy2log[:] = -1
    assert mine.same_as(plan)
    mine.validate(case.window, case.topo, 10**9)
    # a reassigned field is frozen again on the next check
    mine.sample_rank = plan.sample_rank.copy()
    mine.validate(case.window, case.topo, 10**9)
    assert not mine.sample_rank.flags.writeable


@SETTINGS
@given(st.integers(0, 10**6), st.data())
def test_stale_derived_tables_are_refused(seed, data):
    case = random_case(seed, TOPOLOGIES[seed % len(TOPOLOGIES)])
    p = case.plan.placement
    L, P = p.phy2log.shape
    l = data.draw(st.integers(0, L - 1))
    row = p.phy2log[l]
    pairs = [(a, b) for a in range(P) for b in range(a) if row[a] != row[b]]
    assume(pairs)
    a, b = data.draw(st.sampled_from(pairs))
    placement = rp.Placement(p.phy2log, p.num_experts, p.slots_per_rank)
    placement.phy2log.setflags(write=True)  # the one way in: forcing write access back on
    placement.phy2log[l, [a, b]] = placement.phy2log[l, [b, a]]
    plan = rp.Plan(placement, case.plan.sample_rank, case.plan.sample_micro, case.plan.num_micro)
    with pytest.raises(rp.InvalidPlanError, match=r"placement.log2phy\["):
        plan.validate(case.window, case.topo, 10**9)
    with pytest.raises(rp.InvalidPlanError, match=r"placement.log2phy\["):
        rp.simulate(plan, case.window, case.topo, case.cost)
    # rebuilt from the edited table, the same placement is fine
    fixed = rp.Plan(
        rp.Placement(placement.phy2log, p.num_experts, p.slots_per_rank),
        plan.sample_rank,
        plan.sample_micro,
        plan.num_micro,
    )
    fixed.validate(case.window, case.topo, 10**9)


# ------------------------------------------------- a cost model for another expert count

TINY = rp.traces.profile("tiny")


def small_window(E: int, L: int = 2) -> rp.Window:
    return rp.Window(np.full(8, 20), np.ones((8, L, E), dtype=np.int32), top_k=1)


@SETTINGS
@given(st.integers(2, 12), st.integers(2, 12))
def test_cost_model_for_other_expert_count_is_refused(e_cost, e_window):
    model = rp.ModelShape(2, e_cost, 1, 64, 32)
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    assert cost.num_experts == e_cost
    assert rp.CostModel.from_json(cost.to_json()) == cost
    topo = rp.Topology(2, 2, 2, 6)
    window = small_window(e_window)
    if e_cost == e_window:
        plan = rp.plan_window(window, topo, cost, token_cap=100, policy="static")
        rp.simulate(plan, window, topo, cost)
        return
    words = rf"cost.num_experts: the cost model is for {e_cost} experts but the window has {e_window}"
    with pytest.raises(rp.RoutepackError, match=words):
        rp.plan_window(window, topo, cost, token_cap=100, policy="static")
    agnostic = replace(cost, num_experts=None)  # a hand-built cost model checks nothing
    plan = rp.plan_window(window, topo, agnostic, token_cap=100, policy="static")
    with pytest.raises(rp.RoutepackError, match=words):
        rp.simulate(plan, window, topo, cost)


def test_cost_json_without_num_experts_loads_as_unknown():
    d = json.loads(TINY.cost().to_json())
    assert d["num_experts"] == TINY.num_experts
    del d["num_experts"]
    assert rp.CostModel.from_json(json.dumps(d)).num_experts is None
    with pytest.raises(rp.RoutepackError, match="cost.num_experts"):
        rp.CostModel.from_json(json.dumps({**d, "num_experts": 0}))
    with pytest.raises(rp.RoutepackTypeError, match="cost.num_experts"):
        rp.CostModel.from_json(json.dumps({**d, "num_experts": 1.5}))
    with pytest.raises(rp.RoutepackError, match="cost.expert_groups: 3 does not divide num_experts = 128"):
        rp.CostModel.from_json(json.dumps({**d, "num_experts": 128, "expert_groups": 3}))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4))
def test_a_quad_length_against_window_layers(l_cost, l_window):
    cost = rp.CostModel(1e-9, [1e-12] * l_cost, 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)
    topo = rp.Topology(2, 2, 2, 4)
    window = small_window(4, l_window)
    if l_cost == l_window:
        rp.simulate(rp.plan_window(window, topo, cost, token_cap=100, policy="static"), window, topo, cost)
        return
    words = rf"cost.a_quad: has {l_cost} layers but the window has {l_window}"
    with pytest.raises(rp.RoutepackError, match=words):
        rp.plan_window(window, topo, cost, token_cap=100, policy="static")
    ok = replace(cost, a_quad=[1e-12] * l_window)
    plan = rp.plan_window(window, topo, ok, token_cap=100, policy="static")
    with pytest.raises(rp.RoutepackError, match=words):
        rp.simulate(plan, window, topo, cost)
