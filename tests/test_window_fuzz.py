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
    assert_absurd_size_fails_cleanly, FUZZ, INT_DTYPES, OTHER_DTYPES, ROUTED_DTYPES, outcome, is_int, int_array_ok,
)


# ------------------------------------------------------------------------- Window

@st.composite
def window_inputs(draw):
    """(seq_lens, expert_tokens): consistent shapes and small values half of the time, else
    arbitrary arrays; any dtype."""
    dtypes = st.sampled_from(INT_DTYPES + OTHER_DTYPES)
    if draw(st.booleans()):
        S, L, E = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 4))
        def values(shape):
            dtype = np.dtype(draw(dtypes))
            vals = draw(hnp.arrays(np.int64, shape, elements=st.integers(-1, 50)))
            return (np.abs(vals) if dtype.kind == "u" else vals).astype(dtype)

        seq, tokens = values(S), values((S, L, E))
    else:
        seq = draw(hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5)))
        tokens = draw(hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)))
    return seq, tokens


@FUZZ
@given(window_inputs())
def test_window(args):
    seq, tokens = args
    w, err = outcome(rp.Window, seq, tokens)
    valid = (
        int_array_ok(seq, 1, np.int64) and int_array_ok(tokens, 3, np.int32)
        and seq.shape[0] >= 1 and tokens.shape[0] == seq.shape[0] and tokens.shape[1] >= 1
        and tokens.shape[2] >= 1 and (seq >= 1).all() and (tokens >= 0).all()
    )
    assert (err is None) == valid, err
    if w is not None:
        assert w.seq_lens.dtype == np.int64 and w.expert_tokens.dtype == np.int32
        np.testing.assert_array_equal(w.seq_lens, seq)
        np.testing.assert_array_equal(w.expert_tokens, tokens)


# --------------------------------------------------------------- from_routed_experts

@st.composite
def routed_inputs(draw):
    dtype = draw(st.sampled_from(ROUTED_DTYPES + [np.int8, np.uint16, np.float32, np.bool_]))
    shape = draw(st.one_of(st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 3)),
                           hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)))
    E = draw(st.one_of(st.integers(1, 20), st.sampled_from([0, -1, 1.5, None, True])))
    top = 22 if not isinstance(E, int) or isinstance(E, bool) else E + 2
    lo = 0 if np.dtype(dtype).kind in "ub" else -2
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


@FUZZ
@given(routed_inputs())
def test_from_routed_experts(args):
    routed, cu, E = args
    w, err = outcome(rp.Window.from_routed_experts, routed, cu, E)
    T = routed.shape[0] if routed.ndim >= 1 else 0
    valid = (
        is_int(E) and E >= 1
        and routed.dtype.type in ROUTED_DTYPES and routed.ndim == 3
        and routed.shape[1] >= 1 and routed.shape[2] >= 1
        and cu.dtype.kind in "iu" and cu.ndim == 1 and len(cu) >= 2
        and cu[0] == 0 and (np.diff(cu.astype(np.int64)) > 0).all() and cu[-1] == T
        and ((routed.astype(np.int64) >= 0) & (routed.astype(np.int64) < E)).all()
    )
    assert (err is None) == valid, (err, routed.dtype, routed.shape, cu, E)
    if w is not None:
        cu64 = cu.astype(np.int64)
        for s in range(len(cu) - 1):
            for l in range(routed.shape[1]):
                ref = np.bincount(routed[cu64[s]:cu64[s + 1], l].astype(np.int64).ravel(), minlength=E)
                np.testing.assert_array_equal(w.expert_tokens[s, l], ref)


# ---------------------------------- absurd sizes, each in its own interpreter

ABSURD = {
    "from_routed_experts(num_experts=2**40)":
        "rp.Window.from_routed_experts(np.zeros((2, 1, 1), np.int32), [0, 2], 2**40)",
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_fail_cleanly(name):
    assert_absurd_size_fails_cleanly(ABSURD[name])
