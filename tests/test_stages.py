"""routepack.stages: the registry lists every choice with its options dataclass, option
defaults are the core's, values are checked by the dataclass, stage-prefixed names (and the
deprecated old ones), and registering a choice of one's own."""

import ast
import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

import routepack as rp
import routepack.packing
import routepack.replication
from routepack import _core, stages
from routepack.stages import (
    DEPRECATED_OPTIONS,
    KNOWN_OPTIONS,
    PACKINGS,
    PLACEMENTS,
    REPLICATIONS,
    STAGES,
    EplbOptions,
    HotNOptions,
    MoonEpOptions,
    NoOptions,
    RelibraReplicationOptions,
    RoutepackPackingOptions,
    RoutepackPlacementOptions,
    RoutepackReplicationOptions,
    StageOptions,
    UltraEpOptions,
)

PACKAGE = Path(rp.__file__).parent

SMALL = dataclasses.replace(
    rp.traces.profile("tiny"),
    num_layers=2,
    attention=("linear", "full"),
    num_experts=16,
    top_k=2,
    dp=4,
    ep=2,
    gpus_per_node=2,
    slots_per_rank=10,
    samples=32,
    group_size=4,
    token_cap=8192,
    max_response=4096,
)


@pytest.fixture(scope="module")
def case():
    w = next(iter(rp.traces.synthetic(SMALL, 1, seed=2)))
    return w, SMALL.topology(), SMALL.cost(), SMALL.token_cap


def plan(case, policy="routepack", **options):
    w, topo, cost, cap = case
    return rp.plan_window(w, topo, cost, cap, policy=policy, anneal_moves=2000, **options)


def same(a: rp.Plan, b: rp.Plan) -> bool:
    return (
        np.array_equal(a.sample_rank, b.sample_rank)
        and np.array_equal(a.sample_micro, b.sample_micro)
        and a.placement == b.placement
        and np.array_equal(a.replicas, b.replicas)
    )


# ------------------------------------------------------------------ registry
def test_every_choice_is_listed_with_its_options():
    assert set(PLACEMENTS) == {"static", "eplb", "eplb_hierarchical", "relibra", "routepack"}
    assert set(PACKINGS) == {"sequential", "kk", "routepack"}
    assert set(REPLICATIONS) == {"none", "hot_n", "relibra", "routepack", "moonep", "ultraep"}
    assert PLACEMENTS["eplb"].options is EplbOptions
    assert PLACEMENTS["eplb_hierarchical"].options is EplbOptions
    assert PLACEMENTS["routepack"].options is RoutepackPlacementOptions
    assert PACKINGS["routepack"].options is RoutepackPackingOptions
    assert REPLICATIONS["hot_n"].options is HotNOptions
    assert REPLICATIONS["relibra"].options is RelibraReplicationOptions
    assert REPLICATIONS["routepack"].options is RoutepackReplicationOptions
    assert REPLICATIONS["moonep"].options is MoonEpOptions
    assert REPLICATIONS["ultraep"].options is UltraEpOptions
    for table in STAGES.values():
        for stage in table.values():
            assert callable(stage.run)
            assert issubclass(stage.options, StageOptions) and stage.options.__dataclass_params__.frozen


def test_known_options_are_the_dataclass_fields():
    fields = {f.name for table in STAGES.values() for s in table.values() for f in dataclasses.fields(s.options)}
    assert KNOWN_OPTIONS == fields == stages.known_options()
    assert rp.policies.KNOWN_OPTIONS == KNOWN_OPTIONS
    for name in KNOWN_OPTIONS:  # prefixed by their stage
        assert name.split("_")[0] in ("placement", "eplb", "anneal", "packing", "replication"), name
    for old, new in DEPRECATED_OPTIONS.items():
        assert old not in KNOWN_OPTIONS and new in KNOWN_OPTIONS


