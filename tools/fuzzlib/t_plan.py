"""Targets of `routepack.plan` and `routepack.simulate`: `Placement`, `Plan` (constructor,
``validate`` on valid and tampered plans, files, ``same_as``, ``cell_samples``) and
`simulate`."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any, Callable, Iterator, Optional

import numpy as np
import routepack as rp
from hypothesis import strategies as st

from random_plans import TOPOLOGIES, random_case, random_phy2log
from test_plan_fuzz import CORRUPTIONS, corrupt, placement_inputs
from fuzzlib.engine import Case, Refused, Target, both, hyp_gen, mixed
from fuzzlib.inputs import is_huge, BAD_INTS, BAD_OBJECTS, SAME_VALUES, bad_for, mutate_array, pick
from fuzzlib.checks import PLAN_NAMES, check_placement, check_plan, check_sim
from fuzzlib.files import file_load_case, other_type_case
from fuzzlib.t_model import tmp_path
from fuzzlib.valid import PlanCase, fresh, valid_plan


# ------------------------------------------------------------------ tampering
def _dup_migration(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    if not len(plan.migration):
        return None
    rows = plan.migration if rng.random() < 0.5 else plan.migration[:1]
    plan.migration = np.concatenate([plan.migration, rows])
    return "migration rows duplicated"


@contextlib.contextmanager
def in_place() -> Iterator[None]:
    """An in-place edit of a plan's array; a read-only array refusing it is `Refused`."""
    try:
        yield
    except ValueError as e:
        if "read-only" in str(e):
            raise Refused() from None
        raise


