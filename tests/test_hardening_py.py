"""Issue 13, classes 5-7 on the Python side: strict types (no silent coercion), errors that
name the argument, and damaged files. Each class has its listed examples plus a hypothesis
property over the class."""

from __future__ import annotations

import copy
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp
from routepack import placement as pl
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.model import CostModel, Hardware, ModelShape, Topology
from routepack.stages.packing import RoutepackPackingOptions

COST = dict(
    a_lin=1.0,
    c_tok=1.0,
    c_exp=1.0,
    token_bytes=1.0,
    bw_intra=1.0,
    bw_inter=1.0,
    expert_weight_bytes=1.0,
    expert_grad_bytes=1.0,
    expert_state_bytes=1.0,
)

#: Containers whose iteration would silently give keys or an arbitrary order, and scalars.
NOT_SEQUENCES = st.one_of(
    st.dictionaries(st.integers(0, 3), st.floats(0, 1), min_size=1, max_size=4),
    st.sets(st.floats(0, 1), min_size=1, max_size=4).map(frozenset),
    st.sets(st.integers(0, 3), min_size=1, max_size=4),
    st.text(min_size=1, max_size=4),
    st.integers(),
    st.floats(allow_nan=False),
)


# ------------------------------------------------------------------ class 5: strict types
def test_a_quad_mapping_is_refused():
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad={0: 1.0}, **COST)


def test_attention_mapping_is_refused():
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(2, 4, 2, 8, 8, attention={"full": 1, "linear": 2})
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(4, 4, 2, 8, 8, attention="full")


def test_sequences_still_accepted():
    assert CostModel(a_quad=(1.0, 2), **COST).a_quad == [1.0, 2.0]
    assert CostModel(a_quad=np.array([1.0, 0.0]), **COST).a_quad == [1.0, 0.0]
    assert ModelShape(2, 4, 2, 8, 8, attention=["full", "linear"]).attention == ("full", "linear")
    assert ModelShape(2, 4, 2, 8, 8).attention == ("full", "full")
    assert ModelShape(2, 4, 2, 8, 8, attention=(a for a in ("linear", "full"))).attention == ("linear", "full")
    assert CostModel(a_quad=iter([1.0]), **COST).a_quad == [1.0]
    assert RoutepackPackingOptions(anneal_mix=[1, 0, 0, 0]).anneal_mix == (1.0, 0.0, 0.0, 0.0)


@settings(max_examples=60, deadline=None)
@given(NOT_SEQUENCES)
def test_non_sequences_are_type_errors(value):
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad=value, **COST)
    with pytest.raises(RoutepackTypeError, match="model.attention"):
        ModelShape(1, 4, 2, 8, 8, attention=value)
    with pytest.raises(RoutepackTypeError, match="anneal_mix"):
        RoutepackPackingOptions(anneal_mix=value)


TOPO = Topology(2, 2, 1, 3)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 1), st.integers(0, 3), st.sampled_from([np.nan, -np.inf, np.inf, -1.0, -1e-300]))
def test_bad_loads_are_refused_naming_loads(layer, expert, bad):
    loads = np.ones((2, 4))
    loads[layer, expert] = bad
    placement = rp.Placement.static(2, 4, TOPO)
    for f in (lambda: pl.aggregate_imbalance(placement, loads), lambda: pl.imbalance_lower_bound(loads, TOPO)):
        with pytest.raises(RoutepackError, match=rf"loads: entry \[{layer}, {expert}\]"):
            f()


def test_good_loads_unchanged():
    loads = np.arange(8.0).reshape(2, 4)
    placement = rp.Placement.static(2, 4, TOPO)
    assert np.isfinite(pl.aggregate_imbalance(placement, loads)).all()
    assert (pl.imbalance_lower_bound(loads, TOPO) >= 1).all()
    with pytest.raises(RoutepackTypeError, match="topo"):
        pl.imbalance_lower_bound(loads, None)


