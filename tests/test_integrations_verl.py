"""routepack.integrations.verl without verl installed: the Window from verl's batch layout
(R3 and R2, int16 and uint8, pads, truncated recordings) against a per-token reference, and
the DP split / microbatch index lists of plans against the contracts of verl's
``_balance_batch`` and ``rearrange_micro_batches`` (verl 0.9.1 ``seqlen_balancing.py``):
equal counts per rank, every sample once, per-rank index lists tiling the rank's batch in
execution order, the same number on every rank, none empty, none over ``max_token_len``.
tests/test_integrations_verl_real.py runs the same against verl's own objects."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.integrations import verl as rv
from verl_batches import plan_for, reference_counts, verl_batch

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 6),
    prompt=st.integers(1, 6),
    response=st.integers(0, 6),
    layers=st.integers(1, 3),
    k=st.integers(1, 4),
    dtype=st.sampled_from([np.int16, np.uint8]),
    truncate=st.booleans(),
)
def test_window_counts_every_recorded_row(seed, batch, prompt, response, layers, k, dtype, truncate):
    rng = np.random.default_rng(seed)
    vb = verl_batch(
        rng, batch, prompt, response, layers, k, num_experts=k + 3, dtype=dtype, truncate=truncate and k >= 2
    )
    w = rv.window_from_verl(
        routed_experts=vb.routed_experts,
        attention_mask=vb.attention_mask,
        response_mask=vb.response_mask,
        num_experts=vb.num_experts,
    )
    assert w.seq_lens.tolist() == vb.lens.tolist()
    assert w.top_k == k
    np.testing.assert_array_equal(w.expert_tokens, reference_counts(vb))
    # the same from a batch mapping (verl's TensorDict / DataProto.batch), and from torch tensors
    torch = pytest.importorskip("torch")
    fields = {
        "routed_experts": torch.from_numpy(vb.routed_experts),
        "attention_mask": torch.from_numpy(vb.attention_mask),
        "response_mask": torch.from_numpy(vb.response_mask),
    }
    assert rv.window_from_verl(fields, num_experts=vb.num_experts) == w


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 5), k=st.integers(1, 3))
def test_r2_counts_every_real_row(seed, batch, k):
    """R2: the trainer's own forward recorded every real position, the final one too."""
    rng = np.random.default_rng(seed)
    vb = verl_batch(rng, batch, 4, 4, 2, k, num_experts=6)
    from verl_batches import distinct_topk

    for b in range(batch):
        pos = np.flatnonzero(vb.attention_mask[b])
        vb.routed_experts[b, pos] = distinct_topk(rng, len(pos), 2, k, 6)
        vb.recorded[b] = len(pos)
    w = rv.window_from_verl(
        routed_experts=vb.routed_experts, attention_mask=vb.attention_mask, num_experts=6, mode="R2"
    )
    np.testing.assert_array_equal(w.expert_tokens, reference_counts(vb))
    np.testing.assert_array_equal(w.expert_tokens.sum(axis=2), np.repeat(vb.lens[:, None], 2, axis=1) * k)


def test_window_errors_name_the_argument():
    rng = np.random.default_rng(0)
    vb = verl_batch(rng, 3, 4, 4, 2, 2, num_experts=5)
    kw = dict(routed_experts=vb.routed_experts, attention_mask=vb.attention_mask, num_experts=5)
    bad = vb.routed_experts.copy()
    b, t = 1, int(np.flatnonzero(vb.attention_mask[1])[0])
    bad[b, t, 0, 0] = 7
    with pytest.raises(rp.RoutepackError, match=rf"routed_experts\[{b}, {t}\]"):
        rv.window_from_verl(**{**kw, "routed_experts": bad})
    with pytest.raises(rp.RoutepackError, match="attention_mask"):
        rv.window_from_verl(**{**kw, "attention_mask": vb.attention_mask[:, 1:]})
    with pytest.raises(rp.RoutepackError, match="attention_mask: sample 0"):
        rv.window_from_verl(**{**kw, "attention_mask": np.where(np.arange(3)[:, None] == 0, 0, vb.attention_mask)})
    with pytest.raises(rp.RoutepackError, match="mode"):
        rv.window_from_verl(**kw, mode="R1")
    with pytest.raises(rp.RoutepackError, match="num_experts"):
        rv.window_from_verl(**{**kw, "num_experts": 0})
    with pytest.raises(rp.RoutepackTypeError, match="routed_experts"):
        rv.window_from_verl(**{**kw, "routed_experts": vb.routed_experts.astype(np.float32)})
    with pytest.raises(rp.RoutepackError, match="response_mask"):
        rv.window_from_verl(**kw, response_mask=vb.response_mask[:2])
    with pytest.raises(rp.RoutepackError, match="batch: has no 'attention_mask'"):
        rv.window_from_verl({"routed_experts": vb.routed_experts}, num_experts=5)
    with pytest.raises(rp.RoutepackError, match="batch: pass either"):
        rv.window_from_verl({"routed_experts": vb.routed_experts}, num_experts=5, attention_mask=vb.attention_mask)


