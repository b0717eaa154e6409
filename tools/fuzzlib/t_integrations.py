"""Targets of the trainer integrations' numpy-only functions: `routepack.integrations.megatron`'s
placement helpers (`num_moe_experts`, `local_experts`, `checkpoint_to_logical`,
`logical_to_checkpoint`) and `routepack.integrations.verl`'s DP split and microbatch indices
(`plan_batch`, `equal_count_plan`, `balance_partitions`, `balance_order`, `balance_stats`,
`micro_batch_indices`). The functions that build or hook torch / verl / Megatron objects are
left to tests/test_integrations_*.py (they need those frameworks' objects and processes)."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import routepack as rp
from routepack.integrations import megatron, verl

from fuzzlib.checks import check_plan
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import BAD_INTS, BAD_OBJECTS, pick
from fuzzlib.valid import fresh, valid_plan


def a_placement(rng: np.random.Generator) -> Any:
    """A valid plan or placement, or (malformed) something else."""
    c = valid_plan(rng)
    r = rng.random()
    if r < 0.4:
        return c.plan, "valid"
    if r < 0.8:
        return c.plan.placement, "valid"
    return pick(rng, BAD_OBJECTS), "malformed"


def placement_of(pp: Any) -> rp.Placement:
    return pp.placement if isinstance(pp, rp.Plan) else pp


def megatron_case(fn: Any) -> Any:
    def make(rng: np.random.Generator) -> Case:
        pp, kind = a_placement(rng)
        args: List[Any] = [pp]
        expect = "ok" if kind == "valid" else "error"
        layered = fn in (megatron.checkpoint_to_logical, megatron.logical_to_checkpoint)
        if layered:
            L = placement_of(pp).num_layers if kind == "valid" else 1
            layer: Any = int(rng.integers(L))
            if rng.random() < 0.35:
                layer = pick(rng, BAD_INTS + [L, -1, np.int64(0)])
                kind = "malformed"
                ok = isinstance(layer, (int, np.integer)) and not isinstance(layer, (bool, np.bool_)) and 0 <= layer < L
                expect = "ok" if ok and expect == "ok" else "error"
            args.append(layer)

        def check(out: Any) -> None:
            p = placement_of(pp)
            if fn is megatron.num_moe_experts:
                assert out == p.phy2log.shape[1], "num_moe_experts != slots a layer"
            elif fn is megatron.local_experts:
                assert out.shape == (p.num_layers, p.phy2log.shape[1] // p.slots_per_rank, p.slots_per_rank)
                assert np.array_equal(out.reshape(p.num_layers, -1), p.phy2log), "local_experts != phy2log"
            elif fn is megatron.checkpoint_to_logical:
                row = p.phy2log[int(args[1])]
                assert out.dtype == np.int64 and out.shape == (p.num_experts,)
                assert np.array_equal(row[out], np.arange(p.num_experts)), "a slot that does not hold its expert"
                for e, s in enumerate(out.tolist()):
                    assert s == int(np.flatnonzero(row == e)[0]), f"expert {e}: not its first copy"
            else:
                assert out.dtype == np.int64 and np.array_equal(out, p.phy2log[int(args[1])])

        return Case(kind, fn, tuple(args), check=check, expect=expect, names=("plan_or_placement", "placement"))

    return make


def batch_plan(rng: np.random.Generator) -> Any:
    """A valid plan whose DP ranks hold equal sample counts (`equal_count_plan`), with its case."""
    for _ in range(20):
        c = valid_plan(rng)
        try:
            return verl.equal_count_plan(c.plan, c.window, c.topo, c.cap, c.cost), c
        except rp.RoutepackError:
            continue
    return None, c


def plan_batch_case(rng: np.random.Generator) -> Case:
    c = valid_plan(rng)
    policy = str(rng.choice(sorted(rp.PRESETS)))
    args: List[Any] = [c.window, c.topo, c.cost, c.cap, policy]
    kind, expect, note = "valid", None, policy
    kw: dict = {"previous_window": c.window}
    if rng.random() < 0.3:
        kind, expect = "malformed", "error"
        i = int(rng.integers(4))
        args[i] = pick(rng, BAD_OBJECTS if i < 3 else BAD_INTS[:12])
        note = ("window", "topo", "cost", "token_cap")[i]
        if i == 3 and isinstance(args[3], int) and not isinstance(args[3], bool) and args[3] >= c.cap:
            expect = None

    def check(plan: Any) -> None:
        plan.validate(c.window, c.topo, c.cap)
        counts = np.bincount(plan.sample_rank, minlength=c.topo.dp)
        assert counts.min() == counts.max(), f"unequal sample counts {counts.tolist()}"
        check_plan(plan, c.window, c.topo, c.cap)

    return Case(kind, verl.plan_batch, tuple(args), kw, check=check, expect=expect, note=note)


def equal_count_case(rng: np.random.Generator) -> Case:
    c = valid_plan(rng)
    args: List[Any] = [fresh(c.plan), c.window, c.topo, c.cap, c.cost if rng.random() < 0.5 else None]
    kind, expect, note = "valid", None, ""
    if rng.random() < 0.3:
        kind, expect = "malformed", "error"
        i = int(rng.integers(5))
        args[i] = pick(rng, BAD_OBJECTS if i != 3 else BAD_INTS[:12])
        note = ("plan", "window", "topo", "token_cap", "cost")[i]
        if (
            i == 4
            and args[i] is None
            or i == 3
            and isinstance(args[3], int)
            and not isinstance(args[3], bool)
            and args[3] >= c.cap
        ):
            expect = None

    def check(plan: Any) -> None:
        plan.validate(c.window, c.topo, c.cap)
        counts = np.bincount(plan.sample_rank, minlength=c.topo.dp)
        assert counts.min() == counts.max(), f"unequal sample counts {counts.tolist()}"

    return Case(kind, verl.equal_count_plan, tuple(args), check=check, expect=expect, note=note)


def partitions_case(fn: Any) -> Any:
    def make(rng: np.random.Generator) -> Case:
        plans, kind, expect, note = [], "valid", "ok", ""
        dp = None
        for _ in range(int(rng.integers(1, 4))):
            p, c = batch_plan(rng)
            if p is None or (dp is not None and c.topo.dp != dp):
                continue
            dp = c.topo.dp
            plans.append(p)
        if not plans:
            kind, expect, note = "malformed", "error", "no plans"
        arg: Any = plans if len(plans) != 1 or rng.random() < 0.5 else plans[0]
        if rng.random() < 0.25:
            kind, expect = "malformed", "error"
            arg = pick(rng, BAD_OBJECTS + [[None], ["plan"], {}])
            note = f"plans={arg!r}"[:60]

        def check(out: Any) -> None:
            ps = plans
            total = sum(p.num_samples for p in ps)
            flat = [s for part in out for s in part] if fn is verl.balance_partitions else out.tolist()
            assert sorted(flat) == list(range(total)), "not a permutation of the batch"
            if fn is verl.balance_partitions:
                assert len(out) == dp and len({len(p) for p in out}) == 1, "unequal partitions"

        return Case(kind, fn, (arg,), check=check, expect=expect, note=note)

    return make


def stats_case(rng: np.random.Generator) -> Case:
    B = int(rng.integers(1, 40))
    dp = int(rng.choice([d for d in (1, 2, 4) if B % d == 0] or [1]))
    lens = rng.integers(1, 500, B)
    perm = rng.permutation(B)
    parts = [sorted(perm[r::dp].tolist()) for r in range(dp)]
    args: List[Any] = [lens, parts]
    kind, expect, note = "valid", "ok", ""
    r = rng.random()
    if r < 0.35:
        kind, expect = "malformed", "error"
        j = int(rng.integers(5))
        if j == 0:
            args[1], note = [], "no partitions"
        elif j == 1:
            args[1], note = [[B + 3]] + parts[1:], "an index past the batch"
        elif j == 2:
            args[1], note = pick(rng, BAD_OBJECTS + [[None], [["a"]], [[1.5]]]), "partitions of the wrong type"
        elif j == 3:
            args[0], note = pick(rng, BAD_OBJECTS + [np.zeros((2, 2, 2)), ["x"]]), "seqlen_list of the wrong type"
        else:
            args[1], note = [[0]] * (B + 2), "more partitions than samples"
            expect = None

    def check(out: Any) -> None:
        keys = {"min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean"}
        assert {k.split("/")[-1] for k in out} == keys
        balanced = [int(lens[p].sum()) for p in map(np.array, parts)]
        assert out["global_seqlen/balanced_max"] == max(balanced) and out["global_seqlen/balanced_min"] == min(balanced)

    return Case(
        kind, verl.balance_stats, tuple(args), check=check if kind == "valid" else None, expect=expect, note=note
    )


def micro_case(rng: np.random.Generator) -> Case:
    p, c = batch_plan(rng)
    if p is None:
        p = c.plan
    rank: Any = int(rng.integers(c.topo.dp))
    kind, expect = "valid", "ok"
    arg: Any = p
    if rng.random() < 0.3:
        kind, expect = "malformed", "error"
        if rng.random() < 0.5:
            rank = pick(rng, BAD_INTS + [c.topo.dp, -1])
            if isinstance(rank, (int, np.integer)) and not isinstance(rank, (bool, np.bool_)) and 0 <= rank < c.topo.dp:
                expect = "ok"
        else:
            arg = pick(rng, BAD_OBJECTS)

    def check(out: Any) -> None:
        flat = [i for m in out for i in m]
        assert flat == list(range(len(flat))) and all(out), "microbatch indices do not tile range(S_r)"
        assert len(flat) == int((p.sample_rank == rank).sum())

    return Case(kind, verl.micro_batch_indices, (arg, rank), check=check, expect=expect)


TARGETS = [
    Target(
        f"integrations.megatron.{fn.__name__}",
        fn,
        mixed((1, megatron_case(fn))),
        weight=1,
        names=("plan_or_placement", "placement", "layer"),
    )
    for fn in (
        megatron.num_moe_experts,
        megatron.local_experts,
        megatron.checkpoint_to_logical,
        megatron.logical_to_checkpoint,
    )
] + [
    Target("integrations.verl.plan_batch", verl.plan_batch, mixed((1, plan_batch_case)), weight=1, batch=8),
    Target(
        "integrations.verl.equal_count_plan", verl.equal_count_plan, mixed((1, equal_count_case)), weight=1, batch=8
    ),
    Target(
        "integrations.verl.balance_partitions",
        verl.balance_partitions,
        mixed((1, partitions_case(verl.balance_partitions))),
        weight=1,
        batch=8,
    ),
    Target(
        "integrations.verl.balance_order",
        verl.balance_order,
        mixed((1, partitions_case(verl.balance_order))),
        weight=1,
        batch=8,
    ),
    Target("integrations.verl.balance_stats", verl.balance_stats, mixed((1, stats_case)), weight=1),
    Target(
        "integrations.verl.micro_batch_indices", verl.micro_batch_indices, mixed((1, micro_case)), weight=1, batch=8
    ),
]