# ------------------------------------------------------- class 6: errors name the argument
@pytest.mark.parametrize("value", [-2, 0, float("nan"), float("inf")])
def test_from_model_blames_weight_bytes(value):
    with pytest.raises(RoutepackError, match="weight_bytes"):
        CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200(), weight_bytes=value)
    with pytest.raises(RoutepackTypeError, match="weight_bytes"):
        CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200(), weight_bytes="2")


def test_from_model_default_weight_bytes_unchanged():
    m = ModelShape(2, 4, 2, 8, 8)
    assert CostModel.from_model(m, Hardware.h200()) == CostModel.from_model(m, Hardware.h200(), weight_bytes=2)
    assert CostModel.from_model(m, Hardware.h200()).token_bytes == 16.0


def test_a_quad_scalar_names_argument():
    with pytest.raises(RoutepackTypeError, match="cost.a_quad"):
        CostModel(a_quad=5, **COST)


@pytest.mark.parametrize(
    "value,exc",
    [
        (-1, RoutepackError),
        (2**64, RoutepackError),
        (1.5, RoutepackTypeError),
        ("2", RoutepackTypeError),
        (True, RoutepackTypeError),
    ],
)
def test_option_ints_checked_naming_option(value, exc):
    with pytest.raises(exc, match="anneal_chains"):
        RoutepackPackingOptions(anneal_chains=value)
    with pytest.raises(exc if value != -1 else RoutepackError, match="packing_exact_nodes"):
        RoutepackPackingOptions(packing_exact_nodes=value if value != 2**64 else 2**64)
    assert RoutepackPackingOptions(anneal_chains=np.int32(3)).anneal_chains == 3


def test_anneal_mix_length_names_option():
    with pytest.raises(RoutepackError, match="anneal_mix: expected 4 weights"):
        RoutepackPackingOptions(anneal_mix=(1.0,))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["i2", "i4", "i8"]),
    st.lists(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True), min_size=1, max_size=12),
)
def test_big_endian_routed_counts_as_native(code, tokens):
    routed = np.array(tokens).reshape(len(tokens), 1, 2)
    cu = np.array([0, len(tokens)])
    native = rp.Window.from_routed_experts(routed.astype("<" + code), cu, 8)
    big = rp.Window.from_routed_experts(routed.astype(">" + code), cu, 8)
    assert big == native
    verl = rp.Window.from_verl(routed.astype(">" + code)[None], np.ones((1, len(tokens)), np.int8), 8)
    assert verl == native
    assert rp.Window.from_slime([routed.astype(">" + code)], 8, add_last_token=False) == native


def _small_plan():
    topo = Topology(2, 2, 1, 3)
    window = rp.Window(np.array([5, 6, 7, 8]), np.ones((4, 2, 4), np.int32))
    cost = CostModel.from_model(ModelShape(2, 4, 2, 8, 8), Hardware.h200())
    return rp.plan_window(window, topo, cost, token_cap=100), window, topo, cost


_FIELD_BREAKS = {
    "replicas": None,
    "migration": None,
    "report": None,
    "placement": None,
    "num_micro": None,
    "sample_rank": None,
    "sample_micro": None,
    "policy": None,
}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(_FIELD_BREAKS)), st.sampled_from([None, [], "x", 1.5, {"a": 1}]))
def test_plan_field_set_to_wrong_type_is_named(name, value):
    plan, window, topo, cost = _small_plan_cached()
    broken = copy.copy(plan)
    if (name, type(value)) in {("report", dict), ("policy", str)}:
        return  # valid values
    setattr(broken, name, value)
    for f in (lambda: rp.simulate(broken, window, topo, cost), lambda: broken.validate(window, topo, 100)):
        with pytest.raises((RoutepackError, RoutepackTypeError), match=name):
            f()


_CACHE: list = []


def _small_plan_cached():
    if not _CACHE:
        _CACHE.append(_small_plan())
    return _CACHE[0]


