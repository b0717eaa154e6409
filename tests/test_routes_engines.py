"""The route converter, one test per engine layout built as the engine builds it
(tests/route_engines.py: verl's own code run from its installed source, slime's verbatim,
vLLM's and SGLang's capture step by step), equal to counts computed by hand; then property
tests over random models (dense layers anywhere) and requests.

The hand example: L = 3 route rows (layer 0 dense), k = 2, E = 4, a sample of n = 4 tokens
(prompt 2 + response 2). The engines route tokens 0..2; token 3 (the last generated) has no
route. MoE rows 1 and 2:

    token 0: [1, 2] [3, 0]     token 1: [2, 3] [1, 3]     token 2: [0, 2] [3, 2]

counted by hand, layer 1: experts 0..3 = 1, 1, 3, 1; layer 2: 1, 1, 1, 3. slime replays the
last token with ``arange(L·k) % E``: layer 1 gets experts 2, 3, layer 2 experts 0, 1.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import routes
from route_engines import SglangCapture, VllmCapture, moe_topk, verl_as_dict, verl_legacy_row

torch = pytest.importorskip("torch")

L, K, E, N = 3, 2, 4, 4
MOE = [1, 2]
ROUTES = {1: np.array([[1, 2], [2, 3], [0, 2]]), 2: np.array([[3, 0], [1, 3], [3, 2]])}  # token 0..2
HAND = np.array([[[1, 1, 3, 1], [1, 1, 1, 3]]])  # [S=1, L'=2, E]
HAND_SLIME = np.array([[[1, 1, 4, 2], [2, 2, 1, 3]]])  # + the replayed last-token row
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counts(summary):
    return rp.Window.from_summary(summary).counts.astype(np.int64)


def vllm_request():
    """vLLM: blocks of 2 slots, the request in blocks [3, 1] (slots 6, 7, 2, 3); prefill feeds
    tokens 0, 1, one decode step token 2; token 3 is sampled, never fed."""
    cap = VllmCapture(L, K, kv_blocks=4, block_size=2, max_batch=4)
    cap.forward(np.array([0, 1]), {1: np.array([[0, 1], [1, 2]]), 2: np.array([[2, 3], [3, 0]])})  # another request
    cap.forward(np.array([6, 7]), {layer: r[:2] for layer, r in ROUTES.items()})
    cap.forward(np.array([2]), {layer: r[2:] for layer, r in ROUTES.items()})
    return cap.routed_experts([3, 1], N)


def test_vllm_completion_output():
    out = vllm_request()
    assert out.shape == (N - 1, L, K) and out.dtype == np.int32 and not out[:, 0].any()  # dense row zero
    got = routes.vllm_routes(out, N)
    assert got is out
    assert np.array_equal(counts(routes.summarize([got], E, [N], MOE)), HAND)
    # int16, as verl casts it (and vLLM builds that keep int16)
    assert np.array_equal(counts(routes.summarize([routes.vllm_routes(out.astype(np.int16), N)], E, [N], MOE)), HAND)
    with pytest.raises(rp.RoutepackError, match="3 rows for a sample of 3 tokens; vLLM records n - 1 = 2"):
        routes.vllm_routes(out, 3)
    request = type("RequestOutput", (), {})()
    request.prompt_token_ids = [7, 8]
    request.outputs = [type("CompletionOutput", (), {"token_ids": [9, 10], "routed_experts": out})()]
    assert routes.vllm_output_routes(request) is out


def sglang_request():
    """SGLang: the request's tokens at pool slots [5, 2, 7, 0]; prefill 0, 1, decode 2."""
    cap = SglangCapture(L, K, pool=8, max_batch=4, shared=1)
    req_to_token = np.array([5, 2, 7, 0, 4, 6])
    cap.forward(req_to_token[:2], {layer: r[:2] for layer, r in ROUTES.items()})
    cap.forward(req_to_token[2:3], {layer: r[2:] for layer, r in ROUTES.items()})
    return cap, req_to_token


def test_sglang_meta_info_and_slimes_decoder_agree():
    from route_excerpts import Sample  # slime's own decoding (slime/utils/types.py)

    cap, req_to_token = sglang_request()
    meta = cap.meta_info(req_to_token, N)
    got = routes.sglang_routes(meta, N, L, K)
    assert got.shape == (N - 1, L, K) and got.dtype == np.int32 and not got.flags.writeable  # np.frombuffer
    sample = Sample(tokens=list(range(N)))
    sample._apply_routed_experts(meta, type("Args", (), {"num_layers": L, "moe_router_topk": K})())
    assert np.array_equal(sample.rollout_routed_experts.numpy(), got)
    assert np.array_equal(counts(routes.summarize([got], E, [N], MOE)), HAND)
    # a wire dtype the sender names (uint8) decodes to the same ids
    assert np.array_equal(routes.sglang_routes(cap.meta_info(req_to_token, N, dtype="uint8"), N, L, K), got)
    assert np.array_equal(routes.sglang_routes(cap.meta_info(req_to_token, N, dtype="uint16"), N, L, K), got)
    with pytest.raises(rp.RoutepackError, match=r"18 ids, expected \(n - 1 - start\) \* L \* k = \(5 - 1 - 0\)"):
        routes.sglang_routes(meta, 5, L, K)