def test_defaults_are_the_cores():
    core = _core.defaults()
    seen = {}
    for table in STAGES.values():
        for s in table.values():
            for f in dataclasses.fields(s.options):
                seen[f.name] = f.default
    flat = {k: v for group in core.values() for k, v in group.items()}
    assert flat.pop("anneal_moves") == rp.packing.DEFAULT_ANNEAL_MOVES == stages.DEFAULT_ANNEAL_MOVES
    assert (
        flat.pop("anneal_moves_across_nodes")
        == rp.packing.DEFAULT_ANNEAL_MOVES_ACROSS_NODES
        == stages.DEFAULT_ANNEAL_MOVES_ACROSS_NODES
    )
    for name, default in seen.items():
        if default is None:  # computed by the stage from the window and topology
            assert name in (
                "placement_cells",
                "placement_explore",
                "eplb_num_groups",
                "replication_buffers",
                "replication_redundant",
            ), name
        else:
            assert flat.pop(name) == default, name
    assert flat == {"placement_explore": core["placement"]["placement_explore"]}
    # placement_explore's rule (the default room or the slack) is the core's: test_binding_defaults
    assert RoutepackPlacementOptions(placement_slack=0.5).placement_explore is None
    assert RoutepackPlacementOptions(placement_slack=0.5, placement_explore=0.75).placement_explore == 0.75
    assert rp.replication.DEFAULT_HOT_EXPERTS == core["replication"]["replication_hot_experts"]
    assert rp.replication.DEFAULT_REPLICATION_SLOTS == core["replication"]["replication_slots"]


def test_no_module_writes_a_default_or_fills_a_registry():
    """Stage defaults come from _core.defaults() only, and only stages/registry.py builds the
    tables (no import side effects; register_* is the run-time API)."""
    tables = {"PLACEMENTS", "PACKINGS", "REPLICATIONS", "KNOWN_OPTIONS", "STAGES"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Name) and base.id in tables and path.name != "registry.py":
                    raise AssertionError(f"{path}: assigns {base.id}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "add", "setdefault", "pop", "clear", "__setitem__")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in tables
            ):
                raise AssertionError(f"{path}:{node.lineno}: mutates {node.func.value.id}")
    for path in (PACKAGE / "stages").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "StageOptions" for b in node.bases):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Constant):
                        raise AssertionError(f"{path}: {node.name}.{ast.unparse(item.target)} writes a default")


# ------------------------------------------------------------------ values
@pytest.mark.parametrize(
    "cls,name,value,error",
    [
        (RoutepackPlacementOptions, "placement_chunks", -1, rp.RoutepackError),
        (RoutepackPlacementOptions, "placement_chunks", 2.0, rp.RoutepackTypeError),
        (RoutepackPlacementOptions, "placement_cells", 0, rp.RoutepackError),
        (RoutepackPlacementOptions, "placement_slack", 1.5, rp.RoutepackError),
        (RoutepackPlacementOptions, "placement_slack", float("nan"), rp.RoutepackError),
        (RoutepackPlacementOptions, "placement_explore", 2.0, rp.RoutepackError),
        (RoutepackPlacementOptions, "placement_explore", 1e-6, rp.RoutepackError),  # below the slack
        (RoutepackPlacementOptions, "placement_fluct_evals", 1.5, rp.RoutepackTypeError),
        (RoutepackPlacementOptions, "placement_migration_aware", 1, rp.RoutepackTypeError),
        (EplbOptions, "eplb_num_groups", 0, rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_chains", 0, rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_steps", True, rp.RoutepackTypeError),
        (RoutepackPackingOptions, "anneal_lambda", -0.5, rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_start_accept", 1.0, rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_cooling", 0.0, rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_mix", (1.0, 0.0), rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_mix", (0.0, 0.0, 0.0, 0.0), rp.RoutepackError),
        (RoutepackPackingOptions, "anneal_mix", "abcd", rp.RoutepackTypeError),
        (RoutepackPackingOptions, "packing_exact_nodes", -1, rp.RoutepackError),
        (HotNOptions, "replication_hot_experts", 0, rp.RoutepackError),
        (RelibraReplicationOptions, "replication_slots", -1, rp.RoutepackError),
        (RoutepackReplicationOptions, "replication_candidates", 0, rp.RoutepackError),
    ],
)
def test_values_are_checked_by_the_dataclass(cls, name, value, error):
    with pytest.raises(error, match=name):
        cls(**{name: value})


