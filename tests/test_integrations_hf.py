"""`routepack.integrations.hf` on tiny random models of every supported family (built from
configs in code, seeded, fp32, CPU; nothing downloaded):

* capture: the ids recorded equal a hook-free reference, the model's own router logits
  (``output_router_logits=True``) put through the family's selection rule written out here,
  on random batches with left and right padding; a captured window plans and validates;
* replay: a replay of unchanged weights reproduces the captured forward pass (outputs and
  router gradients bit for bit); with perturbed routers it routes the recording, with the
  weights and gradients the family's own ``forward`` gives those experts (checked by
  forcing the family's own ``torch.topk`` to return the recorded ids);
* errors: unsupported models, bad masks and recordings, a formula that drifted.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import subprocess
import sys
import warnings
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
try:
    import transformers as tf
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("transformers is not installed (pip install 'routepack[hf]')", allow_module_level=True)

import routepack as rp  # noqa: E402
from routepack.errors import RoutepackError, RoutepackTypeError  # noqa: E402
from routepack.integrations import hf  # noqa: E402
from routepack.integrations.hf import families as _hf_families  # noqa: E402

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=24,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
GROUPED = dict(
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=16,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
#: family -> (config class, model class, config fields). Each exercises its quirks: dense
#: layers among MoE ones, shared experts, group-limited routing, a router bias.
FAMILIES: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    "Qwen3-MoE": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            head_dim=8,
            mlp_only_layers=[1],
        ),
    ),
    "Qwen2-MoE": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        ),
    ),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2)),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8)),
    "DeepSeek-V3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            GROUPED,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    "GLM-4.5": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(GROUPED, head_dim=8)),
    "GPT-OSS": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=8),
    ),
}
#: The families the installed transformers runs (every one from 5.13 on; DeepSeek-V3's and
#: GLM-4.5's routers returned the logits alone before, and hf refuses them by name there).
SINCE = {f.name: f.since for f in _hf_families.FAMILIES}
NAMES = [n for n in FAMILIES if hf.TRANSFORMERS >= SINCE[n]]
PROPS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models' matmuls are tiny: with two OpenMP threads on a shared machine they wait on
    each other ten times longer than they compute. Restored for the tests after these."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def model(name: str) -> Any:
    """The family's tiny model, eval mode, routers with weights drawn at scale 1 (so top-k
    choices are far from ties) and, where the family has one, a random score bias."""
    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = getattr(tf, model_cls)(getattr(tf, config_cls)(**{**COMMON, **fields})).eval()
    with torch.no_grad():
        for r in hf.moe_routers(m):
            r.module.weight.normal_(0.0, 1.0)
            if hasattr(r.module, "e_score_correction_bias"):
                r.module.e_score_correction_bias.uniform_(-0.3, 0.3)
    return m


def needs(name: str) -> None:
    if name not in NAMES:
        pytest.skip(f"{name} needs transformers >= {'.'.join(map(str, SINCE[name]))}, found {tf.__version__}")


def test_the_test_families_are_the_supported_ones():
    assert sorted(FAMILIES) == sorted(f.name for f in _hf_families.FAMILIES)
    assert NAMES == list(FAMILIES) or hf.TRANSFORMERS < (5, 13)


def test_a_family_the_installed_transformers_cannot_replay_is_refused_by_name(monkeypatch):
    """Under a transformers older than the family's ``since`` (patched here: DeepSeek-V3's router
    returns the logits alone before 5.13) finding the routers refuses, naming family and release."""
    name = next((n for n in NAMES if SINCE[n] > _hf_families.MIN_TRANSFORMERS), None)
    if name is None:
        pytest.skip(f"every family newer than {_hf_families.MIN_TRANSFORMERS} is refused here already")
    m = model(name)
    monkeypatch.setattr(hf, "TRANSFORMERS", _hf_families.MIN_TRANSFORMERS)
    for call in (hf.moe_routers, hf.model_shape):
        with pytest.raises(
            RoutepackError, match=rf"model: {name}'s router \(\w+\) returns .* from transformers 5\.13 on"
        ):
            call(m)


@st.composite
def batches(draw, max_rows=4, max_len=10):
    """(input_ids [B, S], attention_mask [B, S]): each row a sample of 1..S real tokens,
    padded on the left or on the right (rows differ)."""
    b, s = draw(st.integers(1, max_rows)), draw(st.integers(1, max_len))
    mask = np.zeros((b, s), dtype=np.int64)
    for row in range(b):
        n = draw(st.integers(1, s))
        if draw(st.booleans()):
            mask[row, s - n :] = 1
        else:
            mask[row, :n] = 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(3, COMMON["vocab_size"], (b, s), generator=g)
    return ids, torch.from_numpy(mask)


# ------------------------------------------------------------- hook-free reference


def reference_topk(router: Any, logits: torch.Tensor) -> torch.Tensor:
    """[N, k] expert ids chosen from the model's own router logits by the family's rule, as
    its paper / model card states it (not through routepack)."""
    k = router.top_k
    cls = type(router).__name__
    if cls in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):
        scores = logits.float().sigmoid() + router.e_score_correction_bias
        n, e, g = scores.shape[0], scores.shape[1], router.num_group
        per_group = scores.view(n, g, e // g)
        group_score = per_group.topk(2, dim=-1).values.sum(dim=-1)
        groups = group_score.topk(router.topk_group, dim=-1).indices
        allowed = torch.zeros(n, g, dtype=torch.bool).scatter_(1, groups, True)
        masked = scores.masked_fill(~allowed.repeat_interleave(e // g, dim=1), float("-inf"))
        return masked.topk(k, dim=-1).indices
    if cls == "GptOssTopKRouter":
        return logits.topk(k, dim=-1).indices
    return torch.softmax(logits.float(), dim=-1).topk(k, dim=-1).indices


def reference_routing(m: Any, ids: torch.Tensor, mask: torch.Tensor) -> List[np.ndarray]:
    """Per sample: [n_b, L, k] sorted ids of its real tokens, from ``output_router_logits``."""
    with torch.no_grad():
        out = m(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    routers = hf.moe_routers(m)
    assert len(out.router_logits) == len(routers)
    per_layer = [reference_topk(r.module, lg).view(*ids.shape, -1) for r, lg in zip(routers, out.router_logits)]
    stacked = torch.stack(per_layer, dim=2).sort(dim=-1).values.numpy()  # [B, S, L, k]
    keep = mask.numpy().astype(bool)
    return [stacked[b][keep[b]] for b in range(ids.shape[0])]


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(batch=batches())
def test_capture_equals_the_models_own_router_outputs(name, batch):
    ids, mask = batch
    m = model(name)
    rec = hf.capture_routed(m, ids, mask)
    want = reference_routing(m, ids, mask)
    lens = mask.sum(dim=1).numpy()
    np.testing.assert_array_equal(rec.cu_seqlens, np.concatenate([[0], np.cumsum(lens)]))
    assert rec.routed.dtype == np.int16 and rec.num_experts == hf.moe_routers(m)[0].module.num_experts
    got = np.sort(rec.routed, axis=-1)
    for b, w in enumerate(want):
        np.testing.assert_array_equal(got[rec.cu_seqlens[b] : rec.cu_seqlens[b + 1]], w)
    window = hf.capture(m, ids, mask)
    e = rec.num_experts
    counts = np.stack(
        [np.stack([np.bincount(w[:, layer].ravel(), minlength=e) for layer in range(w.shape[1])]) for w in want]
    )
    np.testing.assert_array_equal(window.seq_lens, lens)
    np.testing.assert_array_equal(window.expert_tokens, counts)


# ---------------------------------------------------------------------- replay


def forward(m: Any, ids: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Logits and every router's weight gradient of a loss on every real token's logits
    (a fixed random projection: a one-token sample still has a gradient)."""
    m.zero_grad(set_to_none=True)
    logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7)) * mask[..., None]
    (logits * probe).sum().backward()
    return logits.detach(), [r.module.weight.grad.clone() for r in hf.moe_routers(m)]


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(batch=batches())
def test_replay_of_unchanged_weights_reproduces_the_captured_pass(name, batch):
    ids, mask = batch
    m = model(name)
    rec = hf.capture_routed(m, ids, mask)
    live_logits, live_grads = forward(m, ids, mask)
    for _ in range(2):  # replay is deterministic: twice the same
        with hf.replay_routing(m, rec, attention_mask=mask):
            logits, grads = forward(m, ids, mask)
        assert torch.equal(logits, live_logits)
        assert all(torch.equal(a, b) for a, b in zip(grads, live_grads))
    with torch.no_grad(), hf.replay_routing(m, rec, attention_mask=mask), hf.record_routing(m) as again:
        m(input_ids=ids, attention_mask=mask)
    assert np.array_equal(again.routed(mask).routed, rec.routed)