def test_sglang_start_len_continues_a_sample_as_slime_joins_it():
    from route_excerpts import Sample

    cap, req_to_token = sglang_request()
    first = routes.sglang_routes(cap.meta_info(req_to_token, N), N, L, K)
    # the sample goes on: token 3 is fed (routes [1, 0] / [2, 1]), then token 4; n = 6
    cap.forward(req_to_token[3:5], {1: np.array([[1, 0], [3, 1]]), 2: np.array([[2, 1], [0, 3]])})
    meta = cap.meta_info(req_to_token, 6, start_len=2)
    with pytest.raises(rp.RoutepackError, match="previous: routed_experts_start_len = 2"):
        routes.sglang_routes(meta, 6, L, K)
    joined = routes.sglang_routes(meta, 6, L, K, previous=first)
    args = type("Args", (), {"num_layers": L, "moe_router_topk": K})()
    sample = Sample(tokens=list(range(N)))
    sample._apply_routed_experts(cap.meta_info(req_to_token, N), args)
    sample.tokens = list(range(6))
    sample._apply_routed_experts(meta, args)
    assert np.array_equal(sample.rollout_routed_experts.numpy(), joined)
    assert np.array_equal(joined, routes.sglang_routes(cap.meta_info(req_to_token, 6), 6, L, K))


def test_slime_rollout_routed_experts():
    from route_excerpts import Sample, validate_rollout_routed_experts_for_replay

    cap, req_to_token = sglang_request()
    args = type("Args", (), {"num_layers": L, "moe_router_topk": K, "moe_layer_freq": [0, 1, 1]})()
    sample = Sample(tokens=list(range(N)))
    sample._apply_routed_experts(cap.meta_info(req_to_token, N), args)
    per_sample = [sample.rollout_routed_experts]  # torch int32 [T - 1, L, k]
    validate_rollout_routed_experts_for_replay(per_sample, args)  # what slime accepts for R3
    assert np.array_equal(counts(routes.slime_summary(per_sample, E, total_lengths=[N], moe_layers=MOE)), HAND_SLIME)
    assert np.array_equal(counts(routes.slime_summary(per_sample, E, last_token="skip", moe_layers=MOE)), HAND)
    # older slime kept np.frombuffer's read-only array: read in place
    frozen = np.frombuffer(per_sample[0].numpy().tobytes(), dtype=np.int32).reshape(N - 1, L, K)
    assert np.array_equal(counts(routes.slime_summary([frozen], E, moe_layers=MOE)), HAND_SLIME)
    with pytest.raises(rp.RoutepackError, match=r"rollout_routed_experts\[0\]: has 3 rows but total_lengths\[0\] = 5"):
        routes.slime_summary(per_sample, E, total_lengths=[5])
    with pytest.raises(
        rp.RoutepackError, match=r"rollout_routed_experts\[0\]: token 0 \(sample 0\), layer 0 .*moe_layers"
    ):
        routes.slime_summary(per_sample, E)  # the dense row, without moe_layers


def test_verl_legacy_and_v1_layouts():
    engine = vllm_request()  # what verl's vLLM server hands the agent loop
    # legacy trainer: prompt [7, 8] left-padded to P = 4, response [9, 10] right-padded to R = 3
    row = verl_legacy_row([7, 8], 4, 3, engine)
    assert tuple(row.shape) == (1, 7, L, K) and row.dtype == torch.int16
    mask = np.array([[0, 0, 1, 1, 1, 1, 0]])
    summary = routes.verl_summary(row, E, mask, response_mask=np.array([[1, 1, 0]]), moe_layers=MOE)
    assert np.array_equal(counts(summary), HAND) and summary.seq_lens.tolist() == [N]
    # v1 trainer: AgentLoopOutput.as_dict, unpadded [n, L, k], the last row zero; nested in the batch
    fields = verl_as_dict([7, 8], [9, 10], engine)
    assert tuple(fields["routed_experts"].shape) == (N, L, K) and not fields["routed_experts"][-1].any()
    nested = torch.nested.nested_tensor([fields["routed_experts"]] * 2, layout=torch.jagged)
    summary = routes.verl_summary(nested, E, moe_layers=MOE)
    assert np.array_equal(counts(summary), np.concatenate([HAND, HAND])) and summary.seq_lens.tolist() == [N, N]
    with pytest.raises(
        rp.RoutepackError, match=r"routed_experts\[0, 2\]: position 2 \(sample 0\), layer 0 .*moe_layers"
    ):
        routes.verl_summary(row, E, mask)


