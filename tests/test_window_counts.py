"""A window's counts in the narrowest dtype (`Window.counts`): the dtype each input gives, the
int32 `expert_tokens` view of them, save/load (old int32 files included, narrowed while read),
the bindings taking uint8 / uint16 / int32 alike with the same results, and their refusal of
any other dtype naming ``expert_tokens``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import _core, _npz
from routepack.window import COUNT_DTYPES, count_dtype

INPUT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def _window_arrays(seed: int, top: int, s_n: int = 6, layers: int = 2, experts: int = 5):
    """seq_lens [S] and int64 counts [S, L, E] with every count <= its length; the largest
    count is ``top`` (sample 0 is that long)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, top + 1, size=s_n).astype(np.int64)
    lens[0] = top
    counts = np.minimum(rng.integers(0, top + 1, size=(s_n, layers, experts)), lens[:, None, None])
    counts[0, 0, 0] = top
    return lens, counts


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    top=st.sampled_from([0, 1, 255, 256, 65535, 65536, 10**6]),
    dtype=st.sampled_from(INPUT_DTYPES),
)
def test_counts_are_stored_narrowest_whatever_the_input_dtype(seed: int, top: int, dtype: type) -> None:
    lens, counts = _window_arrays(seed, max(top, 1))
    if top == 0:
        counts[:] = 0
    if counts.max() > np.iinfo(dtype).max:
        return  # not representable in that input dtype
    w = rp.Window(lens, counts.astype(dtype))
    assert w.counts.dtype == count_dtype(int(counts.max())) and w.counts.flags.c_contiguous
    assert w.counts.dtype in COUNT_DTYPES
    et = w.expert_tokens
    assert et.dtype == np.int32 and not et.flags.writeable and np.array_equal(et, counts)
    with pytest.raises(ValueError):
        et[0, 0, 0] = 1  # read-only: an edit can never be lost silently
    assert w == rp.Window(lens, counts.astype(np.int64))


def test_count_dtype_edges() -> None:
    assert [count_dtype(x) for x in (0, 255, 256, 65535, 65536)] == [np.uint8, np.uint8, np.uint16, np.uint16, np.int32]


def test_errors_name_expert_tokens_as_before() -> None:
    with pytest.raises(rp.RoutepackError, match="negative count -1 at sample 0, layer 0, expert 1"):
        rp.Window([3], np.array([[[1, -1]]], dtype=np.int64))
    with pytest.raises(rp.RoutepackTypeError, match="expert_tokens: expected an integer array, got dtype float64"):
        rp.Window([3], np.ones((1, 1, 2)))
    with pytest.raises(rp.RoutepackError, match="expert_tokens: expected 3 dimensions"):
        rp.Window([3], np.ones((1, 2), dtype=np.uint8))
    with pytest.raises(rp.RoutepackError, match="does not fit int32"):
        rp.Window([3], np.array([[[2**40]]], dtype=np.int64))
    with pytest.raises(rp.RoutepackError, match="has 300 tokens but the sample's length is 3"):
        rp.Window([3], np.array([[[300]]], dtype=np.uint16))


