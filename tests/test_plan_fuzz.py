"""Property tests of `routepack.plan`: `Placement`, `Plan` and `Plan.validate` on random,
malformed and corrupted inputs (the method: see `fuzzing.py`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import routepack as rp
from fuzzing import (
    assert_absurd_size_fails_cleanly,
    assert_wrong_type_is_clean,
    FUZZ,
    INT_DTYPES,
    OTHER_DTYPES,
    outcome,
    is_int,
    int_array_ok,
    scalars,
)
from random_plans import TOPOLOGIES, assert_plan_invariants, migration_rows, random_case, random_phy2log
from routepack.plan import REPLICA_DTYPE


# --------------------------------------------------------------------- Placement


@st.composite
def placement_inputs(draw):
    E = draw(st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 2.0, None, True])))
    spr = draw(st.one_of(st.integers(1, 4), st.sampled_from([0, -2, 1.0, None, False])))
    dtype = draw(st.sampled_from(INT_DTYPES + OTHER_DTYPES))
    if draw(st.booleans()):
        shape = (draw(st.integers(0, 3)), draw(st.integers(0, 12)))
    else:
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if draw(st.booleans()) and is_int(E) and E >= 1 and len(shape) == 2 and shape[1] >= E:
        # mostly valid: a permutation of every expert plus surplus entries
        rows = []
        for _ in range(shape[0]):
            surplus = draw(st.lists(st.integers(-1, E - 1), min_size=shape[1] - E, max_size=shape[1] - E))
            rows.append(draw(st.permutations(list(range(E)) + surplus)))
        arr = np.array(rows, dtype=np.int64).reshape(shape)
    else:
        arr = draw(hnp.arrays(np.int64, shape, elements=st.integers(-3, 8)))
    if np.dtype(dtype).kind == "u":
        assume((arr >= 0).all())
    return arr.astype(dtype), E, spr


@FUZZ
@given(placement_inputs())
def test_placement(args):
    phy2log, E, spr = args
    p, err = outcome(rp.Placement, phy2log, E, spr)
    valid = (
        is_int(E)
        and E >= 1
        and is_int(spr)
        and spr >= 1
        and int_array_ok(phy2log, 2, np.int32)
        and phy2log.shape[0] >= 1
        and phy2log.shape[1] % spr == 0
        and ((phy2log >= -1) & (phy2log < E)).all()
        and all(set(range(E)) <= set(row.tolist()) for row in phy2log)
    )
    assert (err is None) == valid, (err, phy2log, E, spr)
    if p is not None:
        for l in range(p.num_layers):
            np.testing.assert_array_equal(p.logcnt[l], np.bincount(phy2log[l][phy2log[l] >= 0], minlength=E))
            for e in range(E):
                slots = np.flatnonzero(phy2log[l] == e)
                np.testing.assert_array_equal(p.log2phy[l, e, : len(slots)], slots)
                assert (p.log2phy[l, e, len(slots) :] == -1).all()


# ------------------------------------------------------- Plan and Plan.validate

CORRUPTIONS = [
    "rank_high",
    "rank_neg",
    "micro_high",
    "micro_neg",
    "empty_cell",
    "extra_micro",
    "short_samples",
    "over_cap",
    "share_range",
    "share_sum",
    "src_not_host",
    "src_is_dst",
    "replica_range",
    "migration_expert",
    "migration_rank",
    "migration_bytes",
    "placement_missing_expert",
    "placement_topology",
    "window_shape",
    "stale_logcnt",
    "stale_log2phy",
]


def corrupt(kind: str, case, draw):
    """(plan, window, topo, cap, words): `case` with one invariant broken; `words` must appear
    in the error."""
    plan, window, topo = case.plan, case.window, case.topo
    S, L, E = window.expert_tokens.shape
    M, ep = plan.num_micro, topo.ep
    cap = 10**9
    rank, micro = plan.sample_rank.copy(), plan.sample_micro.copy()
    reps, mig = plan.replicas.copy(), plan.migration.copy()
    p2l = plan.placement.phy2log.copy()
    num_micro = M
    s = draw(st.integers(0, S - 1))
    words = ""
    if kind == "rank_high":
        rank[s] = draw(st.integers(topo.dp, topo.dp + 100))
        words = "outside"
    elif kind == "rank_neg":
        rank[s] = draw(st.integers(-100, -1))
        words = "outside"
    elif kind == "micro_high":
        micro[s] = draw(st.integers(M, M + 5))
        words = "outside"
    elif kind == "micro_neg":
        micro[s] = -1
        words = "outside"
    elif kind == "empty_cell":
        d, m = draw(st.integers(0, topo.dp - 1)), draw(st.integers(0, M - 1))
        inside = (rank == d) & (micro == m)
        rank[inside], micro[inside] = (d + 1) % topo.dp, (m + 1) % M
        assume(topo.dp * M > 1)
        words = "empty"
    elif kind == "extra_micro":
        num_micro = M + 1
        words = "empty"
    elif kind == "short_samples":
        rank, micro = rank[:-1], micro[:-1]
        words = "exactly once"
    elif kind == "over_cap":
        per_cell = np.bincount(rank.astype(np.int64) * M + micro, weights=window.seq_lens)
        cap = int(per_cell.max()) - 1
        words = "over the cap"
    elif kind in ("share_range", "share_sum", "src_not_host", "src_is_dst", "replica_range"):
        assume(len(reps) > 0)
        i = draw(st.integers(0, len(reps) - 1))
        spr = topo.slots_per_rank
        if kind == "share_range":
            reps["share"][i] = draw(st.sampled_from([-0.1, 1.5, float("nan"), float("inf"), -float("inf")]))
            words = "share"
        elif kind == "share_sum":
            extra = reps[i : i + 1].copy()
            others = [r for r in range(ep) if r != extra["src_rank"][0]]
            extra["dst_rank"] = draw(st.sampled_from(others))
            extra["share"] = 1.0
            reps["share"][i] = 0.5
            reps = np.concatenate([reps, extra])
            words = "sum to"
        elif kind == "src_not_host":
            r = reps[i]
            hosts = set((np.flatnonzero(p2l[r["layer"]] == r["expert"]) // spr).tolist())
            free = [q for q in range(ep) if q not in hosts and q != r["dst_rank"]]
            assume(free)
            reps["src_rank"][i] = draw(st.sampled_from(free))
            words = "does not host"
        elif kind == "src_is_dst":
            reps["dst_rank"][i] = reps["src_rank"][i]
            words = "own source rank"
        else:
            field, bad = draw(
                st.sampled_from(
                    [
                        ("micro", M),
                        ("group", topo.num_groups),
                        ("layer", L),
                        ("expert", E),
                        ("src_rank", ep),
                        ("dst_rank", ep),
                        ("micro", -1),
                        ("dst_rank", -1),
                    ]
                )
            )
            reps[field][i] = bad
            words = "out of range"
    elif kind in ("migration_expert", "migration_rank", "migration_bytes"):
        if len(mig) == 0:
            prev = random_phy2log(np.random.default_rng(draw(st.integers(0, 99))), L, E, topo)
            mig = migration_rows(prev, p2l, E, topo.slots_per_rank, case.cost.expert_state_bytes)
        assume(len(mig) > 0)
        i = draw(st.integers(0, len(mig) - 1))
        if kind == "migration_expert":
            assume(E > 1)
            mig["expert"][i] = (mig["expert"][i] + draw(st.integers(1, E - 1))) % E
            words = "holds"
        elif kind == "migration_rank":
            assume(ep > 1)
            mig["dst_rank"][i] = (mig["dst_rank"][i] + 1) % ep
            words = "disagree"
        else:
            mig["bytes"][i] = draw(st.sampled_from([-1.0, float("nan"), float("inf")]))
            words = "out of range"
    elif kind == "placement_missing_expert":
        l, e = draw(st.integers(0, L - 1)), draw(st.integers(0, E - 1))
        placement = rp.Placement(p2l, E, topo.slots_per_rank)
        with pytest.raises(ValueError, match="read-only"):
            placement.phy2log[l][placement.phy2log[l] == e] = -1
        # forcing write access back on (the placement owns its copy) is the only way in
        placement.phy2log.setflags(write=True)
        placement.phy2log[l][placement.phy2log[l] == e] = -1  # mutated after its own check
        bad = rp.Plan(placement, rank, micro, num_micro, reps, mig)
        return bad, window, topo, cap, f"no slot for logical expert {e}"
    elif kind in ("stale_logcnt", "stale_log2phy"):
        # phy2log stays valid (a fresh placement of it passes), but logcnt / log2phy were
        # derived from the old one: the first kind adds a copy of an expert in a free or
        # redundant slot (its replica count changes), the second swaps two slots of
        # different experts (counts stay, slots move)
        l = draw(st.integers(0, L - 1))
        row = p2l[l].copy()
        counts = np.bincount(row[row >= 0], minlength=E)
        if kind == "stale_logcnt":
            spare = [q for q in range(len(row)) if row[q] < 0 or counts[row[q]] > 1]
            assume(spare and E > 1)
            q = draw(st.sampled_from(spare))
            row[q] = draw(st.sampled_from([x for x in range(E) if x != row[q]]))
        else:
            pairs = [(a, b) for a in range(len(row)) for b in range(a) if row[a] != row[b]]
            assume(pairs)
            a, b = draw(st.sampled_from(pairs))
            row[a], row[b] = row[b], row[a]
        new = p2l.copy()
        new[l] = row
        rp.Placement(new, E, topo.slots_per_rank)  # valid in itself
        placement = rp.Placement(p2l, E, topo.slots_per_rank)
        placement.phy2log = new  # reassigned: the derived tables are the old ones
        # no replicas or moves, which the new slots might contradict first
        plan = rp.Plan(placement, rank, micro, num_micro)
        words = r"placement.logcnt\[" if kind == "stale_logcnt" else r"placement.log2phy\["
        return plan, window, topo, cap, words
    elif kind == "placement_topology":
        other = rp.Topology(topo.dp, topo.ep, topo.gpus_per_node, topo.slots_per_rank + 1)
        return dataclasses.replace(plan), window, other, cap, "slots"
    elif kind == "window_shape":
        other = rp.Window(window.seq_lens, np.concatenate([window.expert_tokens] * 2, axis=1))
        return dataclasses.replace(plan), other, topo, cap, "placement is for"
    placement = rp.Placement(p2l, E, topo.slots_per_rank)
    return rp.Plan(placement, rank, micro, num_micro, reps, mig), window, topo, cap, words


@FUZZ
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(CORRUPTIONS), data=st.data())
def test_validate_rejects_corrupted_plans(seed, kind, data):
    case = random_case(seed, TOPOLOGIES[seed % 4])  # ep >= 2: replicas exist
    case.plan.validate(case.window, case.topo, 10**9)
    assert_plan_invariants(case.plan, case.window, case.topo, 10**9)
    plan, window, topo, cap, words = corrupt(kind, case, data.draw)
    with pytest.raises(rp.InvalidPlanError, match=words):
        plan.validate(window, topo, cap)
    if kind != "over_cap":  # simulate checks every invariant but the cap (and the cost first)
        with pytest.raises(ValueError if kind == "window_shape" else rp.InvalidPlanError):
            rp.simulate(plan, window, topo, case.cost)


@FUZZ
@given(
    rank=hnp.arrays(st.sampled_from(INT_DTYPES + OTHER_DTYPES), hnp.array_shapes(min_dims=0, max_dims=2, max_side=4)),
    micro=hnp.arrays(st.sampled_from(INT_DTYPES + OTHER_DTYPES), hnp.array_shapes(min_dims=0, max_dims=2, max_side=4)),
    num_micro=scalars(-1, 4, huge=False),
    replicas=st.sampled_from(["ok", "float", "2d", "list", "other_dtype"]),
)
def test_plan_constructor_and_validate(rank, micro, num_micro, replicas):
    topo = rp.Topology(2, 2, 2, 2)
    window = rp.Window(np.array([3, 4, 5]), np.ones((3, 1, 3), dtype=np.int32))
    placement = rp.Placement.static(1, 3, topo)
    table = {
        "ok": np.zeros(0, REPLICA_DTYPE),
        "float": np.zeros(3),
        "2d": np.zeros((1, 1), REPLICA_DTYPE),
        "list": [],
        "other_dtype": np.zeros(2, dtype=[("micro", "<i8")]),
    }[replicas]
    plan, err = outcome(rp.Plan, placement, rank, micro, num_micro, replicas=table)
    if plan is None:
        return
    assert replicas == "ok" and is_int(num_micro) and num_micro >= 1
    _, err = outcome(plan.validate, window, topo, 100)
    if err is None:
        assert_plan_invariants(plan, window, topo, 100)
    else:
        assert isinstance(err, rp.InvalidPlanError), err


# ------------------------------------------------- wrong argument types, by hand

WRONG_TYPES = {
    "validate(window=str)": lambda t, w, c, p: p.validate("window", t, 10),
    "validate(topo=str)": lambda t, w, c, p: p.validate(w, "topo", 10),
    "validate(token_cap=2**70)": lambda t, w, c, p: p.validate(w, t, 2**70),
    "Placement.static(topo=str)": lambda t, w, c, p: rp.Placement.static(1, 2, "topo"),
    "Placement.static(num_layers=-1)": lambda t, w, c, p: rp.Placement.static(-1, 2, t),
    "Plan(placement=str).validate": lambda t, w, c, p: rp.Plan("placement", [0, 1], [0, 0], 1).validate(w, t, 10),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_argument_types_are_clean_errors(name):
    assert_wrong_type_is_clean(WRONG_TYPES[name])


# ---------------------------------- absurd sizes, each in its own interpreter

ABSURD = {
    "Placement(num_experts=10**18)": "rp.Placement(np.zeros((1, 2), np.int32), 10**18, 1)",
    # 64 GiB of phy2log from a valid topology (it aborted the interpreter on allocation)
    "Placement.static(64 GiB)": "rp.Placement.static(16, 2, rp.Topology(2, 2, 2, 2**29))",
    # a 512 kB phy2log whose log2phy [L, E, max_replicas] would take 16 GiB
    "Placement(log2phy of 16 GiB)": "rp.Placement(np.concatenate([np.arange(65536), np.zeros(65537)]).astype(np.int32)[None], 65536, 1)",
    "Placement.static(num_layers=2**40)": "rp.Placement.static(2**40, 4, rp.Topology(2, 2, 2, 2))",
    "Placement.static(slots_per_rank=2**40)": "rp.Placement.static(1, 2, rp.Topology(1, 1, 1, 2**40))",
    "validate(dp=2**40)": "plan.validate(window, rp.Topology(2**40, 1, 1, 1), 10)",
    "validate(num_micro=2**40)": "rp.Plan(plan.placement, plan.sample_rank, plan.sample_micro, 2**40).validate(window, topo, 10)",
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_fail_cleanly(name):
    assert_absurd_size_fails_cleanly(ABSURD[name])


# ---------------------------------- Plan and Placement methods: their arguments checked

INDEX_VALUES = st.one_of(
    st.integers(-3, 10),
    st.sampled_from([2**63, -(2**63) - 1, 2**64]),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=2),
    st.booleans(),
    st.sampled_from([np.int64(1), np.uint8(0), [0], (0,)]),
)


@FUZZ
@given(seed=st.integers(0, 10**6), layer=INDEX_VALUES, rank=INDEX_VALUES)
def test_rank_experts_takes_indices_in_range(seed, layer, rank):
    p = random_case(seed).plan.placement
    got, err = outcome(p.rank_experts, layer, rank)
    valid = is_int(layer) and 0 <= layer < p.num_layers and is_int(rank) and 0 <= rank < p.num_ranks
    assert (err is None) == valid, err
    if valid:
        lo = int(rank) * p.slots_per_rank
        assert np.array_equal(got, p.phy2log[int(layer), lo : lo + p.slots_per_rank])
    else:
        assert "layer" in str(err) or "rank" in str(err), err


@FUZZ
@given(seed=st.integers(0, 10**6), rank=INDEX_VALUES, micro=INDEX_VALUES)
def test_cell_samples_takes_ints_from_zero(seed, rank, micro):
    plan = random_case(seed).plan
    got, err = outcome(plan.cell_samples, rank, micro)
    valid = all(is_int(v) and 0 <= v <= 2**63 - 1 for v in (rank, micro))
    assert (err is None) == valid, err
    if valid:  # a rank or step beyond the plan's runs no sample
        assert np.array_equal(got, np.flatnonzero((plan.sample_rank == rank) & (plan.sample_micro == micro)))
    else:
        assert "rank" in str(err) or "micro" in str(err), err


@FUZZ
@given(seed=st.integers(0, 10**6), other=st.one_of(scalars(), st.sampled_from([{}, [], (), "plan"])))
def test_same_as_takes_only_a_plan(seed, other):
    plan = random_case(seed).plan
    assert plan.same_as(dataclasses.replace(plan, report={"x": 1}))
    _, err = outcome(plan.same_as, other)
    assert err is not None and "other" in str(err), err


#: JSON-able report values, and ones that are not (each with the Python type json rejects)
REPORT_OK = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**20), 10**20),
        st.floats(allow_nan=False),
        st.text(max_size=3),
        st.sampled_from([np.int64(3), np.float32(0.5), np.bool_(True), np.arange(3)]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-5, 5)), inner, max_size=3),
    ),
    max_leaves=8,
)
REPORT_BAD = st.sampled_from([{1, 2}, object(), frozenset(), b"x", 1j, np.datetime64("2020-01-01")])


@FUZZ
@given(
    seed=st.integers(0, 10**6),
    report=st.dictionaries(st.text(max_size=3), REPORT_OK, max_size=3),
    bad=st.one_of(st.none(), REPORT_BAD),
    key=st.sampled_from(["a", 3, ("t",)]),
    data=st.data(),
)
def test_plan_save_names_the_report_entry_it_cannot_write(seed, report, bad, key, data):
    import io
    import json

    plan = random_case(seed).plan
    plan.report = dict(report)
    if bad is not None or key == ("t",):
        # an unwritable value (or a key JSON cannot hold) somewhere in the report
        where = data.draw(st.sampled_from(["top", "nested"]))
        value = bad if bad is not None else 1
        plan.report = {key: value} if where == "top" else {"n": [0, {key: value}]}
        _, err = outcome(plan.save, io.BytesIO())
        assert err is not None and isinstance(err, rp.RoutepackTypeError), err
        assert str(err).startswith("report"), err
        if where == "nested":
            assert str(err).startswith("report['n'][1]"), err
        return
    buf = io.BytesIO()
    plan.save(buf)
    buf.seek(0)
    back = rp.Plan.load(buf)
    assert back.same_as(plan)
    assert back.report == json.loads(json.dumps(back.report))  # what JSON holds, read back


#: what save/load take as a path, and what they refuse (an int would be a file descriptor)
BAD_PATHS = st.sampled_from([None, 3.5, {}, [], 2**40, -1, 0, True, b"x", b"\0", "", "a\0b", object()])


@FUZZ
@given(bad=BAD_PATHS, which=st.sampled_from(["Window", "Plan", "CostModel"]), load=st.booleans())
def test_save_and_load_refuse_what_is_no_path_naming_it(bad, which, load, tmp_path_factory):
    topo, window, cost, plan = _SMALL
    obj = {"Window": window, "Plan": plan, "CostModel": cost}[which]
    _, err = outcome(getattr(type(obj), "load"), bad) if load else outcome(obj.save, bad)
    assert err is not None and str(err).startswith("path:"), err
    path = tmp_path_factory.mktemp("paths") / "x"  # a pathlib.Path and its str both work
    for p in (path, str(path)):
        obj.save(p)
        back = type(obj).load(p)
        assert back.same_as(obj) if which == "Plan" else back == obj


_SMALL = None


def setup_module(module):
    from fuzzing import small_plan

    module._SMALL = small_plan()
