"""`Window.from_routed_experts` (routing-replay ingestion) against a numpy bincount reference,
and its errors for malformed ids, offsets, shapes and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import routepack as rp

DTYPES = [np.uint8, np.int16, np.int32, np.int64]


def bincount_reference(routed: np.ndarray, cu_seqlens: np.ndarray, num_experts: int):
    """(seq_lens int64 [S], expert_tokens int32 [S, L, E]) by numpy.bincount per sample and layer."""
    T, L, k = routed.shape
    S = len(cu_seqlens) - 1
    out = np.zeros((S, L, num_experts), dtype=np.int32)
    for s in range(S):
        lo, hi = cu_seqlens[s], cu_seqlens[s + 1]
        for l in range(L):
            out[s, l] = np.bincount(routed[lo:hi, l, :].astype(np.int64).ravel(), minlength=num_experts)
    return np.diff(cu_seqlens).astype(np.int64), out


def distinct_ids(rng: np.random.Generator, T: int, L: int, k: int, E: int) -> np.ndarray:
    """int64 [T, L, k]: k distinct ids in [0, E) per (token, layer), as a router picks them."""
    return np.argsort(rng.random((T, L, E)), axis=2)[..., :k]


def random_cu_seqlens(rng: np.random.Generator, T: int, S: int) -> np.ndarray:
    """S+1 strictly increasing offsets from 0 to T (S <= T)."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=S - 1, replace=False)) if S > 1 else np.zeros(0, int)
    return np.concatenate([[0], cuts, [T]]).astype(np.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_matches_bincount(dtype, seed):
    rng = np.random.default_rng(seed)
    T, L, k = int(rng.integers(1, 300)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
    E = int(rng.integers(k, 256 if dtype == np.uint8 else 600))
    S = int(rng.integers(1, min(T, 20) + 1))
    routed = distinct_ids(rng, T, L, k, E).astype(dtype)
    cu = random_cu_seqlens(rng, T, S)
    w = rp.Window.from_routed_experts(routed, cu, E)
    lens, ref = bincount_reference(routed, cu, E)
    assert w.seq_lens.dtype == np.int64 and w.expert_tokens.dtype == np.int32
    np.testing.assert_array_equal(w.seq_lens, lens)
    np.testing.assert_array_equal(w.expert_tokens, ref)
    assert w.expert_tokens.shape == (S, L, E) and w.top_k == k
    # each token counts once per routed id
    np.testing.assert_array_equal(w.expert_tokens.sum(axis=2), np.repeat(lens[:, None] * k, L, axis=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_list_offsets(dtype):
    """A strided view of ids and a Python list of offsets count like their contiguous copies."""
    rng = np.random.default_rng(1)
    big = distinct_ids(rng, 40, 3, 8, 50).astype(dtype)
    view = big[::2, :, ::2]  # [20, 3, 4], not contiguous
    cu = [0, 3, 11, 20]
    w = rp.Window.from_routed_experts(view, cu, 50)
    _, ref = bincount_reference(np.ascontiguousarray(view), np.array(cu), 50)
    np.testing.assert_array_equal(w.expert_tokens, ref)


def test_largest_valid_id_and_uint8_full_range():
    routed = np.full((3, 1, 1), 255, dtype=np.uint8)
    w = rp.Window.from_routed_experts(routed, [0, 1, 3], 256)
    assert w.expert_tokens[:, 0, 255].tolist() == [1, 2]
    assert w.expert_tokens[:, 0, :255].sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_range_id_names_token_and_layer(dtype):
    routed = np.zeros((6, 3, 2), dtype=dtype)
    routed[..., 1] = 1  # every token picks experts 0 and 1
    routed[4, 2, 1] = 9
    with pytest.raises(ValueError) as ei:
        rp.Window.from_routed_experts(routed, [0, 2, 6], 9)
    msg = str(ei.value)
    assert "expert id 9" in msg and "token 4" in msg and "layer 2" in msg and "sample 1" in msg, msg
    assert isinstance(ei.value, rp.RoutepackError)


def test_first_bad_id_is_reported_whatever_the_thread_order():
    """Two bad ids in different samples: the lowest sample's is named."""
    routed = np.zeros((100, 1, 1), dtype=np.int32)
    routed[90, 0, 0] = 7
    routed[30, 0, 0] = 8
    with pytest.raises(ValueError, match="token 30"):
        rp.Window.from_routed_experts(routed, np.arange(0, 101, 10), 5)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_negative_id_is_refused(dtype):
    routed = np.zeros((3, 2, 2), dtype=dtype)
    routed[..., 1] = 1
    routed[1, 1, 0] = -1
    with pytest.raises(ValueError) as ei:
        rp.Window.from_routed_experts(routed, [0, 3], 4)
    msg = str(ei.value)
    assert "expert id -1" in msg and "token 1" in msg and "layer 1" in msg, msg


def test_most_negative_int64_is_refused():
    routed = np.array([[[np.iinfo(np.int64).min]]], dtype=np.int64)
    with pytest.raises(ValueError, match="expert id"):
        rp.Window.from_routed_experts(routed, [0, 1], 4)


@pytest.mark.parametrize(
    "cu, words",
    [
        ([1, 3, 5], "start at 0"),
        ([0, 4, 2, 5], "cu_seqlens"),  # decreasing
        ([0, 2, 2, 5], "cu_seqlens"),  # an empty sample
        ([0, 2, 4], "ends at 4"),  # short of T
        ([0, 2, 6], "ends at 6"),  # past T
        ([0], "cu_seqlens"),  # no sample
        ([], "cu_seqlens"),
        ([-1, 5], "start at 0"),
    ],
)
def test_bad_cu_seqlens(cu, words):
    routed = np.zeros((5, 1, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=words):
        rp.Window.from_routed_experts(routed, np.array(cu, dtype=np.int64), 4)


def test_cu_seqlens_of_wrong_type_or_shape():
    routed = np.zeros((4, 1, 1), dtype=np.int32)
    with pytest.raises(TypeError, match="cu_seqlens"):
        rp.Window.from_routed_experts(routed, np.array([0.0, 4.0]), 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rp.Window.from_routed_experts(routed, np.array([[0, 4]]), 2)


@pytest.mark.parametrize("shape", [(4,), (4, 2), (1, 4, 1, 2), ()])
def test_wrong_ndim(shape):
    with pytest.raises(ValueError, match="routed"):
        rp.Window.from_routed_experts(np.zeros(shape, dtype=np.int32), [0, 1], 4)


@pytest.mark.parametrize("shape", [(4, 0, 2), (4, 2, 0), (0, 2, 2)])
def test_empty_axes(shape):
    with pytest.raises(ValueError):
        rp.Window.from_routed_experts(np.zeros(shape, dtype=np.int32), [0, 4], 4)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.bool_, np.int8, np.uint16, np.uint32, np.uint64, np.complex64, object]
)
def test_other_dtypes_are_type_errors(dtype):
    with pytest.raises(TypeError, match="routed"):
        rp.Window.from_routed_experts(np.zeros((2, 1, 1), dtype=dtype), [0, 2], 4)


@pytest.mark.parametrize("dtype", [">i2", ">i4", ">i8"])
def test_byte_swapped_ids_count_correctly_or_are_refused(dtype):
    """Big-endian ids either count as their values or raise TypeError, never miscount."""
    routed = np.array([[[1, 2]], [[3, 1]]], dtype=dtype)
    try:
        w = rp.Window.from_routed_experts(routed, [0, 2], 4)
    except TypeError:
        return
    assert w.expert_tokens[0, 0].tolist() == [0, 2, 1, 1]


@pytest.mark.parametrize("num_experts", [0, -3, 2.0, "4", None, True])
def test_bad_num_experts(num_experts):
    with pytest.raises((TypeError, ValueError), match="num_experts"):
        rp.Window.from_routed_experts(np.zeros((2, 1, 1), dtype=np.int32), [0, 2], num_experts)
