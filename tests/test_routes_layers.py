"""`routepack.routes.MoELayers`: which rows of a route tensor are MoE layers, read from the
model's own config, checked against the layers the frameworks' own model builders make
(transformers' modeling code on tiny configs; Megatron-Core's ``GPTModel`` with its decoder
and MTP block specs, on CPU), and a DeepSeek-V3-shaped toy (first layer dense, 2 MoE layers,
expert groups, one MTP layer) planned from verl-layout routes with a dense row."""

import os
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import routes
from routepack.routes import MoELayers, moe_layer_numbers
from verl_batches import cost_model

transformers = pytest.importorskip("transformers")


def tiny(name, **kw):
    cls = getattr(transformers, name)
    return cls(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=64, **kw)


#: transformers configs of each layer-pattern family, and the MoE layers their modeling code builds.
HF_CASES = [
    (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=4,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=2,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        [1, 2, 3],
    ),
    ("Qwen3MoeConfig", dict(num_hidden_layers=4, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2), [0, 2, 3]),
    (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=4, decoder_sparse_step=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16
        ),
        [1, 3],
    ),
    (
        "Glm4MoeConfig",
        dict(num_hidden_layers=3, first_k_dense_replace=2, n_routed_experts=8, num_experts_per_tok=2),
        [2],
    ),
    (
        "Llama4TextConfig",
        dict(num_hidden_layers=4, interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1),
        [1, 3],
    ),
    ("HYV3Config", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), [1, 2]),
    (
        "Ernie4_5_MoeConfig",
        dict(num_hidden_layers=4, moe_layer_start_index=1, moe_layer_interval=1, moe_num_experts=4, moe_k=2),
        [1, 2, 3],
    ),
    ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2), [0, 1]),
]


@pytest.mark.parametrize("name,kw,want", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_transformers_patterns_are_the_layers_the_model_builds(name, kw, want):
    torch = pytest.importorskip("torch")
    cfg = tiny(name, **kw)
    with torch.device("meta"):  # the modules only: which layers hold experts
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    built = [
        i
        for i, layer in enumerate(model.model.layers)
        if hasattr(getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None), "experts")
    ]
    assert built == want
    layers = MoELayers.from_config(cfg)
    assert list(layers.rows) == want and layers.num_layers == cfg.num_hidden_layers
    n = cfg.num_hidden_layers
    # an engine's [T, L, k] routes (L = num_hidden_layers) count the MoE rows; a MoE-only tensor all
    assert layers.moe_layers(n) == (None if len(want) == n else want)
    assert layers.moe_layers(len(want)) is None


def test_deepseek_v3_hf_config_names_its_mtp_layer():
    cfg = tiny("DeepseekV3Config", num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256)
    layers = MoELayers.from_config(cfg)
    assert layers.rows == tuple(range(3, 61)) and (layers.num_mtp, layers.mtp) == (1, 1)  # num_nextn_predict_layers
    assert layers.numbers[0] == 4 and layers.mtp_numbers == [62]
    assert layers.moe_layers(61) == list(range(3, 61)) and layers.moe_layers(62) == list(range(3, 62))
    assert set(layers.unplanned()) == {62} and "routes live" in layers.unplanned()[62]
    assert layers.unplanned(62) == {}
    with pytest.raises(rp.RoutepackError, match="routed: 60 rows on the layer axis.*61 rows.*58.*62"):
        layers.moe_layers(60)


@settings(max_examples=60, deadline=None)
@given(pattern=st.lists(st.booleans(), min_size=1, max_size=12), freq=st.integers(1, 5), mtp=st.integers(0, 2))
def test_megatron_freq_and_plan_keys(pattern, freq, mtp):
    n = len(pattern)
    for cfg in ({"num_layers": n, "moe_layer_freq": freq, "mtp_num_layers": mtp or None},):
        layers = MoELayers.from_config(cfg)
        assert list(layers.rows) == [i for i in range(n) if i % freq == 0]  # Megatron's int rule
    if not any(pattern):
        with pytest.raises(rp.RoutepackError, match="marks no layer as MoE"):
            MoELayers.from_config({"num_layers": n, "moe_layer_freq": [int(p) for p in pattern]})
        return
    layers = MoELayers.from_config(
        {"num_layers": n, "moe_layer_freq": [int(p) for p in pattern], "mtp_num_layers": mtp}
    )
    assert list(layers.rows) == [i for i, p in enumerate(pattern) if p]
    assert layers.mtp == (mtp if pattern[-1] else 0)  # MTP layers take the last decoder layer's spec
    numbers = moe_layer_numbers(
        {"num_layers": n, "moe_layer_freq": [int(p) for p in pattern], "mtp_num_layers": mtp}, mtp=True
    )
    for i, number in enumerate(numbers):  # plan layer <-> Megatron layer_number, both ways
        assert layers.plan_layer(number, mtp_planned=True) == i
    for number in range(1, n + 1):
        if not pattern[number - 1]:
            with pytest.raises(rp.RoutepackError, match=f"layer {number} is dense"):
                layers.plan_layer(number)
    for number in layers.mtp_numbers:
        with pytest.raises(rp.RoutepackError, match="MTP layer.*routes live"):
            layers.plan_layer(number)


