"""Property tests of `routepack.window`: `Window` and `Window.from_routed_experts` on random
and malformed inputs (the method: see `fuzzing.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routepack as rp
from fuzzing import (
    assert_absurd_size_fails_cleanly,
    FUZZ,
    INT_DTYPES,
    OTHER_DTYPES,
    ROUTED_DTYPES,
    outcome,
    is_int,
    int_array_ok,
)


# ------------------------------------------------------------------------- Window


@st.composite
def window_inputs(draw):
    """(seq_lens, expert_tokens, top_k): consistent shapes and small values half of the time
    (counts within their lengths half of that), else arbitrary arrays; any dtype; top_k
    None, a small int or another type."""
    dtypes = st.sampled_from(INT_DTYPES + OTHER_DTYPES)
    if draw(st.booleans()):
        S, L, E = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 4))

        def values(shape, hi=50):
            dtype = np.dtype(draw(dtypes))
            vals = draw(hnp.arrays(np.int64, shape, elements=st.integers(-1, hi)))
            return (np.abs(vals) if dtype.kind == "u" else vals).astype(dtype)

        seq = values(S)
        if draw(st.booleans()) and seq.dtype.kind in "iu" and (seq.astype(np.int64) >= 1).all():
            # counts drawn within each sample's length: possible per expert, maybe not per layer
            frac = draw(hnp.arrays(np.float64, (S, L, E), elements=st.floats(0, 1)))
            tokens = np.floor(frac * (seq.astype(np.int64)[:, None, None] + 1)).astype(np.int64)
            tokens = np.minimum(tokens, seq.astype(np.int64)[:, None, None]).astype(np.int32)
        else:
            tokens = values((S, L, E))
    else:
        seq = draw(hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5)))
        tokens = draw(hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)))
    top_k = draw(st.one_of(st.none(), st.integers(-1, 5), st.sampled_from([1.0, "2", True])))
    return seq, tokens, top_k


def counts_possible(seq: np.ndarray, tokens: np.ndarray, top_k) -> bool:
    """The window's counts are possible for its lengths, in Python ints: none above its
    sample's length, and with top_k, no layer's total above length * top_k."""
    lens = [int(n) for n in seq]
    for s, n in enumerate(lens):
        for row in tokens[s].astype(np.int64).tolist():
            if max(row) > n or (top_k is not None and sum(row) > n * top_k):
                return False
    return True


@FUZZ
@given(window_inputs())
def test_window(args):
    seq, tokens, top_k = args
    w, err = outcome(rp.Window, seq, tokens, top_k)
    valid = (
        int_array_ok(seq, 1, np.int64)
        and int_array_ok(tokens, 3, np.int32)
        and seq.shape[0] >= 1
        and tokens.shape[0] == seq.shape[0]
        and tokens.shape[1] >= 1
        and tokens.shape[2] >= 1
        and (seq >= 1).all()
        and (tokens >= 0).all()
        and (top_k is None or (is_int(top_k) and 1 <= top_k <= tokens.shape[2]))
        and sum(int(n) for n in seq) <= 2**63 - 1
        and counts_possible(seq, tokens, top_k)
    )
    assert (err is None) == valid, err
    if w is not None:
        assert w.seq_lens.dtype == np.int64 and w.expert_tokens.dtype == np.int32
        np.testing.assert_array_equal(w.seq_lens, seq)
        np.testing.assert_array_equal(w.expert_tokens, tokens)
        assert w.top_k == top_k and w.total_tokens == sum(int(n) for n in seq)


# --------------------------------------------------------------- from_routed_experts


@st.composite
def routed_inputs(draw):
    dtype = draw(st.sampled_from(ROUTED_DTYPES + [np.int8, np.uint16, np.float32, np.bool_]))
    shape = draw(
        st.one_of(
            st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 3)),
            hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
        )
    )
    E = draw(st.one_of(st.integers(1, 20), st.sampled_from([0, -1, 1.5, None, True])))
    top = 22 if not isinstance(E, int) or isinstance(E, bool) else E + 2
    lo = 0 if np.dtype(dtype).kind in "ub" else -2
    if len(shape) == 3 and is_int(E) and 1 <= shape[2] <= E and draw(st.booleans()):
        # a router's output: k distinct ids per (token, layer), now and then one repeated
        keys = draw(hnp.arrays(np.float64, shape[:2] + (E,), elements=st.floats(0, 1)))
        ids = np.argsort(keys, axis=2, kind="stable")[..., : shape[2]]
        if ids.size and shape[2] >= 2 and draw(st.booleans()):
            t, l = draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))
            ids[t, l, -1] = ids[t, l, 0]
    else:
        ids = draw(hnp.arrays(np.int64, shape, elements=st.integers(lo, top)))
    routed = ids.astype(dtype)
    T = shape[0] if len(shape) >= 1 else 0
    if draw(st.booleans()) and T >= 1:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, T - 1)), max_size=5)) - {T}) if T > 1 else []
        cu = [0] + cuts + [T]
    else:
        cu = draw(st.lists(st.integers(-3, T + 3), max_size=6))
    cu_arr = np.array(cu, dtype=np.int64).astype(draw(st.sampled_from([np.int64, np.int32, np.uint8, np.float64])))
    return routed, cu_arr, E


def first_repeat(routed: np.ndarray):
    """(token, layer, id) of the first (token, layer) whose ids repeat one, or None."""
    for t in range(routed.shape[0]):
        for l in range(routed.shape[1]):
            row = routed[t, l].astype(np.int64).tolist()
            if len(set(row)) < len(row):
                return t, l, next(x for i, x in enumerate(row) if x in row[:i])
    return None


@FUZZ
@given(routed_inputs())
def test_from_routed_experts(args):
    routed, cu, E = args
    w, err = outcome(rp.Window.from_routed_experts, routed, cu, E)
    T = routed.shape[0] if routed.ndim >= 1 else 0
    well_formed = (
        is_int(E)
        and E >= 1
        and routed.dtype.type in ROUTED_DTYPES
        and routed.ndim == 3
        and routed.shape[1] >= 1
        and routed.shape[2] >= 1
        and cu.dtype.kind in "iu"
        and cu.ndim == 1
        and len(cu) >= 2
        and cu[0] == 0
        and (np.diff(cu.astype(np.int64)) > 0).all()
        and cu[-1] == T
        and ((routed.astype(np.int64) >= 0) & (routed.astype(np.int64) < E)).all()
    )
    repeat = first_repeat(routed) if well_formed else None
    assert (err is None) == (well_formed and repeat is None), (err, routed.dtype, routed.shape, cu, E)
    if repeat is not None:
        t, l, e = repeat
        assert f"token {t} (sample" in str(err) and f"layer {l} lists expert {e} twice" in str(err), err
    if w is not None:
        assert w.top_k == routed.shape[2]
        cu64 = cu.astype(np.int64)
        for s in range(len(cu) - 1):
            for l in range(routed.shape[1]):
                ref = np.bincount(routed[cu64[s] : cu64[s + 1], l].astype(np.int64).ravel(), minlength=E)
                np.testing.assert_array_equal(w.expert_tokens[s, l], ref)


# ------------------------------------------- the replay layouts: from_verl / from_slime


@st.composite
def layout_inputs(draw):
    """(B, T, L, k, E, routed [B, T, L, k], mask [B, T]) of distinct ids, every row with a
    real token, and a fault to inject: none, an id outside [0, E), or a repeated id."""
    B, T, L = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    E = k + draw(st.integers(0, 3))
    keys = draw(hnp.arrays(np.float64, (B, T, L, E), elements=st.floats(0, 1)))
    routed = np.argsort(keys, axis=3, kind="stable")[..., :k].astype(draw(st.sampled_from(ROUTED_DTYPES)))
    mask = draw(hnp.arrays(np.bool_, (B, T)))
    mask[np.arange(B), draw(hnp.arrays(np.int64, B, elements=st.integers(0, T - 1)))] = True
    fault = draw(st.sampled_from(["none", "outside"] + (["repeat"] if k >= 2 else [])))
    return B, T, L, k, E, routed, mask, fault


@FUZZ
@given(layout_inputs(), st.data())
def test_replay_layout_errors_name_the_argument_and_position(args, data):
    B, T, L, k, E, routed, mask, fault = args
    per_sample = [routed[b][mask[b]] for b in range(B)]
    if fault != "none":
        b = data.draw(st.integers(0, B - 1))
        pos = data.draw(st.sampled_from(np.flatnonzero(mask[b]).tolist()))
        t = int(np.flatnonzero(mask[b]).tolist().index(pos))
        l = data.draw(st.integers(0, L - 1))
        routed[b, pos, l, k - 1] = E if fault == "outside" else routed[b, pos, l, 0]
        per_sample[b][t, l, k - 1] = routed[b, pos, l, k - 1]
        what = "is outside" if fault == "outside" else "lists expert"
        for make, name, token in (
            (lambda: rp.Window.from_verl(routed, mask, E), f"routed_experts[{b}, {pos}]", f"position {pos}"),
            (lambda: rp.Window.from_slime(per_sample, E), f"per_sample[{b}]", f"token {t}"),
        ):
            _, err = outcome(make)
            assert err is not None and str(err).startswith(name + ":"), err
            assert f"{token} (sample {b}), layer {l}" in str(err) and what in str(err), err
        return
    verl = rp.Window.from_verl(routed, mask, E)
    for container in (list, tuple, iter):
        slime = rp.Window.from_slime(container(per_sample), E, add_last_token=False)
        assert slime == verl and slime.top_k == k


@FUZZ
@given(
    per_sample=st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.just({}),
        st.just([]),
        st.just({0: np.zeros((1, 1, 1), np.int32)}),
        st.just(np.zeros((2, 1, 1), np.int32)),
    ),
    add=st.one_of(
        st.booleans(),
        st.none(),
        st.integers(-1, 2),
        st.text(max_size=3),
        st.floats(),
        st.just([True]),
        st.sampled_from([np.bool_(True), np.bool_(False)]),
    ),
)
def test_from_slime_checks_its_arguments(per_sample, add):
    good = [np.zeros((2, 1, 1), np.int32), np.ones((3, 1, 1), np.int32)]
    w, err = outcome(rp.Window.from_slime, good, 2, add_last_token=add)
    assert (err is None) == isinstance(add, (bool, np.bool_)), err
    if w is not None:
        assert w.seq_lens.tolist() == ([3, 4] if add else [2, 3])
    else:
        assert "add_last_token" in str(err), err
    _, err = outcome(rp.Window.from_slime, per_sample, 2)
    assert err is not None and "per_sample" in str(err), err


# ---------------------------------- absurd sizes, each in its own interpreter

ABSURD = {
    "from_routed_experts(num_experts=2**40)": "rp.Window.from_routed_experts(np.zeros((2, 1, 1), np.int32), [0, 2], 2**40)",
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_fail_cleanly(name):
    assert_absurd_size_fails_cleanly(ABSURD[name])