def test_replay_without_padding_and_masks_of_any_kind():
    needs("DeepSeek-V3")
    m = model("DeepSeek-V3")
    ids = torch.randint(3, COMMON["vocab_size"], (3, 7))
    rec = hf.capture_routed(m, ids)  # no mask: every token real
    assert np.array_equal(rec.cu_seqlens, [0, 7, 14, 21])
    with torch.no_grad():
        want = m(input_ids=ids).logits
        with hf.replay_routing(m, rec.routed, cu_seqlens=rec.cu_seqlens):  # the router sees exactly T tokens
            assert torch.equal(m(input_ids=ids).logits, want)
    mask = np.ones((3, 7), dtype=np.int64)
    mask[1, :4] = 0
    for kind in (mask, mask.astype(bool), torch.from_numpy(mask)):
        got = hf.capture_routed(m, ids, kind)
        assert np.array_equal(got.cu_seqlens, [0, 7, 10, 17])
        assert np.array_equal(got.routed, hf.capture_routed(m, ids, torch.from_numpy(mask)).routed)
    assert hf.capture(m, ids, mask) == rp.Window.from_routed_experts(*got)


class forced_topk:  # noqa: N801 - a context manager
    """Makes each router's own ``forward`` choose the recorded experts: its last
    ``torch.topk`` (over all E experts, k = top_k) returns the recorded ids at real tokens
    and the values its input holds there. The weights are then computed by transformers'
    code, not routepack's: the reference replay must match."""

    def __init__(self, m: Any, routed: np.ndarray, mask: torch.Tensor) -> None:
        self.routers = hf.moe_routers(m)
        self.ids = torch.from_numpy(routed.astype(np.int64))
        self.pos = torch.from_numpy(np.flatnonzero(mask.numpy().reshape(-1)))
        self.layer = None
        self.handles: List[Any] = []

    def __enter__(self) -> "forced_topk":
        self.orig = torch.topk
        r0 = self.routers[0].module

        def topk(x, k, dim=-1, largest=True, sorted=True, **kw):
            values, idx = self.orig(x, k, dim=dim, largest=largest, sorted=sorted, **kw)
            if self.layer is None or x.dim() != 2 or k != r0.top_k or x.shape[-1] != r0.num_experts:
                return values, idx
            idx = idx.clone()
            idx[self.pos] = self.ids[:, self.layer]
            return x.gather(1, idx), idx

        for layer, r in enumerate(self.routers):
            self.handles.append(
                r.module.register_forward_pre_hook(lambda *a, layer=layer: setattr(self, "layer", layer))
            )
            self.handles.append(r.module.register_forward_hook(lambda *a: setattr(self, "layer", None)))
        torch.topk = topk
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.topk = self.orig
        for h in self.handles:
            h.remove()


