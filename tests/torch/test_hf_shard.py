"""`routepack.integrations.hf.shard` (issue 16, item 1): tiny random transformers MoE models
trained expert-parallel on 4 gloo ranks for 3 windows under `routepack.plan_window` plans
(migration and replication between windows, every plan validated), against the same model
trained in one process: losses, final expert and dense weights equal to 1e-5 relative
(fp32), and every MoE layer dispatched exactly the captured routing. Families: Qwen3-MoE
(softmax router, a dense layer among the MoE ones) and DeepSeek-V3 (sigmoid group-limited
router with a score bias, scaled weights, shared experts, a first dense layer). The run
itself is `hf_shard_check` (tests/torch/hf_shard_check.py); one spawn serves both families (four
processes importing torch and transformers cost more than the training). Layouts shard
cannot carry are refused, naming the module."""

from __future__ import annotations

import copy
import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import hf_shard_check as chk  # noqa: E402
import routepack as rp  # noqa: E402
from routepack.errors import RoutepackError, RoutepackTypeError  # noqa: E402
from routepack.integrations import hf, hf_shard  # noqa: E402
from routepack.integrations.hf import families as _hf_families  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

WORLD = 4
TOL = 1e-5
#: The families the installed transformers runs (DeepSeek-V3 and GLM-4.5 from 5.13 on).
RUNS = {f.name for f in _hf_families.FAMILIES if hf.TRANSFORMERS >= f.since}
#: ROUTEPACK_HF_SHARD_ALL=1 runs every shardable family (Qwen2-MoE, OLMoE, Mixtral, GLM-4.5 too)
FAMILIES = tuple(chk.FAMILIES) if os.environ.get("ROUTEPACK_HF_SHARD_ALL") == "1" else ("Qwen3-MoE", "DeepSeek-V3")
FAMILIES = tuple(f for f in FAMILIES if f in RUNS)
CASES = tuple(chk.Case(family=f) for f in FAMILIES)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(chk.train_rank, WORLD, CASES, join_timeout_s=600, pg_timeout_s=120)


@pytest.fixture(scope="module")
def single():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {c.family: chk.train_single(c) for c in CASES}
    finally:
        torch.set_num_threads(before)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("family", FAMILIES)
def test_losses_equal_single_process_training(ranks, single, family):
    want = single[family]["losses"]
    for r in range(WORLD):
        got = ranks[r][family]["losses"]
        assert len(got) == len(want) >= 3
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= TOL, (r, got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_final_weights_equal_single_process_training(ranks, single, family):
    ref = single[family]
    init = chk.experts_of(chk.build_model(chk.Case(family=family)))
    # training moved the experts: equality below is not that of untouched weights
    assert max(rel(w.numpy(), r) for pair, rp_ in zip(init, ref["experts"]) for w, r in zip(pair, rp_)) > 1e-3
    for r in range(WORLD):
        f = ranks[r][family]
        assert len(f["experts"]) == len(ref["experts"])
        for got, want in zip(f["experts"], ref["experts"]):
            for g, w in zip(got, want):
                assert g.shape == w.shape and rel(g, w) <= TOL
        # every parameter but the experts is the model's own, under its own name
        assert set(f["dense"]) == {n for n in ref["dense"] if not n.endswith(("gate_up_proj", "down_proj"))}
        worst = max(rel(v, ref["dense"][n]) for n, v in f["dense"].items())
        assert worst <= TOL, (r, worst)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_routes_exactly_the_captured_routing(ranks, family):
    assert all(ranks[r][family]["routing_equal"] for r in range(WORLD))


@pytest.mark.parametrize("family", FAMILIES)
def test_plans_migrated_and_replicated_experts(ranks, family):
    f = ranks[0][family]
    assert f["moved_rows"] > 0 and f["replica_rows"] > 0
    assert sum(ranks[r][family]["migrated_bytes"] for r in range(WORLD)) > 0
    assert sum(ranks[r][family]["replica_tokens"] for r in range(WORLD)) > 0  # copies computed tokens
    assert all(ranks[r][family]["phy2log"] == f["phy2log"] for r in range(WORLD))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_optimizer_owns_the_tensors_the_experts_compute_with(ranks, family):
    for r in range(WORLD):
        assert ranks[r][family]["experts_owned"] and ranks[r][family]["no_full_experts"]


def test_a_bad_token_mask_on_one_rank_makes_every_rank_raise(ranks):
    for family in FAMILIES:
        for r in range(WORLD):
            msg = ranks[r][family]["bad_mask"]
            want = "the mask given to start_micro has 2 entries" if r == 1 else "EP rank(s) [1] passed invalid inputs"
            assert want in msg, (family, r, msg)


# ------------------------------------------------------------- refusals (no process group)


@functools.lru_cache(maxsize=None)
def small(family: str):
    return chk.build_model(chk.Case(family=family))


def a_placement(model, slots_per_rank=3, ep=4):
    shape = hf.model_shape(model)
    topo = rp.Topology(ep, ep, 2, slots_per_rank)
    return rp.Placement.static(shape.num_layers, shape.num_experts, topo), topo


def test_shard_is_exported_from_hf():
    assert hf.shard is hf_shard.shard and hf.ShardedMoE is hf_shard.ShardedMoE


def test_gpt_oss_is_refused_naming_the_module():
    import transformers as tf

    torch.manual_seed(0)
    m = tf.GptOssForCausalLM(
        tf.GptOssConfig(
            **{**chk.COMMON, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 8}
        )
    )
    placement, topo = a_placement(m)
    with pytest.raises(RoutepackError, match=r"model\.layers\.0\.mlp \(GptOssMLP\): GPT-OSS experts .*not supported"):
        hf.shard(m, placement, topo=topo)


@pytest.mark.parametrize(
    "break_it,pattern",
    [
        ("act", r"act_fn GELU.* is not SiLU"),
        ("bias", r"biased"),
        ("transposed", r"transposed"),
        ("shape", r"expected gate_up_proj \[E=8, 2I, H\]"),
        ("class", r"expected the Qwen3-MoE experts class"),
    ],
)
def test_expert_layouts_shard_cannot_carry_are_refused(break_it, pattern):
    m = copy.deepcopy(small("Qwen3-MoE"))
    experts = m.model.layers[2].mlp.experts
    if break_it == "act":
        experts.act_fn = torch.nn.GELU()
    elif break_it == "bias":
        experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(8, 32))
    elif break_it == "transposed":
        experts.is_transposed = True
    elif break_it == "shape":
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:4].clone())
    else:
        experts.__class__ = type("MyExperts", (type(experts),), {})
    placement, topo = a_placement(m)
    with pytest.raises(RoutepackError, match=r"model\.layers\.2\.mlp\.experts.*" + pattern):
        hf.shard(m, placement, topo=topo)