TOPOS = [(2, 2, 2, 3), (4, 2, 2, 3), (4, 4, 4, 2), (3, 1, 1, 5)]


def random_lens(rng, n, cap):
    """Lengths in [1, cap] with some exactly at the cap (a microbatch of one sample)."""
    lens = rng.integers(1, cap + 1, size=n)
    lens[rng.random(n) < 0.15] = cap
    return lens


def window_of(rng, lens, layers=2, experts=4):
    counts = rng.integers(0, lens[:, None, None] + 1, size=(len(lens), layers, experts)).astype(np.int32)
    return rp.Window(lens, counts)


def check_verl_contracts(plans, windows, cap):
    parts = rv.balance_partitions(plans)
    dp = len(parts)
    total = sum(p.num_samples for p in plans)
    assert isinstance(parts, list) and all(isinstance(p, list) for p in parts)
    assert all(type(i) is int for p in parts for i in p)
    assert len({len(p) for p in parts}) == 1  # equal counts: DataProto.chunk(dp)
    assert sorted(i for p in parts for i in p) == list(range(total))
    np.testing.assert_array_equal(rv.balance_order(plans), [i for p in parts for i in p])
    offset = 0
    for plan, w in zip(plans, windows):
        per_rank = [rv.micro_batch_indices(plan, r) for r in range(dp)]
        assert len({len(m) for m in per_rank}) == 1 == len({plan.num_micro, len(per_rank[0])})
        for r, idx in enumerate(per_rank):
            assert all(isinstance(i, list) and i for i in idx)  # none empty
            flat = [j for i in idx for j in i]
            assert flat == list(range(len(flat)))  # tiles the rank's batch in order
            # the rank's share of this plan, in the order balance_partitions put it
            mine = [s - offset for s in parts[r] if offset <= s < offset + plan.num_samples]
            for m, i in enumerate(idx):
                samples = [mine[j] for j in i]
                assert int(w.seq_lens[samples].sum()) <= cap
                assert all(plan.sample_micro[s] == m and plan.sample_rank[s] == r for s in samples)
        offset += plan.num_samples


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    topo_i=st.integers(0, len(TOPOS) - 1),
    per_rank=st.integers(1, 6),
    cap=st.integers(8, 64),
    policy=st.sampled_from(["routepack", "eplb_oracle", "static"]),
)
def test_plans_meet_verl_contracts(seed, topo_i, per_rank, cap, policy):
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr = TOPOS[topo_i]
    topo = rp.Topology(dp=dp, ep=ep, gpus_per_node=gpn, slots_per_rank=spr)
    w = window_of(rng, random_lens(rng, dp * per_rank, cap))
    plan = plan_for(w, topo, cap, policy, seed % 1000)  # never refuses a window that fits
    check_verl_contracts([plan], [w], cap)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), minibatches=st.integers(1, 3))
def test_minibatch_plans_concatenate(seed, minibatches):
    """verl's keep_minibatch: one plan per PPO mini-batch, indices offset per mini-batch."""
    rng = np.random.default_rng(seed)
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=3)
    windows = [window_of(rng, random_lens(rng, 8, 40)) for _ in range(minibatches)]
    plans = [plan_for(w, topo, 64, "eplb_oracle", 0) for w in windows]
    check_verl_contracts(plans, windows, 64)