def experts_inputs(m: Any) -> Tuple[List[torch.Tensor], List[Any]]:
    """A list that each forward pass fills with the ids every experts module receives."""
    seen: List[torch.Tensor] = []
    handles = []
    for r in hf.moe_routers(m):
        block = m.get_submodule(r.name.rsplit(".", 1)[0])
        handles.append(
            block.experts.register_forward_pre_hook(
                lambda mod, args, kwargs: seen.append(
                    (args[1] if len(args) > 1 else next(v for key, v in kwargs.items() if "ind" in key))
                    .detach()
                    .clone()
                ),
                with_kwargs=True,
            )
        )
    return seen, handles


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(batch=batches(), relayout=st.booleans())
def test_replay_routes_the_recording_after_the_routers_change(name, batch, relayout):
    ids, mask = batch
    m = copy.deepcopy(model(name))
    rec = hf.capture_routed(m, ids, mask)
    with torch.no_grad():
        for r in hf.moe_routers(m):
            r.module.weight.add_(torch.randn_like(r.module.weight))
    if relayout:  # the same samples, padded on the other side: the recording follows the samples
        flipped = mask.flip(1)
        new_ids = torch.zeros_like(ids)
        new_ids[flipped.bool()] = ids[mask.bool()]
        ids, mask = new_ids, flipped
    seen, handles = experts_inputs(m)
    try:
        with hf.replay_routing(m, rec, attention_mask=mask):
            logits, grads = forward(m, ids, mask)
        keep = mask.reshape(-1).bool()
        for layer, got in enumerate(seen):
            assert torch.equal(got[keep], torch.from_numpy(rec.routed[:, layer].astype(np.int64)))
        with forced_topk(m, rec.routed, mask):
            want_logits, want_grads = forward(m, ids, mask)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(logits, want_logits)
    for g, w in zip(grads, want_grads):
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        assert torch.equal(g, w)