def test_mixtral_jitter_noise_is_refused():
    m = copy.deepcopy(small("Mixtral"))
    for layer in m.model.layers:
        layer.mlp.jitter_noise = 0.1
    placement, topo = a_placement(m)
    with pytest.raises(RoutepackError, match=r"router_jitter_noise=0\.1"):
        hf.shard(m, placement, topo=topo)


def test_plans_for_another_model_or_topology_and_other_objects_are_refused():
    if "DeepSeek-V3" not in RUNS:
        pytest.skip(f"DeepSeek-V3 needs transformers >= 5.13, found {hf.transformers.__version__}")
    m = small("Qwen3-MoE")
    placement, topo = a_placement(m)
    other, _ = a_placement(small("DeepSeek-V3"), slots_per_rank=5)
    with pytest.raises(RoutepackError, match=r"placement has L=2, E=16; the model has 2 MoE layers of E=8"):
        hf.shard(m, other, topo=topo)
    with pytest.raises(RoutepackError, match=r"12 slots \(3 per rank\), topo 20 \(5 per rank\)"):
        hf.shard(m, placement, topo=rp.Topology(4, 4, 2, 5))
    with pytest.raises(RoutepackTypeError, match="plan: expected routepack.Plan or routepack.Placement"):
        hf.shard(m, placement.phy2log, topo=topo)
    with pytest.raises(RoutepackTypeError, match="topo: expected routepack.Topology"):
        hf.shard(m, placement, topo=(4, 4, 2, 3))
    with pytest.raises(RoutepackTypeError, match="model: expected a torch.nn.Module"):
        hf.shard("model", placement, topo=topo)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(RoutepackError, match="Sequential has no MoE block routepack can shard"):
        hf.shard(dense, placement, topo=topo)


@pytest.mark.parametrize("family", [f for f in chk.FAMILIES])
def test_every_shardable_family_has_blocks_shard_can_carry(family):
    if family not in RUNS:
        pytest.skip(f"{family} needs a newer transformers than {hf.transformers.__version__}")
    blocks = hf_shard.moe_blocks(small(family))
    assert len(blocks) == hf.model_shape(small(family)).num_layers
    assert {b.family for b in blocks} == {family} and family in hf_shard.SHARDABLE
