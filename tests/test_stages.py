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
from routepack.stages import (DEPRECATED_OPTIONS, KNOWN_OPTIONS, PACKINGS, PLACEMENTS, REPLICATIONS, STAGES,
                              EplbOptions, HotNOptions, NoOptions, RelibraReplicationOptions,
                              RoutepackPackingOptions, RoutepackPlacementOptions, RoutepackReplicationOptions,
                              StageOptions)

PACKAGE = Path(rp.__file__).parent

SMALL = dataclasses.replace(rp.traces.profile("tiny"), num_layers=2, attention=("linear", "full"), num_experts=16, top_k=2,
                            dp=4, ep=2, gpus_per_node=2, slots_per_rank=10, samples=32, group_size=4,
                            token_cap=8192, max_response=4096)


@pytest.fixture(scope="module")
def case():
    w = next(iter(rp.traces.synthetic(SMALL, 1, seed=2)))
    return w, SMALL.topology(), SMALL.cost(), SMALL.token_cap


def plan(case, policy="routepack", **options):
    w, topo, cost, cap = case
    return rp.plan_window(w, topo, cost, cap, policy=policy, anneal_moves=2000, **options)


def same(a: rp.Plan, b: rp.Plan) -> bool:
    return (np.array_equal(a.sample_rank, b.sample_rank) and np.array_equal(a.sample_micro, b.sample_micro)
            and a.placement == b.placement and np.array_equal(a.replicas, b.replicas))


# ------------------------------------------------------------------ registry
def test_every_choice_is_listed_with_its_options():
    assert set(PLACEMENTS) == {"static", "eplb", "eplb_hierarchical", "relibra", "routepack"}
    assert set(PACKINGS) == {"sequential", "kk", "routepack"}
    assert set(REPLICATIONS) == {"none", "hot_n", "relibra", "routepack"}
    assert PLACEMENTS["eplb"].options is EplbOptions
    assert PLACEMENTS["eplb_hierarchical"].options is EplbOptions
    assert PLACEMENTS["routepack"].options is RoutepackPlacementOptions
    assert PACKINGS["routepack"].options is RoutepackPackingOptions
    assert REPLICATIONS["hot_n"].options is HotNOptions
    assert REPLICATIONS["relibra"].options is RelibraReplicationOptions
    assert REPLICATIONS["routepack"].options is RoutepackReplicationOptions
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
    for name, default in seen.items():
        if default is None:  # computed by the stage from the window and topology
            assert name in ("placement_cells", "placement_explore", "eplb_num_groups"), name
        else:
            assert flat.pop(name) == default, name
    assert flat == {"placement_explore": core["placement"]["placement_explore"]}
    assert RoutepackPlacementOptions().explore() == core["placement"]["placement_explore"]
    assert RoutepackPlacementOptions(placement_slack=0.5).explore() == 0.5
    assert RoutepackPlacementOptions(placement_slack=0.5, placement_explore=0.75).explore() == 0.75
    assert rp.replication.DEFAULT_HOT_EXPERTS == core["replication"]["replication_hot_experts"]
    assert rp.replication.DEFAULT_REPLICA_SLOTS == core["replication"]["replication_slots"]


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
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("update", "add", "setdefault", "pop", "clear", "__setitem__")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in tables):
                raise AssertionError(f"{path}:{node.lineno}: mutates {node.func.value.id}")
    for path in (PACKAGE / "stages").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "StageOptions" for b in node.bases):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Constant):
                        raise AssertionError(f"{path}: {node.name}.{ast.unparse(item.target)} writes a default")


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("cls,name,value,error", [
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
])
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


@pytest.mark.parametrize("old,new,value,policy", [
    ("replica_slots", "replication_slots", 1, "routepack"),
    ("hot_experts", "replication_hot_experts", 1, "hot_n"),
    ("exact_nodes", "packing_exact_nodes", 10, "routepack_packing"),
])
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