# ----------------------------------------------------------------- planning


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("policy", ["static", "eplb_oracle", "routepack"])
def test_a_captured_window_plans_and_validates(name, policy):
    m = model(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, COMMON["vocab_size"], (8, 12), generator=g)
    mask = (torch.arange(12)[None, :] < torch.randint(2, 13, (8, 1), generator=g)).long()
    window = hf.capture(m, ids, mask)
    shape = hf.model_shape(m)
    assert (window.num_layers, window.num_experts) == (shape.num_layers, shape.num_experts)
    e = shape.num_experts
    topo = rp.Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=e // 2 + 1)
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    plan = rp.plan_window(window, topo, cost, token_cap=24, policy=policy, seed=0)
    plan.validate(window, topo, token_cap=24)


def test_model_shape_reads_each_familys_config():
    needs("DeepSeek-V3")
    got = {n: hf.model_shape(model(n)) for n in NAMES}
    assert got["Qwen3-MoE"].num_layers == 2  # mlp_only_layers=[1] is dense
    assert got["DeepSeek-V3"].num_layers == 2 and got["GLM-4.5"].num_layers == 2  # first_k_dense_replace=1
    assert (got["DeepSeek-V3"].expert_groups, got["DeepSeek-V3"].shared_experts, got["DeepSeek-V3"].top_k) == (4, 1, 4)
    assert got["Qwen2-MoE"].shared_experts == 1 and got["Mixtral"].shared_experts == 0
    assert got["Qwen3-MoE"].expert_ffn == 16 and got["OLMoE"].expert_ffn == COMMON["intermediate_size"]


# -------------------------------------------------------------------- errors


def tiny_dense() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))