def _edit_phy2log(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    p2l = plan.placement.phy2log
    l = int(rng.integers(p2l.shape[0]))
    a, b = rng.integers(p2l.shape[1], size=2)
    with in_place():
        if rng.random() < 0.5 and p2l[l, a] != p2l[l, b]:
            p2l[l, a], p2l[l, b] = p2l[l, b], p2l[l, a]
            return "phy2log edited in place (two slots swapped): logcnt/log2phy stale"
        p2l[l, a] = (p2l[l, a] + 1) % plan.placement.num_experts
    return "phy2log edited in place (one slot changed): logcnt/log2phy stale"


def _edit_tables(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    p = plan.placement
    with in_place():
        if rng.random() < 0.5:
            p.logcnt[0, 0] += 1
            return "logcnt edited in place"
        p.log2phy[0, 0, 0] = (p.log2phy[0, 0, 0] + 1) % p.num_slots
    return "log2phy edited in place"


def _field_none(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    name = str(
        rng.choice(
            ["placement", "sample_rank", "sample_micro", "num_micro", "replicas", "migration", "report", "policy"]
        )
    )
    wrong = {"report": [None, 2.5, [], "x", object()], "policy": [None, 2.5, [], {}, object()]}
    setattr(plan, name, pick(rng, wrong.get(name, [None, "x", 2.5, [], {}, object()])))
    return f"plan.{name} replaced by a wrong type"


def _num_micro(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    plan.num_micro = pick(
        rng,
        [
            plan.num_micro + 0.7,
            float(plan.num_micro),
            str(plan.num_micro),
            True,
            np.float64(plan.num_micro),
            2**64,
            -1,
            0,
        ],
    )
    return f"plan.num_micro = {plan.num_micro!r}"


def _float_layout(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    name = str(rng.choice(["sample_rank", "sample_micro"]))
    label, new = mutate_array(rng, getattr(plan, name))
    setattr(plan, name, new)
    return f"plan.{name} {label}"


def _nan_share(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    if not len(plan.replicas):
        return None
    plan.replicas["share"][int(rng.integers(len(plan.replicas)))] = rng.choice([np.nan, np.inf, -0.0, 1.0001, 2.0])
    return "a replica share out of [0, 1] or NaN"


def _dup_replica(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    if not len(plan.replicas):
        return None
    i = int(rng.integers(len(plan.replicas)))
    plan.replicas = np.concatenate([plan.replicas, plan.replicas[i : i + 1]])
    return "a replica row duplicated"


def _report_list(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    plan.report = pick(rng, [[1, 2], "report", None, 3])
    return "plan.report not a dict"


def _migration_bytes(plan: rp.Plan, rng: np.random.Generator, pc: PlanCase) -> Optional[str]:
    if not len(plan.migration):
        return None
    plan.migration["bytes"][0] = rng.choice([np.nan, -1.0, np.inf])
    return "migration bytes NaN / negative / inf"


#: (name, tamper, must the plan be refused)
TAMPERS = [
    ("dup_migration", _dup_migration, True),
    ("edit_phy2log", _edit_phy2log, True),
    ("edit_tables", _edit_tables, True),
    ("field_none", _field_none, True),
    ("num_micro", _num_micro, None),
    ("layout_array", _float_layout, None),
    ("nan_share", _nan_share, None),
    ("dup_replica", _dup_replica, None),
    ("report", _report_list, True),
    ("migration_bytes", _migration_bytes, True),
]


def tampered(rng: np.random.Generator, make_call: Callable[[rp.Plan, PlanCase], Any], check_of: Callable) -> Case:
    """A valid plan with one tamper of `TAMPERS` applied (in the case's setup, so a read-only
    array that refuses the edit is seen), then ``make_call(plan, pc) -> (fn, args)``."""
    pc = valid_plan(rng, ep2=True)
    if not len(pc.plan.migration) and rng.random() < 0.7:
        # give it migration rows to tamper with (from a random previous placement)
        from random_plans import migration_rows

        prev = random_phy2log(rng, pc.window.num_layers, pc.window.num_experts, pc.topo)
        pc.plan.migration = migration_rows(
            prev, pc.plan.placement.phy2log, pc.window.num_experts, pc.topo.slots_per_rank, pc.cost.expert_state_bytes
        )
    name, tamper, refuse = TAMPERS[int(rng.integers(len(TAMPERS)))]
    plan = fresh(pc.plan)
    fn, args = make_call(plan, pc)
    state = {"note": name}
    sub = np.random.default_rng(int(rng.integers(2**63)))

    def setup() -> Any:
        note = tamper(plan, sub, pc)
        state["note"] = "(untampered)" if note is None else note
        return args, {}

    def check(result: Any) -> None:
        if refuse and state["note"] != "(untampered)":
            raise AssertionError(f"accepted a tampered plan: {state['note']}")
        check_of(result, plan, pc)

    return Case("tampered", fn, args, setup=setup, check=check, note=name, names=PLAN_NAMES)


# ------------------------------------------------------------------ targets' cases
def validate_case(rng: np.random.Generator) -> Case:
    r = rng.random()
    if r < 0.35:
        pc = valid_plan(rng)
        return Case(
            "valid",
            pc.plan.validate,
            (pc.window, pc.topo, pc.cap),
            expect="ok",
            check=lambda p: check_plan(p, pc.window, pc.topo, pc.cap),
        )
    if r < 0.75:
        return tampered(
            rng,
            lambda plan, pc: (plan.validate, (pc.window, pc.topo, pc.cap)),
            lambda res, plan, pc: check_plan(res, pc.window, pc.topo, pc.cap),
        )
    pc = valid_plan(rng)
    args = [pc.window, pc.topo, pc.cap]
    i = int(rng.integers(3))
    args[i] = bad_for(rng, args[i]) if i == 2 else pick(rng, BAD_OBJECTS)
    if i == 1 and rng.random() < 0.5:  # another topology: its slots or ranks differ
        t = pc.topo
        args[1] = rp.Topology(t.dp * 2, t.ep, t.gpus_per_node, t.slots_per_rank)
    return Case("malformed", pc.plan.validate, tuple(args), check=lambda p: check_plan(p, *args), names=PLAN_NAMES)


def corrupted_case(x: Any) -> Case:
    plan, window, topo, cap, words = x
    return Case(
        "tampered", plan.validate, (window, topo, cap), expect="error", note=f"corrupt: {words}", names=PLAN_NAMES
    )


@st.composite
def corruptions(draw: Any) -> Any:
    seed, kind = draw(st.integers(0, 10**6)), draw(st.sampled_from(CORRUPTIONS))
    return corrupt(kind, random_case(seed, TOPOLOGIES[seed % 4]), draw)


def simulate_case(rng: np.random.Generator) -> Case:
    r = rng.random()
    if r < 0.45:
        pc = valid_plan(rng)
        cap = pick(rng, [None, pc.cap, 10**9, 2**62, max(1, pc.cap // 2)])
        return Case(
            "valid",
            rp.simulate,
            (pc.plan, pc.window, pc.topo, pc.cost, cap),
            expect="ok",
            check=lambda res: check_sim(res, pc.plan, pc.window, pc.topo),
        )
    if r < 0.75:
        return tampered(
            rng,
            lambda plan, pc: (rp.simulate, (plan, pc.window, pc.topo, pc.cost)),
            lambda res, plan, pc: check_sim(res, plan, pc.window, pc.topo),
        )
    pc = valid_plan(rng)
    args = [pc.plan, pc.window, pc.topo, pc.cost, None]
    i = int(rng.integers(5))
    if i == 3 and rng.random() < 0.5:
        args[3] = dataclasses.replace(pc.cost, a_quad=pc.cost.a_quad + [0.0])  # other layer count
    elif i == 4:
        args[4] = pick(rng, BAD_INTS)
    else:
        args[i] = pick(rng, BAD_OBJECTS)
    return Case(
        "malformed",
        rp.simulate,
        tuple(args),
        names=PLAN_NAMES,
        check=lambda res: check_sim(res, pc.plan, pc.window, pc.topo),
    )


def placement_hyp_case(x: Any) -> Case:
    phy2log, E, spr = x
    return Case("malformed", rp.Placement, (phy2log, E, spr), check=lambda p: check_placement(p, phy2log, E))


def placement_rng_case(rng: np.random.Generator) -> Case:
    topo = rp.Topology(*TOPOLOGIES[int(rng.integers(len(TOPOLOGIES)))])
    L, E = int(rng.integers(1, 4)), int(rng.integers(1, topo.num_slots + 1))
    p2l = random_phy2log(rng, L, E, topo, same_rank_pair=rng.random() < 0.3)
    args = [p2l, E, topo.slots_per_rank]
    kind, expect, note = "valid", "ok", ""
    r = rng.random()
    if r < 0.3:
        note, args[0] = mutate_array(rng, p2l, only_same=True)
        kind, expect = "edge", None if note == "list" else "ok"
    elif r < 0.6:
        note, args[0] = mutate_array(rng, p2l)
        kind, expect = "malformed", "ok" if note in SAME_VALUES and note != "list" else None
    elif r < 0.8:
        kind, expect = "malformed", "error"
        i = 1 + int(rng.integers(2))
        args[i] = pick(rng, BAD_INTS)
        note = "num_experts" if i == 1 else "slots_per_rank"
        if i == 1 and is_huge(args[i]):
            kind, expect = "absurd", None
    else:
        kind, expect = "malformed", "error"
        p2l = p2l.copy()
        p2l[0][p2l[0] == 0] = -1
        args[0] = p2l
        note = "expert 0 has no slot"
    return Case(
        kind, rp.Placement, tuple(args), check=lambda p: check_placement(p, args[0], args[1]), expect=expect, note=note
    )


def static_case(rng: np.random.Generator) -> Case:
    topo = rp.Topology(*TOPOLOGIES[int(rng.integers(len(TOPOLOGIES)))])
    args = [int(rng.integers(1, 5)), int(rng.integers(1, topo.num_slots + 1)), topo]
    kind, expect, note = "valid", "ok", ""
    r = rng.random()
    if r < 0.15:
        kind, note = "edge", "E = slots"
        args[1] = topo.num_slots
    elif r < 0.3:
        kind, expect, note = "malformed", "error", "more experts than slots"
        args[1] = topo.num_slots + int(rng.integers(1, 5))
    elif r < 0.65:
        kind, expect = "malformed", "error"
        i = int(rng.integers(3))
        args[i] = pick(rng, BAD_OBJECTS) if i == 2 else pick(rng, BAD_INTS)
        note = ("num_layers", "num_experts", "topo")[i]
        if i < 2 and isinstance(args[i], (int, np.integer)) and not isinstance(args[i], bool) and args[i] >= 1:
            expect = None
    elif r < 0.75:
        kind, expect, note = "absurd", "error", "64 GiB of phy2log"
        args = [16, 2, rp.Topology(2, 2, 2, 2**29)] if rng.random() < 0.5 else [2**34, 2, topo]

    def check(p: Any) -> None:
        check_placement(p)
        L, E, t = args
        per = -(-E // t.ep)
        assert p.phy2log.shape == (L, t.num_slots)
        for e in range(E):
            assert e in p.phy2log[0, (e // per) * t.slots_per_rank : (e // per + 1) * t.slots_per_rank], (
                f"expert {e} not on rank {e // per}"
            )

    return Case(kind, rp.Placement.static, tuple(args), check=check, expect=expect, note=note)


def rank_experts_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    p = pc.plan.placement
    layer: Any = int(rng.integers(p.num_layers))
    rank: Any = int(rng.integers(p.num_ranks))
    kind, expect, note = "valid", "ok", ""
    if rng.random() < 0.5:
        kind, expect = "malformed", "error"
        if rng.random() < 0.5:
            layer = pick(rng, [-1, p.num_layers, 2**63, None, "0", 1.5])
            note = "layer out of range / not an int"
        else:
            rank = pick(rng, [-1, p.num_ranks, -p.num_ranks - 1, 2**40, None, "0", 0.5])
            note = "rank out of range / not an int"

    def check(got: Any) -> None:
        lo = rank * p.slots_per_rank
        assert np.array_equal(got, p.phy2log[layer, lo : lo + p.slots_per_rank]) and len(got) == p.slots_per_rank

    return Case(kind, p.rank_experts, (layer, rank), check=check, expect=expect, note=note)


def plan_ctor_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    p = pc.plan
    fields = dict(
        placement=p.placement,
        sample_rank=p.sample_rank,
        sample_micro=p.sample_micro,
        num_micro=p.num_micro,
        replicas=p.replicas,
        migration=p.migration,
        report={},
        policy="x",
    )
    kind, expect, note = "valid", "ok", ""
    if rng.random() < 0.7:
        name = str(rng.choice(list(fields)))
        kind, expect, note = "malformed", None, name
        v = fields[name]
        if isinstance(v, np.ndarray) and v.dtype.names is None:
            label, fields[name] = mutate_array(rng, v)
            note = f"{name} {label}"
            if label in SAME_VALUES and label != "list":
                kind, expect = "edge", "ok"
        elif isinstance(v, np.ndarray):
            fields[name] = pick(
                rng,
                [
                    None,
                    [],
                    np.zeros(3),
                    v[["micro"]] if "micro" in v.dtype.names else v[:0],
                    v.astype([(n, "<f8") for n in v.dtype.names]),
                    v.tolist(),
                ],
            )
        elif name == "policy":
            fields[name] = pick(rng, [None, 3, b"x", ["x"], {}])
            expect = "error"
        elif name == "report":
            fields[name] = pick(rng, [None, 3, "x", [("a", 1)], object()])
            expect = "error"
        else:
            fields[name] = bad_for(rng, v)
            big = name == "num_micro" and is_small_int(fields[name]) and fields[name] >= 1
            expect = None if big else "error"  # a huge microbatch count is validate's to refuse

    def check(plan: Any) -> None:
        assert plan.sample_rank.dtype == np.int32 and plan.sample_micro.dtype == np.int32
        assert type(plan.num_micro) is int and plan.num_micro >= 1
        assert plan.replicas.dtype == rp.REPLICA_DTYPE and plan.migration.dtype == rp.MIGRATION_DTYPE
        assert isinstance(plan.report, dict) and isinstance(plan.policy, str)
        assert np.array_equal(plan.sample_rank.astype(np.int64), np.asarray(fields["sample_rank"]).astype(np.int64))

    return Case(kind, rp.Plan, (), fields, check=check, expect=expect, note=note)


def same_as_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    other: Any = fresh(pc.plan)
    want: Optional[bool] = True
    kind, note = "valid", "a copy"
    r = rng.random()
    if r < 0.3 and pc.plan.num_samples:
        other.sample_micro = (other.sample_micro + 1) % other.num_micro if other.num_micro > 1 else other.sample_micro
        want, note = other.num_micro == 1, "a layout differing in a step"
    elif r < 0.6:
        other, want, kind, note = pick(rng, BAD_OBJECTS), None, "malformed", "not a plan"
    return Case(
        kind,
        pc.plan.same_as,
        (other,),
        check=lambda got: _is(got, want),
        note=note,
        expect="error" if want is None else "ok",
    )


def _is(got: Any, want: Any) -> None:
    assert got is want, f"same_as returned {got!r}, expected {want!r}"


def cell_samples_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    rank: Any = int(rng.integers(pc.topo.dp))
    micro: Any = int(rng.integers(pc.plan.num_micro))
    kind, expect = "valid", "ok"
    if rng.random() < 0.4:
        kind, expect = "malformed", "error"
        if rng.random() < 0.5:
            rank = pick(rng, [None, "0", 0.5, [0], pc.topo.dp, -1])
        else:
            micro = pick(rng, [None, "0", 0.5, [0], -1, pc.plan.num_micro])
        if is_small_int(rank) and is_small_int(micro):
            expect = None  # out of range: empty is a fair answer

    def check(got: Any) -> None:
        want = np.flatnonzero((pc.plan.sample_rank == rank) & (pc.plan.sample_micro == micro))
        assert np.array_equal(got, want)

    return Case(kind, pc.plan.cell_samples, (rank, micro), check=check, expect=expect)


def is_small_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plan_save_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    plan = pc.plan
    plan.report = {"x": [1, 2.5, None], "n": np.int64(3).item()}
    if rng.random() < 0.7:
        target: Any = tmp_path("plan") if rng.random() < 0.5 else io.BytesIO()

        def check(_: Any) -> None:
            if isinstance(target, io.BytesIO):
                target.seek(0)
            back = rp.Plan.load(target)
            assert back.same_as(plan) and back.report == plan.report and back.policy == plan.policy, "round trip"

        return Case("valid", plan.save, (target,), check=check, expect="ok")
    if rng.random() < 0.5:
        plan.report = {"a": object()} if rng.random() < 0.5 else {"a": float("nan"), 3: {1, 2}}
        return Case("malformed", plan.save, (tmp_path("plan"),), note="report not JSON-serialisable")
    return Case("malformed", plan.save, (pick(rng, [None, 3.5, {}, 2**40, "", object()]),), note="bad path")


def plan_load_gen() -> Any:
    def make(rng: np.random.Generator) -> rp.Plan:
        pc = valid_plan(rng)
        pc.plan.report = {"token_cap": pc.cap, "nested": {"a": [1, 2]}}
        return pc.plan

    return mixed((9, file_load_case(rp.Plan, make, "plan")), (1, other_type_case))


TARGETS = [
    Target(
        "Placement",
        rp.Placement,
        both(hyp_gen(placement_inputs(), placement_hyp_case), mixed((1, placement_rng_case)), 0.4),
        weight=3,
        names=("placement", "placement.phy2log"),
    ),
    Target("Placement.static", rp.Placement.static, mixed((1, static_case)), weight=2),
    Target("Placement.rank_experts", rp.Placement.rank_experts, mixed((1, rank_experts_case)), weight=1),
    Target("Plan", rp.Plan, mixed((1, plan_ctor_case)), weight=2, names=PLAN_NAMES),
    Target(
        "Plan.validate",
        rp.Plan.validate,
        both(hyp_gen(corruptions(), corrupted_case), mixed((1, validate_case)), 0.3),
        weight=5,
        names=PLAN_NAMES,
    ),
    Target("Plan.same_as", rp.Plan.same_as, mixed((1, same_as_case)), weight=1),
    Target("Plan.cell_samples", rp.Plan.cell_samples, mixed((1, cell_samples_case)), weight=1),
    Target("Plan.save", rp.Plan.save, mixed((1, plan_save_case)), weight=1, names=("report", "path")),
    Target("Plan.load", rp.Plan.load, plan_load_gen(), weight=3, names=("plan file",)),
    Target("simulate", rp.simulate, mixed((1, simulate_case)), weight=4, names=PLAN_NAMES + ("cost", "cost.a_quad")),
]