def test_equal_count_plan_moves_samples_and_keeps_the_plan_valid():
    rng = np.random.default_rng(3)
    topo = rp.Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=3)
    moved = 0
    for seed in range(20):
        w = window_of(rng, random_lens(rng, 16, 40))
        cost = rp.CostModel(
            a_lin=1e-6,
            a_quad=[1e-9] * 2,
            c_tok=1e-6,
            c_exp=1e-5,
            token_bytes=1e3,
            bw_intra=1e11,
            bw_inter=1e10,
            expert_weight_bytes=1e6,
            expert_grad_bytes=1e6,
            expert_state_bytes=1e7,
        )
        plan = rp.plan_window(w, topo, cost, token_cap=60, seed=seed, anneal_moves=500).validate(w, topo, 60)
        out = rv.equal_count_plan(plan, w, topo, 60, cost)
        out.validate(w, topo, 60)
        assert np.bincount(out.sample_rank, minlength=4).tolist() == [4] * 4
        assert out.num_micro == plan.num_micro and out.placement == plan.placement
        if out is not plan:
            moved += 1
            assert out.report["equal_counts"]["moved"] >= 1 and "predicted" in out.report
    assert moved > 0  # routepack's packing does not balance counts: the repair is exercised


def test_equal_count_plan_refusals_name_the_plan():
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=3)
    w = rp.Window(np.array([10, 10, 10]), np.ones((3, 1, 4), np.int32))
    plan = rp.Plan(rp.Placement.static(1, 4, topo), np.array([0, 0, 1]), np.array([0, 0, 0]), 1)
    with pytest.raises(rp.RoutepackError, match="plan: its 3 samples"):
        rv.equal_count_plan(plan, w, topo, 30)
    # rank 0 runs two full steps of one sample each, rank 1 two steps: counts 2 / 2 already
    w4 = rp.Window(np.array([10, 10, 10, 10]), np.ones((4, 1, 4), np.int32))
    even = rp.Plan(rp.Placement.static(1, 4, topo), np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    assert rv.equal_count_plan(even, w4, topo, 10) is even
    # 3 samples on rank 0 (one step), 1 on rank 1, and no room under the cap on rank 1
    skew = rp.Plan(rp.Placement.static(1, 4, topo), np.array([0, 0, 0, 1]), np.array([0, 0, 0, 0]), 1)
    full = rp.Window(np.array([5, 5, 5, 20]), np.ones((4, 1, 4), np.int32))
    with pytest.raises(rp.InfeasibleError, match="plan: cannot equalise"):
        rv.equal_count_plan(skew, full, topo, 20)
    moved = rv.equal_count_plan(skew, full, topo, 25)  # room for one 5-token sample on rank 1
    assert moved.sample_rank.tolist().count(1) == 2
    with pytest.raises(rp.RoutepackError, match="plans\\[0\\]: DP ranks hold \\[3, 1\\]"):
        rv.balance_partitions(skew)
    with pytest.raises(rp.RoutepackError, match="dp_rank"):
        rv.micro_batch_indices(even, 2)
    with pytest.raises(rp.RoutepackTypeError, match="plans"):
        rv.balance_partitions("plan")


def test_plan_batch_falls_back_to_kk_where_counts_cannot_be_equalised():
    fallbacks = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        topo = rp.Topology(dp=4, ep=4, gpus_per_node=4, slots_per_rank=2)
        cap = int(rng.integers(8, 30))
        w = window_of(rng, random_lens(rng, 4 * int(rng.integers(1, 4)), cap))
        plan = plan_for(w, topo, cap, "routepack", 0)
        assert len(set(np.bincount(plan.sample_rank, minlength=4).tolist())) == 1
        fallbacks += plan.report.get("equal_counts", {}).get("fallback") == "kk"
    assert fallbacks > 0


def test_adapters_import_and_plan_without_torch_or_the_frameworks():
    """The index functions need numpy only; a function that builds a framework's objects
    says which extra it needs."""
    import subprocess
    import sys

    code = """
import sys
for m in ("torch", "verl", "megatron", "tensordict"):
    sys.modules[m] = None
import numpy as np, routepack as rp
from routepack.integrations import verl as rv, slime as rs, megatron as rm
w = rp.Window(np.array([4, 5, 6, 7]), np.ones((4, 1, 4), np.int32))
topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=2)
plan = rp.Plan(rp.Placement.static(1, 4, topo), np.array([0, 1, 0, 1]), np.array([0, 0, 0, 0]), 1)
plan = rv.equal_count_plan(plan, w, topo, 20)
print(rv.balance_partitions(plan), rv.micro_batch_indices(plan, 1), rm.local_experts(plan).tolist())
try:
    rv.rearrange_micro_batches({}, 20, plan, 0)
except ImportError as e:
    print(e)
assert not any(m.split(".")[0] in ("torch", "verl", "megatron") for m in sys.modules if sys.modules[m])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[[0, 2], [1, 3]] [[0, 1]] [[[0, 1], [2, 3]]]" in r.stdout
    assert "rearrange_micro_batches needs verl: pip install 'routepack[verl]'" in r.stdout


def _head(error):
    """The argument an error message names first (``name: ...`` or ``name[i, j]: ...``)."""
    return str(error).split(":")[0].split("[")[0]


def test_every_error_names_an_argument_the_caller_passed():
    """Issue 33's verl cases and their class: an empty batch, k > E, and the other refusals
    of `window_from_verl` and `Window.from_verl` blame an argument of the call (a field of
    ``batch`` counts as ``batch``'s)."""
    rng = np.random.default_rng(2)
    vb = verl_batch(rng, 3, 4, 4, 2, 3, num_experts=5)
    empty = dict(routed_experts=vb.routed_experts[:0], attention_mask=vb.attention_mask[:0])
    cases = [
        (dict(**empty, num_experts=5), {"routed_experts"}),
        (dict(routed_experts=vb.routed_experts, attention_mask=vb.attention_mask, num_experts=2), {"num_experts"}),
        (
            dict(routed_experts=vb.routed_experts, attention_mask=vb.attention_mask[:, :2], num_experts=5),
            {"attention_mask"},
        ),
        (
            dict(routed_experts=vb.routed_experts[..., 0], attention_mask=vb.attention_mask, num_experts=5),
            {"routed_experts"},
        ),
        (
            dict(routed_experts=vb.routed_experts, attention_mask=vb.attention_mask * 2, num_experts=5),
            {"attention_mask"},
        ),
    ]
    for kwargs, names in cases:
        with pytest.raises(rp.RoutepackError) as e:
            rv.window_from_verl(**kwargs)
        assert _head(e.value) in names, (kwargs.keys(), e.value)
        with pytest.raises(rp.RoutepackError) as e:
            rp.Window.from_verl(kwargs["routed_experts"], kwargs["attention_mask"], kwargs["num_experts"])
        assert _head(e.value) in names, e.value
        assert "S+1" not in str(e.value) and "top_k" not in str(e.value)
    with pytest.raises(rp.RoutepackError, match="^batch: holds no samples"):
        rv.window_from_verl(
            {"routed_experts": empty["routed_experts"], "attention_mask": empty["attention_mask"]}, num_experts=5
        )
    with pytest.raises(rp.RoutepackError, match="^num_experts: 2 is fewer than the 3 experts"):
        rp.Window.from_routed_experts(np.zeros((4, 1, 3), np.int16), np.array([0, 4]), 2)


def test_dense_layers_from_the_local_checkpoints_config(tmp_path):
    """A DeepSeek-V3-style checkpoint (layer 0 dense) at ``actor_rollout_ref.model.path``: the
    hook reads its transformers config, counts the MoE rows of verl's routes (L = 3 rows, row 0
    zero) and plans 2 layers; without it the dense row is refused, naming moe_layers."""
    transformers = pytest.importorskip("transformers")
    from routepack.integrations.verl import hooks as vh

    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=6, num_experts_per_tok=2, hidden_size=16
    )
    cfg.save_pretrained(tmp_path)
    trainer_cfg = {"actor_rollout_ref": {"model": {"path": str(tmp_path)}}}
    layers = vh._moe_layers(trainer_cfg, None)
    assert layers is not None and layers.rows == (1, 2) and layers.mtp_numbers == [4]
    assert vh._moe_layers({"actor_rollout_ref": {"model": {"path": "org/not-local"}}}, None) is None
    vb = verl_batch(np.random.default_rng(5), 6, 8, 8, 3, 2, 6)
    vb.routed_experts[:, :, 0] = 0  # the dense layer's zero rows
    inst = vh.VerlInstall(object(), {}, layers=layers)
    rows = inst.moe_rows({"routed_experts": vb.routed_experts})
    assert rows == [1, 2]
    w = rv.window_from_verl(
        routed_experts=vb.routed_experts, attention_mask=vb.attention_mask, num_experts=6, moe_layers=rows
    )
    assert w.num_layers == 2 and np.array_equal(w.counts, reference_counts(vb)[:, 1:])
    with pytest.raises(
        rp.RoutepackError, match=r"routed_experts\[0, \d+\]: .*layer 0 lists expert 0 twice.*moe_layers"
    ):
        rv.window_from_verl(routed_experts=vb.routed_experts, attention_mask=vb.attention_mask, num_experts=6)