def test_bindings_take_every_count_dtype_with_the_same_results() -> None:
    prof = rp.traces.profile("tiny")
    w = next(rp.traces.synthetic(prof, 1, seed=0))
    topo, cost = prof.topology(), prof.cost()
    plan = rp.plan_window(w, topo, cost, prof.token_cap, "routepack")
    plan.validate(w, topo, prof.token_cap)
    sims, tops = [], []
    for dt in COUNT_DTYPES:
        if w.counts.max() > np.iinfo(dt).max:
            continue
        c = w.counts.astype(dt)
        _core.validate_plan(plan, w.seq_lens, c, topo, prof.token_cap)
        sims.append(repr(sorted(_core.simulate(plan, w.seq_lens, c, topo, cost).items())))
        tops.append(_core.check_expert_tokens(w.seq_lens, c, None))
        assert np.array_equal(
            _core.rank_tokens(plan, w.seq_lens, c, topo), _core.rank_tokens(plan, w.seq_lens, w.expert_tokens, topo)
        )
        assert np.array_equal(_core.chunk_demand(w.seq_lens, c, 3), _core.chunk_demand(w.seq_lens, w.counts, 3))
    assert len(sims) >= 2 and len(set(sims)) == 1 and len(set(tops)) == 1
    for bad in (w.counts.astype(np.int64), w.counts.astype(np.float32), w.counts.astype(np.int16)):
        with pytest.raises(rp.RoutepackTypeError, match=f"expert_tokens: .*dtype {bad.dtype}"):
            _core.simulate(plan, w.seq_lens, bad, topo, cost)
    with pytest.raises(rp.RoutepackTypeError, match="expert_tokens: .*got a list"):
        _core.check_expert_tokens(w.seq_lens, [[[1]]], None)


def test_ingestion_and_synthetic_windows_are_narrow() -> None:
    routed = np.array([[[0, 1]], [[1, 2]], [[2, 0]]], dtype=np.uint8)
    w = rp.Window.from_routed_experts(routed, np.array([0, 2, 3]), 3)
    assert w.counts.dtype == np.uint8 and w.expert_tokens.tolist() == [[[1, 2, 1]], [[1, 0, 1]]]
    lens, counts = _core.expert_tokens_from_routed(np.zeros((300, 1, 1), np.int16), np.array([0, 300]), 2)
    assert counts.dtype == np.uint16 and counts.tolist() == [[[300, 0]]]
    for name in ("tiny", "flash"):
        prof = rp.traces.profile(name)
        if name == "flash":
            from dataclasses import replace

            prof = replace(prof, num_layers=2, attention=("full",) * 2, samples=256)
        w = next(rp.traces.synthetic(prof, 1, seed=0))
        assert w.counts.dtype == count_dtype(int(w.counts.max()))


@pytest.mark.parametrize("top", [200, 1000, 70000])
def test_save_load_keeps_the_dtype_and_old_int32_files_load_narrowed(tmp_path, monkeypatch, top: int) -> None:
    lens, counts = _window_arrays(3, top, s_n=40, layers=3, experts=7)
    w = rp.Window(lens, counts, top_k=None)
    path = tmp_path / "w.npz"
    w.save(path)
    back = rp.Window.load(path)
    assert back == w and back.counts.dtype == w.counts.dtype == count_dtype(top)
    # a file written before windows were narrow: int32 counts, read in chunks that do not
    # divide the array, never whole
    old = tmp_path / "old.npz"
    np.savez(old, seq_lens=lens, expert_tokens=counts.astype(np.int32))
    monkeypatch.setattr(_npz, "_NARROW_CHUNK", 37)
    back = rp.Window.load(old)
    assert back == w and back.counts.dtype == count_dtype(top)
    z = _npz.read(old, ("expert_tokens",), "window", narrow=("expert_tokens",))
    assert z["expert_tokens"].dtype == (np.uint16 if top <= 65535 else np.int32)


def test_a_truncated_old_file_is_named(tmp_path) -> None:
    lens, counts = _window_arrays(1, 300, s_n=50)
    old = tmp_path / "old.npz"
    np.savez(old, seq_lens=lens, expert_tokens=counts.astype(np.int32))
    data = old.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) - 200])
    with pytest.raises(rp.RoutepackFileError):
        rp.Window.load(cut)


def test_the_wire_decodes_into_the_narrow_assembly() -> None:
    wg = pytest.importorskip("routepack.torch.window_gather")
    lens, counts = _window_arrays(5, 300, s_n=9)
    w = rp.Window(lens, counts)
    code, payload = wg.encode(w)
    out = np.zeros(w.counts.shape, np.uint16)
    back_lens, back = wg.decode(code, payload, 9, 2, 5, int(lens.max()), out=out)
    assert back is out and np.array_equal(back, counts) and np.array_equal(back_lens, lens)