def test_values_are_normalised_and_frozen():
    o = RoutepackPackingOptions(anneal_chains=np.int64(3), anneal_mix=[1, 0, 0, 0], anneal_lambda=1)
    assert type(o.anneal_chains) is int and o.anneal_mix == (1.0, 0.0, 0.0, 0.0) and type(o.anneal_lambda) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.anneal_chains = 4  # type: ignore[misc]
    assert RoutepackPlacementOptions(placement_migration_aware=np.bool_(False)).placement_migration_aware is False


def test_bad_values_raise_whichever_stages_run(case):
    with pytest.raises(rp.RoutepackError, match="replication_hot_experts"):
        plan(case, "static", replication_hot_experts=0)
    with pytest.raises(rp.RoutepackError, match="anneal_chains"):
        plan(case, "static", anneal_chains=0)


# ------------------------------------------------------------------ names
def test_unknown_names_list_the_valid_ones(case):
    with pytest.raises(rp.RoutepackError, match="unknown option.*'replica_slotz'.*known.*'replication_slots'"):
        plan(case, "static", replica_slotz=2)


@pytest.mark.parametrize(
    "old,new,value,policy",
    [
        ("replica_slots", "replication_slots", 1, "routepack"),
        ("hot_experts", "replication_hot_experts", 1, "hot_n"),
        ("exact_nodes", "packing_exact_nodes", 10, "routepack_packing"),
    ],
)
def test_old_names_still_work_with_a_deprecation_warning(case, old, new, value, policy):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated; use '{new}'") as rec:
        a = plan(case, policy, **{old: value})
    assert rec[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = plan(case, policy, **{new: value})
    assert same(a, b)
    with pytest.warns(DeprecationWarning), pytest.raises(rp.RoutepackError, match="same option"):
        plan(case, policy, **{old: value, new: value})


def test_the_old_name_of_the_replication_budget_default_still_works_with_a_warning():
    """``DEFAULT_REPLICA_SLOTS`` was the replication budget's default; ``replica_slots`` now
    names only the topology's replica buffers (`Topology.replica_slots`)."""
    with pytest.warns(DeprecationWarning, match="DEFAULT_REPLICATION_SLOTS") as rec:
        old = rp.replication.DEFAULT_REPLICA_SLOTS
    assert rec[0].filename == __file__  # points at the caller
    assert old == rp.replication.DEFAULT_REPLICATION_SLOTS
    with pytest.warns(DeprecationWarning):
        from routepack.replication import DEFAULT_REPLICA_SLOTS  # noqa: F401
    with pytest.raises(AttributeError, match="DEFAULT_REPLICA_SLOTZ"):
        rp.replication.DEFAULT_REPLICA_SLOTZ  # noqa: B018


def test_options_change_the_plan_they_name(case):
    base = plan(case, "routepack", replication_slots=0)
    assert len(base.replicas) == 0
    assert len(plan(case, "routepack", replication_slots=2).replicas) > 0
    assert same(plan(case, "routepack", placement_chunks=32), plan(case, "routepack"))


# ------------------------------------------------------------------ registering
def test_register_a_choice_of_ones_own(case):
    @dataclasses.dataclass(frozen=True)
    class MirrorOptions(StageOptions):
        mirror_flip: bool = dataclasses.field(default=False, metadata={"check": stages.options.flag()})

    seen = []

    def mirror(ctx, options, placement, sample_rank, sample_micro, num_micro):
        seen.append(options)
        return REPLICATIONS["none"].run(ctx, NoOptions(), placement, sample_rank, sample_micro, num_micro)

    stages.register_replication("test_mirror", mirror, MirrorOptions)
    try:
        assert "mirror_flip" in stages.known_options()
        p = plan(case, rp.Policy("static", "sequential", "test_mirror"), mirror_flip=True)
        assert seen == [MirrorOptions(mirror_flip=True)] and len(p.replicas) == 0
        with pytest.raises(rp.RoutepackTypeError, match="mirror_flip"):
            plan(case, "static", mirror_flip="yes")
        with pytest.raises(rp.RoutepackError, match="already registered"):
            stages.register_replication("test_mirror", mirror)
        with pytest.raises(rp.RoutepackTypeError, match="options"):
            stages.register_placement("test_bad", lambda ctx, o: None, dict)
    finally:
        del REPLICATIONS["test_mirror"]
    assert "mirror_flip" not in stages.known_options()
    with pytest.raises(rp.RoutepackError, match="unknown choice 'test_mirror'"):
        plan(case, rp.Policy("static", "sequential", "test_mirror"))


# ------------------------------------------- stage functions check what they are handed

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzzing import FUZZ, outcome  # noqa: E402

TOPO = rp.Topology(4, 2, 2, 3)
WINDOW = rp.Window(
    np.array([5, 3, 7, 2, 6, 4, 1, 8]),
    np.minimum(np.arange(8 * 2 * 4).reshape(8, 2, 4) % 5, np.array([5, 3, 7, 2, 6, 4, 1, 8])[:, None, None]).astype(
        np.int32
    ),
)
COST = rp.CostModel(1e-6, [0.0, 1e-9], 1e-6, 1e-5, 1e3, 1e10, 1e9, 1e6, 1e6, 1e6)
STATIC = rp.Placement.static(2, 4, TOPO)
#: (stage function, its options class, the arguments after ctx and options)
STAGE_FUNCTIONS = (
    [
        (stages.static_placement, NoOptions, ()),
        (stages.eplb_placement, EplbOptions, ()),
        (stages.placement.eplb_hierarchical_placement, EplbOptions, ()),
        (stages.relibra_placement, NoOptions, ()),
        (stages.routepack_placement, RoutepackPlacementOptions, ()),
    ]
    + [
        (f, o, (STATIC,))
        for f, o in (
            (stages.sequential_packing, NoOptions),
            (stages.kk_packing, NoOptions),
            (stages.routepack_packing, RoutepackPackingOptions),
        )
    ]
    + [
        (f, o, "layout")
        for f, o in (
            (stages.no_replication, NoOptions),
            (stages.hot_n_replication, HotNOptions),
            (stages.relibra_replication, RelibraReplicationOptions),
            (stages.routepack_replication, RoutepackReplicationOptions),
        )
    ]
)
#: values no field takes, and per field a few it must refuse beside them
JUNK = [None, "x", 1.5, -1, [], {}, object()]
BAD_FIELDS = {
    "window": JUNK,
    "topo": JUNK + [rp.Topology(4, 2, 2, 1)],
    "cost": JUNK + [dataclasses.replace(COST, a_quad=[0.0])],
    "token_cap": JUNK + [0, 2**64, True, np.float64(8)],
    "seed": JUNK + [2**64, "0"],
    "anneal_moves": ["x", 1.5, -1, 2**64, [], True],
    "time_budget_s": ["x", -1.0, float("nan"), float("inf"), []],
    "previous": JUNK + [rp.Placement.static(1, 4, TOPO)],
    "previous_window": JUNK + [rp.Window(np.array([3]), np.zeros((1, 2, 5), np.int32))],
    "options": JUNK[:3] + [[("a", 1)]],
    "policy": JUNK[:3] + ["static"],
    "reports": JUNK[:3] + [[]],
}


def context(**fields):
    ctx = stages.PlanContext(WINDOW, TOPO, COST, 16, seed=1, anneal_moves=500, previous_window=WINDOW)
    for k, v in fields.items():
        setattr(ctx, k, v)
    return ctx


def call(fn, options, rest, ctx):
    if rest == "layout":
        rank, micro, m, _ = stages.sequential_packing(context(), NoOptions(), STATIC)
        rest = (STATIC, rank, micro, m)
    return fn(ctx, options, *rest)


@FUZZ
@given(stage=st.sampled_from(STAGE_FUNCTIONS), field=st.sampled_from(sorted(BAD_FIELDS)), data=st.data())
def test_stage_functions_refuse_a_bad_context_naming_the_field(stage, field, data):
    fn, options_class, rest = stage
    assert call(fn, options_class(), rest, context()) is not None  # the context as made is fine
    bad = data.draw(st.sampled_from(BAD_FIELDS[field]))
    _, err = outcome(call, fn, options_class(), rest, context(**{field: bad}))
    named = {"cost": ("cost", "a_quad"), "topo": ("topo", "num_experts", "slots")}.get(field, (field,))
    assert err is not None and any(n in str(err) for n in named), (field, bad, err)


OPTION_CLASSES = [
    NoOptions,
    EplbOptions,
    RoutepackPlacementOptions,
    RoutepackPackingOptions,
    HotNOptions,
    RelibraReplicationOptions,
    RoutepackReplicationOptions,
]


@FUZZ
@given(
    stage=st.sampled_from(STAGE_FUNCTIONS),
    options=st.one_of(st.sampled_from(OPTION_CLASSES).map(lambda c: c()), st.sampled_from(JUNK)),
)
def test_stage_functions_take_only_their_own_options(stage, options):
    fn, options_class, rest = stage
    got, err = outcome(call, fn, options, rest, context())
    assert (err is None) == isinstance(options, options_class), err
    if err is not None:
        assert str(err).startswith("options:") and options_class.__name__ in str(err), err


@FUZZ
@given(
    stage=st.sampled_from([s for s in STAGE_FUNCTIONS if s[2] != ()]),
    what=st.sampled_from(["placement", "sample_rank", "sample_micro", "num_micro"]),
    bad=st.sampled_from(
        JUNK
        + [rp.Placement.static(1, 1, rp.Topology(1, 1, 1, 1)), np.zeros(3, np.int32), np.zeros(8, np.float64), 2**40, 0]
    ),
)
def test_packing_and_replication_check_the_placement_and_layout(stage, what, bad):
    fn, options_class, rest = stage
    if rest != "layout" and what != "placement":
        return
    rank, micro, m, _ = stages.sequential_packing(context(), NoOptions(), STATIC)
    args = {"placement": STATIC, "sample_rank": rank, "sample_micro": micro, "num_micro": m}
    args[what] = bad
    extra = (args["placement"],) if rest != "layout" else tuple(args.values())
    _, err = outcome(fn, context(), options_class(), *extra)
    assert err is not None and what in str(err), (what, bad, err)


def test_too_few_samples_for_the_cells_is_infeasible_naming_why():
    for n, cap, steps in ((3, 100, "one microbatch"), (5, 6, "the 2 microbatches token_cap = 6 needs")):
        w = rp.Window(np.full(n, 5), np.ones((n, 2, 4), np.int32))
        for run in (
            lambda: rp.plan_window(w, TOPO, COST, cap, policy="static"),
            lambda: stages.kk_packing(context(window=w, previous_window=None, token_cap=cap), NoOptions(), STATIC),
        ):
            with pytest.raises(rp.InfeasibleError, match=rf"window: its {n} samples cannot fill {steps}.*topo.dp = 4"):
                run()


# ------------------------------------------- the registry's and presets' arguments

COLUMN = st.one_of(
    st.integers(0, 6).flatmap(
        lambda n: st.sampled_from([np.int32, np.int64, np.uint8, np.float32, np.bool_]).map(
            lambda d: np.arange(n).astype(d)
        )
    ),
    st.sampled_from(
        [
            None,
            "x",
            3,
            [1.5],
            [0, 1],
            np.full(2, 2**40),
            np.zeros((2, 2), np.int32),
            np.array([np.nan, 0.5]),
            np.array(["a", "b"]),
        ]
    ),
)


@FUZZ
@given(cols=st.lists(COLUMN, min_size=0, max_size=8))
def test_replica_table_checks_its_columns(cols):
    t, err = outcome(stages.replica_table, tuple(cols))
    arrs = [np.asarray(c) for c in cols]
    ids_ok = all(
        a.ndim == 1 and a.dtype.kind in "iu" and (a.size == 0 or (a.min() >= -(2**31) and a.max() < 2**31))
        for a in arrs[:6]
    )
    share = arrs[6] if len(arrs) == 7 else None
    share_ok = (
        share is not None
        and share.ndim == 1
        and share.dtype.kind in "iuf"
        and bool(np.isfinite(share.astype(np.float32)).all())
    )
    valid = len(arrs) == 7 and ids_ok and share_ok and len({len(a) for a in arrs}) == 1
    assert (err is None) == valid, (err, cols)
    if valid:
        for name, a in zip(rp.REPLICA_DTYPE.names, arrs):
            assert np.array_equal(t[name], a.astype(t.dtype[name]))
    else:
        assert "columns" in str(err), err


@FUZZ
@given(
    options=st.one_of(
        st.sampled_from([j for j in JUNK if j != {}] + [[("anneal_chains", 2)], "anneal_chains"]),
        st.dictionaries(
            st.one_of(st.integers(), st.none(), st.tuples(st.text(max_size=2))), st.integers(), min_size=1, max_size=2
        ),
    ),
    policy=st.one_of(
        st.sampled_from(JUNK + ["static", {"dp": 2}]),
        st.builds(
            rp.Policy,
            st.one_of(st.sampled_from(sorted(PLACEMENTS) + ["nope"]), st.sampled_from(JUNK)),
            st.just("kk"),
            st.one_of(st.just("none"), st.sampled_from(JUNK)),
        ),
    ),
)
def test_registry_functions_check_their_arguments(options, policy):
    _, err = outcome(stages.canonical_options, options)
    assert err is not None and str(err).startswith("options:"), err
    _, err = outcome(stages.stage_options, policy, {})
    valid = (
        isinstance(policy, rp.Policy)
        and isinstance(policy.placement, str)
        and policy.placement in PLACEMENTS
        and policy.replication == "none"
    )
    assert (err is None) == valid, (policy, err)
    if err is not None and not isinstance(policy, str):  # resolve takes a preset's name too
        assert str(err).startswith("policy"), err
        _, err2 = outcome(rp.policies.resolve, policy)
        assert err2 is not None and str(err2).startswith("policy"), err2


@FUZZ
@given(
    name=st.one_of(st.text(max_size=4), st.sampled_from(JUNK + [b"x", 3])),
    policy=st.sampled_from([rp.Policy("routepack", "kk", "hot_n"), "static", None]),
)
def test_register_preset_takes_a_name_and_a_policy(name, policy):
    before = dict(rp.PRESETS)
    try:
        _, err = outcome(rp.policies.register_preset, name, policy)
        valid = isinstance(name, str) and name != "" and isinstance(policy, rp.Policy)
        assert (err is None) == valid, err
        if valid:
            assert rp.policies.resolve(name) == (name, policy)
        else:
            assert str(err).startswith(("name:", "policy:")), err
    finally:
        rp.PRESETS.clear()
        rp.PRESETS.update(before)