# ------------------------------------------------------------------------- properties
@st.composite
def models(draw):
    layers = draw(st.integers(1, 5))
    moe = sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1)))
    experts = draw(st.integers(2, 9))
    return layers, moe, experts, draw(st.integers(1, experts))


def naive(per_sample, moe, experts):
    out = np.zeros((len(per_sample), len(moe), experts), dtype=np.int64)
    for s, rows in enumerate(per_sample):
        for i, layer in enumerate(moe):
            np.add.at(out[s, i], np.asarray(rows)[:, layer].reshape(-1).astype(np.int64), 1)
    return out


@SETTINGS
@given(model=models(), seed=st.integers(0, 2**32 - 1), lens=st.lists(st.integers(1, 9), min_size=1, max_size=5))
def test_every_engine_counts_the_moe_rows_of_the_first_n_minus_1_tokens(model, seed, lens):
    layers, moe, experts, k = model
    rng = np.random.default_rng(seed)
    vllm, sglang = [], []
    vcap = VllmCapture(layers, k, kv_blocks=4 * len(lens), block_size=4, max_batch=16)
    scap = SglangCapture(layers, k, pool=16 * len(lens), max_batch=16)
    for i, n in enumerate(lens):
        topk = {layer: moe_topk(rng, max(n - 1, 0), experts, k) for layer in moe}
        blocks = [4 * i + b for b in range(4)]
        slots = (np.array(blocks)[:, None] * 4 + np.arange(4)).reshape(-1)[: max(n - 1, 0)]
        vcap.forward(slots, topk)
        vllm.append(routes.vllm_routes(vcap.routed_experts(blocks, n), n))
        pool = rng.permutation(16 * len(lens))[:n]
        scap.forward(pool[: n - 1], topk)
        sglang.append(routes.sglang_routes(scap.meta_info(pool, n), n, layers, k))
        assert np.array_equal(vllm[-1], sglang[-1])  # the two engines record the same layout
    rows = None if len(moe) == layers else moe
    want = naive(vllm, moe, experts)
    for per_sample in (vllm, sglang):
        whole = routes.summarize(per_sample, experts, lens, rows)
        assert np.array_equal(counts(whole), want)
        # round trip: summaries of any split, merged, are the whole
        cut = int(rng.integers(0, len(lens) + 1))
        parts = [
            routes.summarize(per_sample[a:b], experts, lens[a:b], rows)
            for a, b in ((0, cut), (cut, len(lens)))
            if b > a
        ]
        merged = routes.merge(parts)
        assert np.array_equal(merged.counts.astype(np.int64), want) and merged.seq_lens.tolist() == lens
        assert merged.nbytes <= whole.nbytes  # never wider than the narrowest type that holds them
    # slime: the same rows, plus the replayed last token; skip: exactly the rows
    tensors = [torch.from_numpy(a.copy()) for a in sglang]  # slime's int32 tensors
    assert np.array_equal(counts(routes.slime_summary(tensors, experts, lens, "skip", rows)), want)
    pad = routes.slime_pad_row(layers, k, experts)  # what slime's replay routes the last token with
    padded = [np.concatenate([a, pad]) for a in sglang]
    assert np.array_equal(
        counts(routes.slime_summary(tensors, experts, lens, "pad", rows)), naive(padded, moe, experts)
    )


@SETTINGS
@given(model=models(), seed=st.integers(0, 2**32 - 1), n=st.integers(2, 12), data=st.data())
def test_sglang_start_len_round_trip(model, seed, n, data):
    layers, moe, experts, k = model
    rng = np.random.default_rng(seed)
    cap = SglangCapture(layers, k, pool=16, max_batch=16)
    pool = rng.permutation(16)[:n]
    cap.forward(pool[: n - 1], {layer: moe_topk(rng, n - 1, experts, k) for layer in moe})
    whole = routes.sglang_routes(cap.meta_info(pool, n), n, layers, k)
    start = data.draw(st.integers(0, n - 1))
    previous = whole[: data.draw(st.integers(start, n - 1))]
    assert np.array_equal(routes.sglang_routes(cap.meta_info(pool, n, start_len=start), n, layers, k, previous), whole)