# ------------------------------------------------------------------ class 7: files
def _window():
    return rp.Window(np.array([5, 6, 7, 8]), np.arange(32, dtype=np.int32).reshape(4, 2, 4) % 3)


def test_save_load_agree_on_the_path(tmp_path):
    plan, window, _, _ = _small_plan_cached()
    for name in ("x", "x.npz", "dir.with.dots"):
        plan.save(tmp_path / f"plan_{name}")
        assert (tmp_path / f"plan_{name}").exists() and not (tmp_path / f"plan_{name}.npz").exists()
        back = rp.Plan.load(tmp_path / f"plan_{name}")
        assert back.same_as(plan) and back.report.keys() == plan.report.keys() and back.policy == plan.policy
        window.save(tmp_path / f"win_{name}")
        assert rp.Window.load(tmp_path / f"win_{name}") == window


def _saved(tmp_path, kind):
    path = tmp_path / f"{kind}.npz"
    (_small_plan_cached()[0] if kind == "plan" else _window()).save(path)
    return path, (rp.Plan.load if kind == "plan" else rp.Window.load)


def _rewrite(path, replace=None, drop=()):
    """Rewrites the .npz at path with some arrays replaced (raw .npy bytes or arrays) or dropped."""
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    for name in drop:
        members.pop(f"{name}.npy")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, data in members.items():
            key = n[:-4]
            if replace and key in replace:
                value = replace[key]
                if not isinstance(value, bytes):
                    import io

                    buf = io.BytesIO()
                    np.lib.format.write_array(buf, np.asanyarray(value), allow_pickle=True)
                    value = buf.getvalue()
                data = value
            zf.writestr(n, data)


@pytest.mark.parametrize("kind", ["plan", "window"])
def test_an_entry_flagged_encrypted_is_a_file_error(tmp_path, kind):
    """A bit flip that sets an entry's encrypted flag in the zip's central directory (zipfile
    then asks for a password with a bare RuntimeError; found by the test below) is a damaged
    file, named."""
    path, load = _saved(tmp_path, kind)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")  # the first central-directory entry; its flag bits at +8
    raw[at + 8] |= 0x1
    path.write_bytes(bytes(raw))
    with pytest.raises(rp.RoutepackFileError, match="encrypted") as e:
        load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("kind", ["plan", "window"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_truncated_or_flipped_file_is_a_file_error(tmp_path_factory, kind, data):
    path, load = _saved(tmp_path_factory.mktemp("f"), kind)
    raw = path.read_bytes()
    if data.draw(st.booleans(), label="truncate"):
        damaged = raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")]
    else:
        i = data.draw(st.integers(0, len(raw) - 1), label="at")
        damaged = raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255), label="xor")]) + raw[i + 1 :]
    path.write_bytes(damaged)
    try:
        load(path)  # a flip in slack bytes may leave a valid file
    except rp.RoutepackFileError as e:
        assert str(path) in str(e)


