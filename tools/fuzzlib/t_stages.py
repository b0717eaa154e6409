"""Targets of `routepack.stages` (and `routepack.policies`): every options dataclass, every
stage function called directly with a `PlanContext`, `replica_table`, the registry
(`canonical_options`, `stage_options`, `known_options`, ``register_*``), `resolve` and
`register_preset`. Registrations are undone after each case (cases must not depend on
earlier ones)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import numpy as np
import routepack as rp
from routepack import policies, stages
from routepack.stages import (
    EplbOptions,
    HotNOptions,
    NoOptions,
    PlanContext,
    RelibraReplicationOptions,
    RoutepackPackingOptions,
    RoutepackPlacementOptions,
    RoutepackReplicationOptions,
)

from random_plans import random_phy2log
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import BAD_INTS, BAD_OBJECTS, bad_for, is_huge, pick
from fuzzlib.checks import PLAN_NAMES, check_placement, check_plan
from fuzzlib.t_planner import DOMAIN, OPTION_NAMES, in_domain, random_inputs, random_options

OPTION_CLASSES = [
    EplbOptions,
    RoutepackPlacementOptions,
    RoutepackPackingOptions,
    HotNOptions,
    RelibraReplicationOptions,
    RoutepackReplicationOptions,
]


def options_case(cls: type):
    names = [f.name for f in dataclasses.fields(cls)]

    def make(rng: np.random.Generator) -> Case:
        good = random_options(np.random.default_rng(int(rng.integers(2**32))), 8)
        kw = {n: good[n] for n in names if n in good and rng.random() < 0.6}
        kind = "valid"
        for n in names:
            if rng.random() < 0.25:
                kind = "malformed"
                kw[n] = (
                    bad_for(rng, good.get(n, 1))
                    if rng.random() < 0.7
                    else pick(rng, BAD_INTS + [(1.0,), {0: 1.0}, "0.25", (0, 0, 0, 0), 0.0, 1.0, np.float32(0.5)])
                )
        valid = all(in_domain(n, v) for n, v in kw.items())
        if cls is RoutepackPlacementOptions and valid:
            slack = kw.get("placement_slack", stages.DEFAULTS["placement"]["placement_slack"])
            explore = kw.get("placement_explore")
            valid = explore is None or float(explore) >= float(slack)

        def check(o: Any) -> None:
            for f in dataclasses.fields(o):
                v = getattr(o, f.name)
                assert in_domain(f.name, v), f"{f.name} = {v!r} outside its domain"
                kindf = DOMAIN[f.name][0].rstrip("?")
                if v is not None:
                    want = {"int": int, "bool": bool, "mix": tuple}.get(kindf, float)
                    assert type(v) is want, f"{f.name} stored as {type(v).__name__}"
            if isinstance(o, RoutepackPlacementOptions):
                e = o.placement_explore
                assert e is None or o.placement_slack <= e <= 1

        return Case(kind, cls, (), kw, check=check, expect="ok" if valid else "error")

    return make


# ------------------------------------------------------------------ stage functions
def context(rng: np.random.Generator) -> Tuple[PlanContext, Any]:
    policy = rp.Policy(loads=str(rng.choice(["window", "previous"])))
    inp = random_inputs(rng, policy)
    kw = inp.kwargs
    ctx = PlanContext(
        inp.window,
        inp.topo,
        inp.cost,
        inp.cap,
        kw.get("previous"),
        kw.get("previous_window"),
        kw["seed"],
        kw["anneal_moves"],
        None,
        {},
        policy,
    )
    return ctx, inp


def _placement_fn(fn: Callable, opts: Callable[[np.random.Generator, int], Any]):
    def make(rng: np.random.Generator) -> Case:
        ctx, inp = context(rng)
        o = opts(rng, inp.window.num_experts)
        kind, expect = "valid", "ok"
        if rng.random() < 0.25:
            kind, expect = "malformed", None
            field = str(rng.choice(["token_cap", "seed", "previous", "previous_window", "options"]))
            if field == "options":
                o = pick(rng, [None, NoOptions(), "x", RoutepackPackingOptions()])
            elif field == "token_cap":
                ctx.token_cap = pick(rng, [0, -1, None, 1.5, 2**64])
            else:
                setattr(ctx, field, pick(rng, BAD_OBJECTS))
        if ctx.policy.loads == "previous" and ctx.previous_window is None and kind == "valid":
            expect = "error"

        def check(p: Any) -> None:
            check_placement(p)
            assert p.phy2log.shape == (inp.window.num_layers, inp.topo.num_slots)
            assert p.num_experts == inp.window.num_experts and p.slots_per_rank == inp.topo.slots_per_rank

        return Case(
            kind,
            fn,
            (ctx, o),
            check=check,
            expect=expect,
            names=("ctx", "options") + OPTION_NAMES + ("previous_window", "previous", "loads", "token_cap", "seed"),
        )

    return make


def _packing_fn(fn: Callable, opts: Callable[[np.random.Generator], Any]):
    def make(rng: np.random.Generator) -> Case:
        ctx, inp = context(rng)
        placement = rp.Placement.static(inp.window.num_layers, inp.window.num_experts, inp.topo)
        o = opts(rng)
        kind, expect = "valid", "ok"
        if rng.random() < 0.25:
            kind, expect = "malformed", None
            field = str(rng.choice(["token_cap", "seed", "anneal_moves", "placement", "options"]))
            if field == "placement":
                placement = pick(rng, BAD_OBJECTS + [rp.Placement.static(1, 1, rp.Topology(1, 1, 1, 1))])
            elif field == "options":
                o = pick(rng, [None, NoOptions(), "x", EplbOptions()])
            elif field == "token_cap":
                ctx.token_cap = pick(rng, [int(inp.window.seq_lens.max()) - 1, 0, None, 1.5, 2**64])
            else:
                setattr(ctx, field, pick(rng, BAD_INTS))
                if field == "anneal_moves" and is_huge(ctx.anneal_moves):
                    ctx.time_budget_s = 0.5  # billions of moves: the budget must stop them
        static = rp.Placement.static(inp.window.num_layers, inp.window.num_experts, inp.topo)

        def check(out: Any) -> None:
            rank, micro, m, report = out
            assert isinstance(report, dict)
            plan = rp.Plan(static, rank, micro, m)
            check_plan(plan, inp.window, inp.topo, inp.cap)

        return Case(
            kind,
            fn,
            (ctx, o, placement),
            check=check,
            expect=expect,
            names=("ctx", "options", "placement", "token_cap", "seed", "anneal_moves", "sample", "num_experts", "topo")
            + OPTION_NAMES,
        )

    return make


def _replication_fn(fn: Callable, opts: Callable[[np.random.Generator], Any]):
    def make(rng: np.random.Generator) -> Case:
        ctx, inp = context(rng)
        placement = (
            rp.Placement.static(inp.window.num_layers, inp.window.num_experts, inp.topo)
            if rng.random() < 0.5
            else rp.Placement(
                random_phy2log(rng, inp.window.num_layers, inp.window.num_experts, inp.topo),
                inp.window.num_experts,
                inp.topo.slots_per_rank,
            )
        )
        rank, micro, m = rp.stages.sequential_packing(ctx, NoOptions(), placement)[:3]
        o = opts(rng)
        args = [ctx, o, placement, rank, micro, m]
        kind, expect = "valid", "ok"
        if rng.random() < 0.25:
            kind, expect = "malformed", None
            i = int(rng.integers(1, 6))
            if i in (3, 4):
                bad = np.array(args[i], copy=True)
                bad[0] = int(rng.choice([-1, inp.topo.dp, m, 2**31 - 1]))
                args[i] = bad
            elif i == 5:
                args[5] = pick(rng, [0, -1, m + 1, None, 1.5, 2**40])
            else:
                args[i] = pick(rng, BAD_OBJECTS)

        def check(reps: Any) -> None:
            assert reps.dtype == rp.REPLICA_DTYPE
            plan = rp.Plan(placement, rank, micro, m, replicas=reps)
            check_plan(plan, inp.window, inp.topo, inp.cap)

        return Case(
            kind,
            fn,
            tuple(args),
            check=check,
            expect=expect,
            names=("ctx", "options", "placement", "sample_rank", "sample_micro", "num_micro")
            + OPTION_NAMES
            + PLAN_NAMES,
        )

    return make


def _opts(cls: type):
    def make(rng: np.random.Generator, e: int = 8) -> Any:
        good = random_options(np.random.default_rng(int(rng.integers(2**32))), e)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in good.items() if k in names})

    return make


def replica_table_case(rng: np.random.Generator) -> Case:
    n = int(rng.integers(0, 6))
    cols = [rng.integers(0, 4, n).astype(np.int32) for _ in range(6)] + [rng.random(n).astype(np.float32)]
    kind, expect = "valid", "ok"
    if rng.random() < 0.5:
        kind, expect = "malformed", None
        i = int(rng.integers(7))
        cols[i] = pick(rng, [None, "x", np.zeros(n + 1), np.zeros((n, 2)), [1.5] * n, np.full(n, 2**40)])

    def check(t: Any) -> None:
        assert t.dtype == rp.REPLICA_DTYPE and len(t) == n
        for name, c in zip(rp.REPLICA_DTYPE.names, cols):
            assert np.array_equal(t[name], np.asarray(c).astype(t.dtype[name])), f"column {name} changed"

    return Case(kind, stages.replica_table, (tuple(cols),), check=check, expect=expect)


# ------------------------------------------------------------------ registry and presets
def canonical_case(rng: np.random.Generator) -> Case:
    good = random_options(np.random.default_rng(int(rng.integers(2**32))), 8)
    opts: Any = dict(good)
    kind = "valid"
    r = rng.random()
    if r < 0.3:
        opts[pick(rng, ["nope", 3, None, ("a",), "Anneal_chains"])] = 1
        kind = "malformed"
    elif r < 0.45:
        opts["exact_nodes"] = 3
        if rng.random() < 0.5:
            opts["packing_exact_nodes"] = 4
            kind = "malformed"
    elif r < 0.6:
        opts, kind = pick(rng, [None, [("anneal_chains", 2)], "anneal_chains", 3]), "malformed"
    valid = (
        isinstance(opts, dict)
        and all(isinstance(k, str) and (k in stages.known_options() or k in stages.DEPRECATED_OPTIONS) for k in opts)
        and not ("exact_nodes" in opts and "packing_exact_nodes" in opts)
    )

    def check(out: Any) -> None:
        assert set(out) <= stages.known_options()

    return Case(
        kind,
        stages.canonical_options,
        (opts,),
        check=check,
        expect="ok" if valid else "error",
        names=("options",) + OPTION_NAMES,
    )


def stage_options_case(rng: np.random.Generator) -> Case:
    pol = rp.PRESETS[str(rng.choice(sorted(rp.PRESETS)))]
    opts: Any = random_options(np.random.default_rng(int(rng.integers(2**32))), 8)
    kind = "valid"
    if rng.random() < 0.4:
        kind = "malformed"
        if rng.random() < 0.5:
            pol = pick(rng, BAD_OBJECTS + [rp.Policy("nope")])
        else:
            opts[str(rng.choice(OPTION_NAMES))] = pick(rng, BAD_INTS)

    def check(out: Any) -> None:
        assert len(out) == 3 and all(isinstance(o, stages.StageOptions) for o in out)

    return Case(
        kind,
        stages.stage_options,
        (pol, opts),
        check=check,
        expect="ok" if kind == "valid" else None,
        names=("policy", "options") + OPTION_NAMES,
    )


def known_options_case(rng: np.random.Generator) -> Case:
    def check(out: Any) -> None:
        assert isinstance(out, frozenset) and set(OPTION_NAMES) <= out

    return Case("valid", stages.known_options, (), check=check, expect="ok")


def register_case(which: str):
    reg = getattr(stages, f"register_{which}")
    table = stages.STAGES[which]

    def make(rng: np.random.Generator) -> Case:
        name: Any = f"fuzz_{which}_{int(rng.integers(10**9))}"
        fn: Any = lambda *a: None  # noqa: E731
        options: Any = NoOptions
        kind = "valid"
        r = rng.random()
        if r < 0.2:
            name, kind = pick(rng, ["", None, 3, b"x", sorted(table)[0]]), "malformed"
        elif r < 0.4:
            fn, kind = pick(rng, [None, 3, "f"]), "malformed"
        elif r < 0.6:
            options, kind = pick(rng, [None, NoOptions(), dict, int, "NoOptions"]), "malformed"

        def call(n: Any, f: Any, o: Any) -> Any:
            before = dict(table)
            try:
                reg(n, f, o)
                assert n in table and table[n].run is f
                return n
            finally:  # undo: later cases must not see it
                table.clear()
                table.update(before)

        call.__qualname__ = f"register_{which}"
        return Case(
            kind,
            call,
            (name, fn, options),
            expect="ok" if kind == "valid" else "error",
            names=("name", "fn", "options"),
        )

    return make


def resolve_case(rng: np.random.Generator) -> Case:
    if rng.random() < 0.5:
        pol: Any = str(rng.choice(sorted(rp.PRESETS)))
        kind = "valid"
    else:
        pol = pick(
            rng,
            ["nope", "", None, 3, rp.Policy("nope"), rp.Policy(loads="x"), rp.Policy(packing=3), ["static"], b"static"],
        )
        kind = "malformed"

    def check(out: Any) -> None:
        name, p = out
        assert isinstance(name, str) and isinstance(p, rp.Policy)

    return Case(
        kind,
        policies.resolve,
        (pol,),
        check=check,
        expect="ok" if kind == "valid" else "error",
        names=("policy", "policy.placement", "policy.packing", "policy.replication", "policy.loads"),
    )


def register_preset_case(rng: np.random.Generator) -> Case:
    name: Any = f"fuzz_{int(rng.integers(10**9))}"
    pol: Any = rp.Policy("routepack", "kk", "hot_n")
    kind = "valid"
    if rng.random() < 0.5:
        kind = "malformed"
        if rng.random() < 0.5:
            pol = pick(rng, BAD_OBJECTS + ["static"])
        else:
            name = pick(rng, [None, 3, "", b"x"])

    def call(n: Any, p: Any) -> Any:
        before = dict(rp.PRESETS)
        try:
            policies.register_preset(n, p)
            assert rp.PRESETS[n] is p
            return n
        finally:
            rp.PRESETS.clear()
            rp.PRESETS.update(before)

    call.__qualname__ = "register_preset"
    return Case(kind, call, (name, pol), expect="ok" if kind == "valid" else "error", names=("name", "policy"))


def placement_loads_case(rng: np.random.Generator) -> Case:
    ctx, inp = context(rng)
    kind, expect = "valid", "ok"
    if ctx.policy.loads == "previous" and ctx.previous_window is None:
        expect = "error"
    if rng.random() < 0.3:
        kind, expect = "malformed", "error"
        ctx.previous_window = None
        ctx.policy = rp.Policy(loads="previous")

    def check(loads: Any) -> None:
        src = ctx.previous_window if ctx.policy.loads == "previous" else ctx.window
        assert np.array_equal(loads, src.expert_tokens.sum(axis=0, dtype=np.float64))

    return Case(kind, ctx.placement_loads, (), check=check, expect=expect, names=("previous_window",))


TARGETS = [
    Target(f"stages.{cls.__name__}", cls, mixed((1, options_case(cls))), weight=2, names=OPTION_NAMES)
    for cls in OPTION_CLASSES
]
TARGETS += [
    Target(
        "stages.static_placement",
        stages.static_placement,
        mixed((1, _placement_fn(stages.static_placement, lambda r, e: NoOptions()))),
    ),
    Target(
        "stages.eplb_placement",
        stages.eplb_placement,
        mixed((1, _placement_fn(stages.eplb_placement, _opts(EplbOptions)))),
    ),
    Target(
        "stages.relibra_placement",
        stages.relibra_placement,
        mixed((1, _placement_fn(stages.relibra_placement, lambda r, e: NoOptions()))),
    ),
    Target(
        "stages.routepack_placement",
        stages.routepack_placement,
        mixed((1, _placement_fn(stages.routepack_placement, _opts(RoutepackPlacementOptions)))),
    ),
    Target(
        "stages.sequential_packing",
        stages.sequential_packing,
        mixed((1, _packing_fn(stages.sequential_packing, lambda r: NoOptions()))),
    ),
    Target("stages.kk_packing", stages.kk_packing, mixed((1, _packing_fn(stages.kk_packing, lambda r: NoOptions())))),
    Target(
        "stages.routepack_packing",
        stages.routepack_packing,
        mixed((1, _packing_fn(stages.routepack_packing, _opts(RoutepackPackingOptions)))),
    ),
    Target(
        "stages.no_replication",
        stages.no_replication,
        mixed((1, _replication_fn(stages.no_replication, lambda r: NoOptions()))),
        weight=1,
    ),
    Target(
        "stages.hot_n_replication",
        stages.hot_n_replication,
        mixed((1, _replication_fn(stages.hot_n_replication, _opts(HotNOptions)))),
    ),
    Target(
        "stages.relibra_replication",
        stages.relibra_replication,
        mixed((1, _replication_fn(stages.relibra_replication, _opts(RelibraReplicationOptions)))),
    ),
    Target(
        "stages.routepack_replication",
        stages.routepack_replication,
        mixed((1, _replication_fn(stages.routepack_replication, _opts(RoutepackReplicationOptions)))),
    ),
    Target("stages.replica_table", stages.replica_table, mixed((1, replica_table_case)), weight=1, names=("columns",)),
    Target("stages.canonical_options", stages.canonical_options, mixed((1, canonical_case)), weight=1),
    Target("stages.stage_options", stages.stage_options, mixed((1, stage_options_case)), weight=1),
    Target("stages.known_options", stages.known_options, mixed((1, known_options_case)), weight=1),
    Target("stages.register_placement", stages.register_placement, mixed((1, register_case("placement"))), weight=1),
    Target("stages.register_packing", stages.register_packing, mixed((1, register_case("packing"))), weight=1),
    Target(
        "stages.register_replication", stages.register_replication, mixed((1, register_case("replication"))), weight=1
    ),
    Target("policies.resolve", policies.resolve, mixed((1, resolve_case)), weight=1),
    Target("policies.register_preset", policies.register_preset, mixed((1, register_preset_case)), weight=1),
    Target("PlanContext.placement_loads", PlanContext.placement_loads, mixed((1, placement_loads_case)), weight=1),
]
