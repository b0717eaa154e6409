"""The `static` policy end to end: validation, .npz round trip, determinism; the data model's
errors; and the synthetic traces' determinism and realism features (docs/design.md, "Synthetic
traces")."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import routepack as rp
from random_plans import random_window
from routepack.simulate import lower_bound_micro

TINY = rp.traces.profile("tiny")


@pytest.fixture(scope="module")
def tiny_window() -> rp.Window:
    return next(rp.traces.synthetic("tiny", 1, seed=0))


def small_setup(seed: int = 0):
    rng = np.random.default_rng(seed)
    topo = rp.Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=3)
    window = random_window(rng, 23, 3, 5, max_len=60)
    model = rp.ModelShape(
        num_layers=3, num_experts=5, top_k=2, hidden=64, expert_ffn=32, attention=["linear", "linear", "full"]
    )
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    return window, topo, cost


def test_static_plan_on_tiny_window_validates(tiny_window):
    topo, cost, cap = TINY.topology(), TINY.cost(), TINY.token_cap
    plan = rp.plan_window(tiny_window, topo, cost, token_cap=cap, policy="static")
    assert plan.validate(tiny_window, topo, cap) is plan
    # what validate promises, checked independently here
    S = tiny_window.num_samples
    assert plan.sample_rank.shape == plan.sample_micro.shape == (S,)
    cells = plan.sample_rank.astype(np.int64) * plan.num_micro + plan.sample_micro
    per_cell = np.bincount(cells, weights=tiny_window.seq_lens, minlength=topo.dp * plan.num_micro)
    assert per_cell.shape == (topo.dp * plan.num_micro,)
    assert (per_cell > 0).all() and per_cell.max() <= cap
    # static placement: expert e on rank e // ceil(E/ep), spare slots empty
    per_rank = -(-tiny_window.num_experts // topo.ep)
    for e in (0, 17, 127):
        slots = np.flatnonzero(plan.placement.phy2log[0] == e)
        assert slots.tolist() == [(e // per_rank) * topo.slots_per_rank + e % per_rank]
    assert (plan.placement.logcnt == 1).all()
    assert len(plan.replicas) == 0 and len(plan.migration) == 0
    pred = plan.report["predicted"]
    assert pred["step_time"] >= pred["ideal_time"] > 0
    assert pred["replication"] == 0 and pred["migration"] == 0
    assert plan.num_micro >= lower_bound_micro(tiny_window, topo, cap)


def test_npz_round_trip(tmp_path):
    window, topo, cost = small_setup()
    prev = rp.Placement(np.roll(rp.Placement.static(3, 5, topo).phy2log, 1, axis=1), 5, 3)
    plan = rp.plan_window(window, topo, cost, token_cap=90, policy="static", previous=prev)
    plan.validate(window, topo, 90)
    assert len(plan.migration) > 0  # the round trip carries migration rows too
    path = tmp_path / "plan.npz"
    plan.save(path)
    back = rp.Plan.load(path)
    assert back.same_as(plan)
    assert back.report == json.loads(json.dumps(plan.report))
    assert back.policy == plan.policy == "static"
    assert back.replicas.dtype == rp.REPLICA_DTYPE and back.migration.dtype == rp.MIGRATION_DTYPE
    back.validate(window, topo, 90)
    a, b = rp.simulate(back, window, topo, cost), rp.simulate(plan, window, topo, cost)
    assert a.summary() == b.summary()
    np.testing.assert_array_equal(a.imbalance, b.imbalance)


def test_same_as_sees_every_decision():
    window, topo, cost = small_setup()
    plan = rp.plan_window(window, topo, cost, token_cap=90, policy="static").validate(window, topo, 90)
    other = rp.Plan(plan.placement, plan.sample_rank.copy(), plan.sample_micro.copy(), plan.num_micro)
    assert other.same_as(plan)
    swapped = plan.sample_rank.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    if swapped.tolist() != plan.sample_rank.tolist():
        assert not rp.Plan(plan.placement, swapped, plan.sample_micro, plan.num_micro).same_as(plan)


def test_digest_follows_the_decisions():
    window, topo, cost = small_setup()
    plan = rp.plan_window(window, topo, cost, token_cap=90, policy="routepack").validate(window, topo, 90)
    copy = rp.Plan(
        plan.placement,
        plan.sample_rank.copy(),
        plan.sample_micro.copy(),
        plan.num_micro,
        plan.replicas.copy(),
        plan.migration.copy(),
    )
    assert copy.digest() == plan.digest() and len(plan.digest()) == 64
    assert plan.num_micro > 1
    for i in range(plan.num_samples):  # a sample moved to another step: another digest
        micro = plan.sample_micro.copy()
        micro[i] = (micro[i] + 1) % plan.num_micro
        assert (
            rp.Plan(plan.placement, plan.sample_rank, micro, plan.num_micro, plan.replicas, plan.migration).digest()
            != plan.digest()
        )


def decisions(plan: rp.Plan) -> bytes:
    return b"".join(
        [
            plan.placement.phy2log.tobytes(),
            plan.sample_rank.tobytes(),
            plan.sample_micro.tobytes(),
            np.int64(plan.num_micro).tobytes(),
            plan.replicas.tobytes(),
            plan.migration.tobytes(),
        ]
    )


def test_plans_are_deterministic(tiny_window):
    topo, cost, cap = TINY.topology(), TINY.cost(), TINY.token_cap
    a = rp.plan_window(tiny_window, topo, cost, token_cap=cap, policy="static", seed=3)
    b = rp.plan_window(tiny_window, topo, cost, token_cap=cap, policy="static", seed=3)
    assert decisions(a) == decisions(b)
    assert a.report["predicted"] == b.report["predicted"]
    # the same window rebuilt from scratch (fresh arrays) gives the same bytes
    again = next(rp.traces.synthetic("tiny", 1, seed=0))
    c = rp.plan_window(again, topo, cost, token_cap=cap, policy="static", seed=3)
    assert decisions(c) == decisions(a)
    for plan in (a, b, c):
        plan.validate(tiny_window, topo, cap)


def test_cost_model_json_round_trip(tmp_path):
    cost = TINY.cost()
    back = rp.CostModel.from_json(cost.to_json())
    assert back == cost
    cost.save(tmp_path / "cost.json")
    assert rp.CostModel.load(tmp_path / "cost.json") == cost
    explicit = rp.CostModel(
        a_lin=1e-9,
        a_quad=[0.0, 2.5e-13],
        c_tok=3e-9,
        c_exp=1e-6,
        token_bytes=4096,
        bw_intra=3.6e11,
        bw_inter=4e10,
        expert_weight_bytes=6e6,
        expert_grad_bytes=1.2e7,
        expert_state_bytes=4.2e7,
    )
    assert rp.CostModel.from_json(explicit.to_json()) == explicit


@pytest.mark.parametrize(
    "text, words",
    [
        ("[1, 2]", "expected an object"),
        ('{"a_lin": 1}', "missing keys"),
        ("not json", "Expecting value"),
    ],
)
def test_cost_model_bad_json(text, words):
    with pytest.raises(ValueError, match=words):
        rp.CostModel.from_json(text)


def test_cost_model_json_unknown_and_bad_values():
    d = json.loads(TINY.cost().to_json())
    with pytest.raises(ValueError, match="unknown keys"):
        rp.CostModel.from_json(json.dumps({**d, "extra": 1}))
    with pytest.raises(ValueError, match="cost.bw_inter"):
        rp.CostModel.from_json(json.dumps({**d, "bw_inter": 0}))
    with pytest.raises(ValueError, match=r"cost.a_quad\[1\]"):
        rp.CostModel.from_json(json.dumps({**d, "a_quad": [0.0, -1.0]}))
    with pytest.raises(TypeError, match="cost.c_tok"):
        rp.CostModel.from_json(json.dumps({**d, "c_tok": "fast"}))


def test_topology_errors_name_the_values():
    with pytest.raises(ValueError, match="dp=6 is not a multiple of ep=4"):
        rp.Topology(dp=6, ep=4, gpus_per_node=4, slots_per_rank=2)
    topo = rp.Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=3)
    with pytest.raises(ValueError, match=r"ep\*slots_per_rank = 2\*3 = 6 < num_experts = 7"):
        topo.check_experts(7)
    window = rp.Window(np.full(8, 5), np.ones((8, 1, 7), dtype=np.int32))
    cost = rp.CostModel(1e-9, [0.0], 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)
    with pytest.raises(ValueError, match="num_experts = 7"):
        rp.plan_window(window, topo, cost, token_cap=100, policy="static")
    with pytest.raises(ValueError, match="topo.ep"):
        rp.Topology(dp=4, ep=0, gpus_per_node=2, slots_per_rank=3)
    with pytest.raises(ValueError, match="divide one another"):
        rp.Topology(dp=12, ep=6, gpus_per_node=4, slots_per_rank=3)


def test_sample_longer_than_cap_is_named():
    window, topo, cost = small_setup()
    lens = window.seq_lens.copy()
    lens[13] = 500
    long = rp.Window(lens, window.expert_tokens)
    with pytest.raises(rp.InfeasibleError, match="sample 13 has 500 tokens"):
        rp.plan_window(long, topo, cost, token_cap=499, policy="static")
    # at exactly the cap it is planned, alone in its microbatch
    plan = rp.plan_window(long, topo, cost, token_cap=500, policy="static")
    plan.validate(long, topo, 500)
    alone = plan.cell_samples(int(plan.sample_rank[13]), int(plan.sample_micro[13]))
    assert alone.tolist() == [13]


def test_plan_validate_against_a_smaller_cap_fails():
    window, topo, cost = small_setup()
    plan = rp.plan_window(window, topo, cost, token_cap=200, policy="static")
    biggest = max(window.seq_lens[plan.cell_samples(d, m)].sum() for d in range(topo.dp) for m in range(plan.num_micro))
    plan.validate(window, topo, int(biggest))
    with pytest.raises(rp.InvalidPlanError, match=f"holds {biggest} tokens, over the cap {biggest - 1}"):
        plan.validate(window, topo, int(biggest) - 1)


# ------------------------------------------------------------------ synthetic traces


def test_synthetic_is_deterministic_for_a_seed():
    a = list(rp.traces.synthetic("tiny", 2, seed=5))
    b = list(rp.traces.synthetic("tiny", 2, seed=5))
    c = next(rp.traces.synthetic("tiny", 1, seed=6))
    assert a[0] == b[0] and a[1] == b[1]
    assert a[0].expert_tokens.tobytes() == b[0].expert_tokens.tobytes()
    assert not a[0] == c
    assert not a[0] == a[1]


def test_synthetic_shape_and_demand(tiny_window):
    w = tiny_window
    assert (w.num_samples, w.num_layers, w.num_experts) == (TINY.samples, TINY.num_layers, TINY.num_experts)
    # every token goes to top_k distinct experts: rows sum to k·n, no expert above n
    assert (w.expert_tokens.sum(axis=2) == TINY.top_k * w.seq_lens[:, None]).all()
    assert (w.expert_tokens <= w.seq_lens[:, None, None]).all()
    assert w.seq_lens.min() >= 1 and w.seq_lens.max() <= TINY.token_cap


def test_truncation_spike_at_max_response(tiny_window):
    """A GRPO group shares its prompt, so responses truncated at max_response tie at
    prompt + max_response: the group maximum is shared far more often than chance (the group
    minimum, with no clip below, serves as the control)."""
    g = tiny_window.seq_lens.reshape(-1, TINY.group_size)
    top, bottom = g.max(axis=1), g.min(axis=1)
    max_ties = (g == top[:, None]).sum(axis=1) >= 2
    min_ties = (g == bottom[:, None]).sum(axis=1) >= 2
    assert max_ties.sum() >= 3 and max_ties.sum() > 3 * min_ties.sum(), (max_ties.sum(), min_ties.sum())
    # the implied prompt length of a tied maximum is a plausible prompt (16 .. max_response/4)
    prompt = top[max_ties] - TINY.max_response
    assert (prompt >= 16).all() and (prompt <= TINY.max_response // 4).all(), prompt
    # nothing is longer than the longest prompt plus the clip
    assert g.max() <= TINY.max_response + TINY.max_response // 4


def test_grpo_groups_correlate_lengths(tiny_window):
    """The share of log-length variance between groups is well above what the same lengths
    shuffled across groups give."""
    logs = np.log(tiny_window.seq_lens.astype(float))
    G = TINY.group_size

    def between(x):
        return x.reshape(-1, G).mean(axis=1).var() / x.var()

    rng = np.random.default_rng(0)
    shuffled = np.mean([between(rng.permutation(logs)) for _ in range(20)])
    assert between(logs) > 0.25 and between(logs) > 3 * shuffled, (between(logs), shuffled)


def test_per_layer_skew_differs(tiny_window):
    load = tiny_window.layer_expert_load()
    cv = load.std(axis=1) / load.mean(axis=1)
    assert cv.max() > 2 * cv.min(), cv


def test_topic_affinity_makes_hot_experts_differ_between_samples(tiny_window):
    """Samples of different prompts disagree on their hottest experts in a layer."""
    hottest = tiny_window.expert_tokens[:, 0, :].argmax(axis=1)
    assert len(np.unique(hottest)) >= 8


def test_drift_between_windows():
    """Popularity drifts: consecutive windows differ, and the distance from the first window
    grows with time, unlike the same profile with drift switched off."""
    small = dataclasses.replace(TINY, samples=256)
    still = dataclasses.replace(small, drift=0.0, topic_drift=0.0)

    def distances(prof):
        ws = list(rp.traces.synthetic(prof, 4, seed=3))
        shares = [w.layer_expert_load() / w.layer_expert_load().sum(axis=1, keepdims=True) for w in ws]
        return [np.abs(shares[0] - s).sum(axis=1).mean() for s in shares[1:]]

    moving, fixed = distances(small), distances(still)
    assert moving[0] > 0.05
    assert moving[2] > moving[0] and moving[2] > 1.5 * fixed[2], (moving, fixed)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        (("huge", 1, 0), ValueError, "unknown profile"),
        (("tiny", 0, 0), ValueError, "windows"),
        (("tiny", 1, -1), ValueError, "seed"),
        (("tiny", 1.5, 0), TypeError, "windows"),
        (("tiny", 1, "0"), TypeError, "seed"),
    ],
)
def test_synthetic_bad_args(args, exc, words):
    with pytest.raises(exc, match=words):
        next(iter(rp.traces.synthetic(*args)))