def _forged_header(shape):
    """A .npy header claiming an array of ``shape`` (40 TiB) with only 16 bytes of data."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 16


def _unbalanced_header():
    """A .npy header with an unclosed bracket: numpy's header parser tokenizes it and raises
    tokenize.TokenError (neither a ValueError nor a SyntaxError; a bit flip can make one)."""
    h = b"{'descr': '<i8', 'fortran_order': False, 'shape': ((2,), }"
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + b"\0" * 16


@pytest.mark.parametrize("kind", ["plan", "window"])
def test_listed_damage_is_a_file_error(tmp_path, kind):
    path, load = _saved(tmp_path, kind)
    path.write_bytes(b"not a zip at all")
    with pytest.raises(rp.RoutepackFileError, match="not an .npz"):
        load(path)
    key = "sample_rank" if kind == "plan" else "seq_lens"
    for replace, drop, match in [
        (None, (key,), "missing arrays"),
        ({key: np.array([object()], dtype=object)}, (), "pickled"),
        ({key: _forged_header((2**40, 5))}, (), "header claims"),
        ({key: _unbalanced_header()}, (), key),
        ({key: np.array([1.5, 2.5])}, (), key),
    ]:
        path, load = _saved(tmp_path, kind)
        _rewrite(path, replace, drop)
        with pytest.raises(rp.RoutepackFileError, match=match) as info:
            load(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "replace,match",
    [
        ({"num_micro": np.float64(2.7)}, "num_micro: expected an integer"),
        ({"num_micro": np.array([1, 2])}, "num_micro: expected an integer"),
        ({"report": np.array("[1, 2]")}, "report: expected a JSON object, got list"),
        ({"report": np.array("{not json")}, "report: not valid JSON"),
        ({"policy": np.array(3)}, "policy: expected a string"),
    ],
)
def test_plan_file_scalars_are_strict(tmp_path, replace, match):
    path, load = _saved(tmp_path, "plan")
    _rewrite(path, replace)
    with pytest.raises(rp.RoutepackFileError, match=match):
        load(path)


def test_missing_file_is_still_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        rp.Plan.load(tmp_path / "nope")


# ------------------------------ classes 5-6 over every stage option: strict and in range
def _option_fields():
    from dataclasses import fields
    from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS

    classes = {s.options for reg in (PLACEMENTS, PACKINGS, REPLICATIONS) for s in reg.values()}
    out = []
    for cls in sorted(classes, key=lambda c: c.__name__):
        for f in fields(cls):
            default = cls().__getattribute__(f.name)
            out.append((cls, f.name, default))
    return out


OPTION_FIELDS = _option_fields()
NON_NUMBERS = st.one_of(
    st.text(max_size=3),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(OPTION_FIELDS), st.data())
def test_every_option_is_strict_and_named(entry, data):
    cls, name, default = entry
    if isinstance(default, tuple):
        value = data.draw(NOT_SEQUENCES, label="value")
    elif isinstance(default, bool):
        value = data.draw(st.one_of(st.integers(), st.text(max_size=2), st.floats()), label="value")
    elif isinstance(default, int) or default is None:
        value = data.draw(
            st.one_of(NON_NUMBERS, st.floats(), st.integers(max_value=-1), st.integers(min_value=2**64)), label="value"
        )
    else:  # a float option
        value = data.draw(st.one_of(NON_NUMBERS, st.sampled_from([float("nan"), float("inf"), -1.0])), label="value")
    try:
        cls(**{name: value})
    except RoutepackError as e:  # RoutepackTypeError included
        assert name in str(e)
    else:  # a float option given a float inside its range, an int option given an int in range
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and default is None


def test_open_files_round_trip_and_damage_is_named():
    import io

    plan = _small_plan_cached()[0]
    buf = io.BytesIO()
    plan.save(buf)
    assert rp.Plan.load(io.BytesIO(buf.getvalue())).same_as(plan)
    with pytest.raises(rp.RoutepackFileError, match="plan file <BytesIO>"):
        rp.Plan.load(io.BytesIO(buf.getvalue()[:100]))


@pytest.mark.parametrize("a, b", [("sample_rank", "sample_micro"), ("slots_per_rank", "num_micro")])
def test_plan_file_with_arrays_swapped_is_refused(tmp_path, a, b):
    """Two arrays of one shape and dtype swapped in the file (found by the fuzz campaign: 10 in
    10^4 damaged files loaded as another plan): the digest saved with the plan refuses it; a
    file written before the digest was saved (none in it) still loads."""
    path, load = _saved(tmp_path, "plan")
    plan = load(path)
    with zipfile.ZipFile(path) as zf:
        members = {n[:-4]: zf.read(n) for n in zf.namelist()}
    _rewrite(path, replace={a: members[b], b: members[a]})
    with pytest.raises(rp.RoutepackFileError, match="not to the digest .* it was saved with"):
        load(path)
    _rewrite(path, replace={a: members[a], b: members[b]}, drop=("digest",))
    assert load(path).same_as(plan)
