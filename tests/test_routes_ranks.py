"""`routepack.routes.ranks`: the routes each rank replays equal what the trainers' own code
hands their routers: slime's ``prepare_routed_experts_for_routing_replay`` (verbatim,
tests/slime_reference/route_excerpts.py) for every TP / CP / SP / allgather-CP setting, verl's
``preprocess_thd_engine`` (installed) followed by Megatron's ``_split_along_first_dim``; and
the layers of each pipeline chunk equal to slime's ``fill_routing_replay`` walk over
Megatron's own layer offsets (pp, vpp, uneven first/last stages, dense layers)."""

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack.routes import MoELayers
from routepack.routes import ranks
from route_engines import moe_topk

torch = pytest.importorskip("torch")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fake_mpu(tp, tp_rank, cp, cp_rank):
    return types.SimpleNamespace(
        get_tensor_model_parallel_world_size=lambda: tp,
        get_tensor_model_parallel_rank=lambda: tp_rank,
        get_context_parallel_world_size=lambda: cp,
        get_context_parallel_rank=lambda: cp_rank,
    )


def random_rows(rng, lens, layers, k, experts):
    return [moe_topk(rng, n * layers, experts, k).reshape(n, layers, k) for n in lens]


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    lens=st.lists(st.integers(2, 20), min_size=1, max_size=4),
    tp=st.integers(1, 3),
    cp=st.integers(1, 3),
    mult=st.integers(1, 3),
    sp=st.booleans(),
    allgather=st.booleans(),
    data=st.data(),
)
def test_slime_split_equals_slimes_own(seed, lens, tp, cp, mult, sp, allgather, data):
    import route_excerpts as slime

    rng = np.random.default_rng(seed)
    layers, k, experts = 3, 2, 5
    recorded = random_rows(rng, [n - 1 for n in lens], layers, k, experts)  # [T - 1, L, k] each
    tp_rank, cp_rank = data.draw(st.integers(0, tp - 1)), data.draw(st.integers(0, cp - 1))
    slime.mpu = fake_mpu(tp, tp_rank, cp, cp_rank)
    want = slime.prepare_routed_experts_for_routing_replay(
        [torch.from_numpy(r) for r in recorded],
        [torch.zeros(n) for n in lens],
        num_experts=experts,
        data_pad_size_multiplier=mult,
        sequence_parallel=sp,
        allgather_cp=allgather,
    )
    take = ranks.slime_take(lens, tp, tp_rank, cp, cp_rank, mult, sp, allgather)
    got = ranks.gather(take, np.concatenate(recorded), "slime", experts)
    assert np.array_equal(got, want.numpy())


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    tp=st.integers(1, 3),
    cp=st.integers(1, 3),
    data=st.data(),
)
def test_verl_split_equals_verls_own(seed, lens, tp, cp, data, monkeypatch_module):
    import verl.models.mcore.util as vu
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    rng = np.random.default_rng(seed)
    layers, k, experts = 3, 2, 6
    rows = [r.astype(np.int16) for r in random_rows(rng, lens, layers, k, experts)]  # a row per token
    tp_rank, cp_rank = data.draw(st.integers(0, tp - 1)), data.draw(st.integers(0, cp - 1))
    monkeypatch_module.setattr(vu, "mpu", fake_mpu(tp, tp_rank, cp, cp_rank))
    nested = torch.nested.as_nested_tensor([torch.from_numpy(r) for r in rows], layout=torch.jagged)
    packed, _, _ = vu.preprocess_thd_engine(nested, pre_process=True)
    group = types.SimpleNamespace(size=lambda: tp, rank=lambda: tp_rank)
    want = _split_along_first_dim(packed.squeeze(0), group)
    got = ranks.gather(ranks.verl_take(lens, tp, tp_rank, cp, cp_rank), np.concatenate(rows))
    assert np.array_equal(got, want.numpy())


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def slime_walk(config, vp_stage, pp_rank):
    """slime's ``fill_routing_replay`` layer walk (slime/backends/megatron_utils/actor.py)
    for one model chunk, with Megatron's own offset and count for ``pp_rank``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers_to_build = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    out = []
    for layer_id in range(offset, offset + num_layers_to_build):
        if isinstance(config.moe_layer_freq, int):
            if layer_id % config.moe_layer_freq != 0:
                continue
        elif isinstance(config.moe_layer_freq, list):
            if config.moe_layer_freq[layer_id] == 0:
                continue
        out.append(layer_id)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(1, 3), vpp=st.integers(1, 2), per=st.integers(1, 3), data=st.data())
def test_pipeline_chunks_replay_slimes_rows(pp, vpp, per, data):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    n = pp * vpp * per
    pattern = data.draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n).filter(any))
    kw = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    if vpp > 1 and pp > 1:
        kw["virtual_pipeline_model_parallel_size"] = vpp
    cfg = TransformerConfig(
        num_layers=n, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_layer_freq=pattern, **kw
    )
    layers = MoELayers.from_config(cfg)
    seen = []
    for pp_rank in range(pp):
        for v in range(vpp if "virtual_pipeline_model_parallel_size" in kw else 1):
            vp = v if "virtual_pipeline_model_parallel_size" in kw else None
            first, count = ranks.megatron_chunk(cfg, pp_rank, vp)
            rows = ranks.chunk_rows(layers, first, count, n)  # an engine's tensor: a row per layer
            assert rows == slime_walk(cfg, vp, pp_rank)
            ordinals = ranks.chunk_rows(layers, first, count, len(layers.rows))  # MoE rows only (verl R2)
            assert [layers.rows[i] for i in ordinals] == rows
            seen += rows
    assert sorted(seen) == list(layers.rows)


def test_replay_list_and_errors():
    local = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    out = ranks.replay_list(local, [1, 2])
    assert [o.dtype for o in out] == [np.int64] * 2 and np.array_equal(out[1], local[:, 2])
    with pytest.raises(rp.RoutepackError, match="count: layers 2..4 run past the model's 3"):
        ranks.chunk_rows(MoELayers(3, (1, 2)), 2, 3, 3)
    with pytest.raises(rp.RoutepackError, match="tp_rank: must be <= 1"):
        ranks.verl_take([3], tp_size=2, tp_rank=2)