def test_config_errors_name_the_field():
    with pytest.raises(rp.RoutepackError, match="config.moe_layer_freq: has 2 entries for num_layers = 3"):
        MoELayers.from_config({"num_layers": 3, "moe_layer_freq": [0, 1]})
    with pytest.raises(rp.RoutepackError, match=r"config.moe_layer_freq\[1\]: expected 0 or 1, got 2"):
        MoELayers.from_config({"num_layers": 2, "moe_layer_freq": [1, 2]})
    with pytest.raises(rp.RoutepackError, match="neither num_layers"):
        MoELayers.from_config({"hidden_size": 8})
    with pytest.raises(rp.RoutepackError, match="config: expected a model config"):
        MoELayers.from_config(None)
    with pytest.raises(rp.RoutepackTypeError, match="moe_layers: got a MoELayers"):
        rp.Window.from_routed_experts(np.zeros((1, 2, 1), np.int16), [0, 1], 2, moe_layers=MoELayers(2, (1,)))


# ---------------------------------------------------------------- the DeepSeek-V3-shaped toy
E, K, GROUPS, GROUP_TOPK = 8, 2, 4, 2


@pytest.fixture(scope="module")
def megatron_world():
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core", reason="megatron-core not importable")
    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_cpu

    with megatron_cpu.applied():
        owns_world = not dist.is_initialized()
        if owns_world:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=1)
        owns_mpu = not parallel_state.model_parallel_is_initialized()
        if owns_mpu:
            parallel_state.initialize_model_parallel()
        yield torch
        if owns_mpu:
            parallel_state.destroy_model_parallel()
        if owns_world:
            dist.destroy_process_group()


def deepseek_toy_config(torch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=3,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1],  # DeepSeek-V3's first_k_dense_replace, as Megatron takes it
        mtp_num_layers=1,
        moe_router_num_groups=GROUPS,  # node-limited routing: experts from GROUP_TOPK of 4 groups
        moe_router_group_topk=GROUP_TOPK,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )


def grouped_topk(rng, tokens):
    """int16 [tokens, K]: K distinct experts from GROUP_TOPK of the GROUPS groups, as a
    group-limited router picks them."""
    size = E // GROUPS
    out = np.zeros((tokens, K), dtype=np.int16)
    for t in range(tokens):
        groups = rng.choice(GROUPS, GROUP_TOPK, replace=False)
        pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups])
        out[t] = rng.choice(pool, K, replace=False)
    return out


def test_deepseek_v3_toy_plans_from_verl_routes_with_a_dense_row(megatron_world):
    torch = megatron_world
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter

    cfg = deepseek_toy_config(torch)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=64,
        mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
    )
    routers = {name: m.layer_number for name, m in model.named_modules() if isinstance(m, TopKRouter)}
    layers = MoELayers.from_config(cfg)
    # the routers Megatron built are plan layers 0 and 1 (decoder layers 2, 3) and the MTP layer (4)
    assert sorted(routers.values()) == moe_layer_numbers(cfg, mtp=True) == [2, 3, 4]
    assert routers["mtp.layers.0.transformer_layer.mlp.router"] == 4 and layers.mtp_numbers == [4]
    assert [layers.plan_layer(n) for n in (2, 3)] == [0, 1]

    # verl's legacy batch: prompts left-padded to P, responses right-padded to R, int16
    # [B, P+R, L=3, k], the rollout's n-1 rows from the first real prompt token, row 0 (dense) zero
    rng = np.random.default_rng(3)
    B, P, R = 12, 6, 10
    routed = np.zeros((B, P + R, 3, K), dtype=np.int16)
    mask = np.zeros((B, P + R), dtype=np.int64)
    want = np.zeros((B, 2, E), dtype=np.int64)
    for b in range(B):
        p, r = int(rng.integers(1, P + 1)), int(rng.integers(1, R + 1))
        mask[b, P - p : P + r] = 1
        engine = np.zeros((p + r - 1, 3, K), dtype=np.int16)  # what vLLM / SGLang return
        engine[:, 1], engine[:, 2] = grouped_topk(rng, p + r - 1), grouped_topk(rng, p + r - 1)
        routed[b, P - p : P - p + p + r - 1] = engine
        for layer in (1, 2):
            np.add.at(want[b, layer - 1], engine[:, layer].reshape(-1), 1)
    with pytest.raises(rp.RoutepackError, match="layer 0 lists expert 0 twice"):  # the refusal before moe_layers
        routes.verl_summary(routed, E, mask)
    rows = layers.moe_layers(routed.shape[2])
    assert rows == [1, 2]
    window = rp.Window.from_summary(routes.verl_summary(routed, E, mask, moe_layers=rows))
    assert window.num_layers == 2 and np.array_equal(window.counts, want)
    assert np.array_equal(window.seq_lens, mask.sum(1))
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=5)
    cost = cost_model(2, E)
    # routepack's stages without the preset's choice, which may keep the static placement on a toy
    stages = rp.Policy("routepack", "routepack", "routepack")
    plan = rp.plan_window(window, topo, cost, token_cap=4 * (P + R), policy=stages, seed=0, anneal_moves=500)
    plan.validate(window, topo, 4 * (P + R))
    assert plan.placement.phy2log.shape == (2, 10)  # keyed by MoE layer: Megatron layers 2 and 3
    assert (plan.placement.logcnt > 1).any()  # redundant copies placed from the MoE rows' loads