def test_an_unsupported_model_is_refused_by_name():
    with pytest.raises(RoutepackError, match="LlamaForCausalLM has no MoE router"):
        hf.capture(tiny_dense(), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(RoutepackError, match="Linear has no MoE router"):
        hf.replay_routing(torch.nn.Linear(2, 2), np.zeros((1, 1, 1), np.int16))
    with pytest.raises(RoutepackTypeError, match="model: expected a torch.nn.Module, got str"):
        hf.moe_routers("Qwen/Qwen3-30B-A3B")


def test_bad_inputs_name_the_argument():
    m = model("Qwen3-MoE")
    ids = torch.randint(3, 60, (2, 5))
    with pytest.raises(RoutepackError, match=r"attention_mask: sample \(row\) 1 has no real tokens"):
        hf.capture(m, ids, torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]))
    with pytest.raises(RoutepackError, match="attention_mask: entries must be 0 or 1"):
        hf.capture(m, ids, torch.full((2, 5), 2))
    with pytest.raises(RoutepackError, match="attention_mask: shape"):
        hf.capture(m, ids, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(RoutepackError, match="input_ids: expected a"):
        hf.capture(m, ids[0])
    rec = hf.capture_routed(m, ids)
    with pytest.raises(RoutepackError, match=r"routed: expected \[T >= 1, L=2, k=2\]"):
        hf.replay_routing(m, rec.routed[:, :1])
    with pytest.raises(RoutepackError, match="routed: expert id 8 outside"):
        hf.replay_routing(m, np.full_like(rec.routed, 8))
    with pytest.raises(RoutepackTypeError, match="routed: expected integer"):
        hf.replay_routing(m, rec.routed.astype(np.float32))
    with pytest.raises(RoutepackTypeError, match="routed: expected a"):
        hf.replay_routing(m, tuple(rec))
    with pytest.raises(RoutepackError, match="routed: recorded with num_experts=9"):
        hf.replay_routing(m, rec._replace(num_experts=9))
    big_endian = rec.routed.astype(">i4")
    with hf.replay_routing(m, big_endian), torch.no_grad(), hf.record_routing(m) as again:
        m(input_ids=ids)
    assert np.array_equal(again.routed(torch.ones_like(ids)).routed, rec.routed)
    with pytest.raises(RoutepackError, match="attention_mask: has 9 real tokens, routed has T=10"):
        hf.replay_routing(m, rec, attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1] * 5]))
    with pytest.raises(RoutepackError, match="cu_seqlens: sample lengths"):
        hf.replay_routing(
            m, rec.routed, attention_mask=torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]]), cu_seqlens=rec.cu_seqlens
        )
    with pytest.raises(RoutepackError, match="sees 12 tokens, the replay expects 10"):
        with hf.replay_routing(m, rec), torch.no_grad():
            m(input_ids=torch.randint(3, 60, (2, 6)))


def test_a_router_run_twice_is_refused_when_recording():
    m = model("OLMoE")
    ids = torch.randint(3, 60, (1, 4))
    with torch.no_grad(), hf.record_routing(m) as rec:
        m(input_ids=ids)
        m(input_ids=ids)
    with pytest.raises(RoutepackError, match="ran 2 times while recording"):
        rec.routed(torch.ones_like(ids))


def test_a_drifted_weight_formula_fails_loudly(monkeypatch):
    m = model("Mixtral")
    ids = torch.randint(3, 60, (1, 4))
    rec = hf.capture_routed(m, ids)
    fam = _hf_families.family_of(hf.moe_routers(m)[0].module)
    key = (fam.module, fam.router)
    monkeypatch.setitem(_hf_families.BY_ROUTER, key, dataclasses.replace(fam, weights=_hf_families.softmax_then_topk))
    m2 = copy.deepcopy(m)
    for r in hf.moe_routers(m2):
        r.module.norm_topk_prob = False  # Mixtral always renormalises: the Qwen formula now differs
    with pytest.raises(RoutepackError, match="computes its weights differently"):
        with hf.replay_routing(m2, rec), torch.no_grad():
            m2(input_ids=ids)


def test_routepack_imports_without_transformers_and_hf_names_the_extra():
    code = (
        "import sys; sys.modules['transformers'] = None; import routepack, routepack.integrations\n"
        "assert 'routepack.integrations.hf' not in sys.modules\n"
        "try:\n import routepack.integrations.hf\nexcept ImportError as e:\n print(e)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'routepack[hf]'" in r.stdout, r.stdout + r.stderr
