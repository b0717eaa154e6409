"""Targets of `routepack.model` (`Topology`, `ModelShape`, `Hardware`, `CostModel` and its
JSON and files) and `Policy`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import routepack as rp
from hypothesis import strategies as st

from fuzzing import finite_number_ok, is_int, numbers, scalars
from test_model_fuzz import COST_FIELDS, HW_FIELDS, JSON_VALUES, topology_args
from fuzzlib.engine import Case, Target, both, hyp_gen, mixed
from fuzzlib.inputs import BAD_FLOATS, BAD_INTS, BAD_OBJECTS, bad_for, damage_text, pick

TMP = tempfile.mkdtemp(prefix="rp_fuzz_")


def tmp_path(stem: str) -> str:
    """A fresh path in the campaign's scratch folder (no suffix: save/load must agree)."""
    fd, path = tempfile.mkstemp(prefix=stem, dir=TMP)
    os.close(fd)
    return path


# ------------------------------------------------------------------ Topology
def valid_topology_args(rng: np.random.Generator) -> List[int]:
    ep = int(rng.choice([1, 2, 3, 4, 8]))
    gpn = int(rng.choice([g for g in (1, 2, 3, 4, 6, 8, 16) if g % ep == 0 or ep % g == 0]))
    return [ep * int(rng.integers(1, 5)), ep, gpn, int(rng.integers(1, 21))]


def topology_valid(args: List[Any]) -> bool:
    dp, ep, gpn, spr = args
    ints = all(is_int(v) and 1 <= v <= 2**31 - 1 for v in args)
    return ints and dp % ep == 0 and (ep % gpn == 0 or gpn % ep == 0) and ep * spr <= 2**31 - 1


def check_topology(args: List[Any], kw: Dict[str, Any]):
    def check(t: rp.Topology) -> None:
        assert (t.dp, t.ep, t.gpus_per_node, t.slots_per_rank) == tuple(int(a) for a in args), "fields differ"
        assert t.num_groups * t.ep == t.dp and t.num_slots == t.ep * t.slots_per_rank
        assert t.nodes_per_group >= 1
        want = int(kw["replica_slots"]) if "replica_slots" in kw else DEFAULT_REPLICA_SLOTS
        assert t.replica_slots == want and type(t.replica_slots) is int, f"replica_slots {t.replica_slots!r}"

    return check


#: the core's default spare buffers a rank (`Topology.replica_slots`)
DEFAULT_REPLICA_SLOTS = rp.Topology(1, 1, 1, 1).replica_slots


def topology_case(args: List[Any], kind: str, kw: Optional[Dict[str, Any]] = None) -> Case:
    args, kw = list(args), dict(kw or {})
    valid = topology_valid(args)
    if "replica_slots" in kw:
        v = kw["replica_slots"]
        valid = valid and is_int(v) and 0 <= v <= 2**31 - 1
    return Case(kind, rp.Topology, tuple(args), kw, check=check_topology(args, kw), expect="ok" if valid else "error")


def replica_slots_case(rng: np.random.Generator) -> Case:
    """``replica_slots``: spare expert buffers a rank (0 .. 2**31 - 1, numpy ints too), or wrong."""
    args = valid_topology_args(rng)
    if rng.random() < 0.5:
        v = pick(rng, [0, 1, 2, 3, 8, 2**31 - 1, np.int32(2), np.uint64(5), np.int64(0)])
        return topology_case(args, "edge", {"replica_slots": v})
    return topology_case(args, "malformed", {"replica_slots": pick(rng, BAD_INTS + [2**31, -1])})


def topology_from_rng(rng: np.random.Generator) -> Case:
    args = valid_topology_args(rng)
    r = rng.random()
    if r < 0.4:
        return topology_case(args, "valid")
    if r < 0.6:  # odd but valid: numpy ints, one rank, huge slot counts, ep = gpus_per_node
        i = int(rng.integers(4))
        args[i] = [np.int64, np.int32, np.uint64][int(rng.integers(3))](args[i])
        if rng.random() < 0.3:
            args = [1, 1, int(rng.choice([1, 8])), int(rng.choice([1, 2**20, 2**31 - 1]))]
        return topology_case(args, "edge")
    i = int(rng.integers(4))
    args[i] = pick(rng, BAD_INTS)
    return topology_case(args, "malformed")


def check_experts_case(rng: np.random.Generator) -> Case:
    topo = rp.Topology(*valid_topology_args(rng))
    if rng.random() < 0.6:
        e = int(rng.integers(1, 2 * topo.num_slots + 2))
        fits = e <= topo.num_slots
        return Case(
            "valid",
            topo.check_experts,
            (e,),
            expect="ok" if fits else "error",
            note="fits" if fits else "more experts than slots",
        )
    e = pick(rng, BAD_INTS)
    return Case("malformed", topo.check_experts, (e,), expect="error" if not is_int(e) or e < 1 else None)


# ------------------------------------------------------------------ ModelShape, Hardware
MODEL_FIELDS = ("num_layers", "num_experts", "top_k", "hidden", "expert_ffn")


def model_case(x: Any) -> Case:
    fields, attention, shared, groups = x
    kw = dict(attention=attention, shared_experts=shared, expert_groups=groups)
    ints = all(is_int(v) and v >= 1 for v in fields)
    valid = (
        ints
        and fields[2] <= fields[1]
        and is_int(shared)
        and shared >= 0
        and is_int(groups)
        and groups >= 1
        and fields[1] % groups == 0
        and (
            attention is None
            or (
                isinstance(attention, (list, tuple))
                and len(attention) in (0, fields[0])
                and all(a in ("linear", "full") for a in attention)
            )
        )
    )

    def check(m: rp.ModelShape) -> None:
        assert len(m.attention) == m.num_layers and set(m.attention) <= {"linear", "full"}
        assert m.top_k <= m.num_experts and m.num_experts % m.expert_groups == 0
        assert all(type(getattr(m, f)) in (int, np.int64) for f in MODEL_FIELDS)

    return Case(
        "valid" if valid else "malformed",
        rp.ModelShape,
        tuple(fields),
        kw,
        check=check,
        expect="ok" if valid else "error",
    )


MODEL_STRATEGY = st.tuples(
    st.tuples(*[st.one_of(st.integers(1, 40), scalars(-2, 40, huge=False)) for _ in range(5)]),
    st.one_of(
        st.none(),
        st.just("linear"),
        st.integers(),
        st.lists(st.sampled_from(["linear", "full", "Full", "", None, 3]), max_size=6),
        st.dictionaries(st.sampled_from(["linear", "full"]), st.integers(0, 3), max_size=2),
    ),
    scalars(-1, 3),
    st.one_of(st.just(1), st.integers(1, 4), scalars(-1, 4, huge=False)),
)

HW_BASE = st.tuples(
    st.floats(1e9, 1e16),
    st.floats(0.01, 1.0),
    st.floats(1e8, 1e12),
    st.floats(1e8, 1e12),
    st.floats(0.01, 1.0),
    st.floats(0, 1e-3),
)


def hardware_case(x: Any) -> Case:
    base, bad, name = x
    values = [bad.get(i, v) for i, v in enumerate(base)]
    d = dict(zip(HW_FIELDS, values))
    valid = (
        all(finite_number_ok(d[k], strict=True) for k in ("flops", "bw_intra", "bw_inter"))
        and all(finite_number_ok(d[k], strict=True, upper=1.0) for k in ("flops_efficiency", "comm_efficiency"))
        and finite_number_ok(d["expert_overhead_s"])
        and isinstance(name, str)
    )

    def check(hw: rp.Hardware) -> None:
        assert all(math.isfinite(float(getattr(hw, k))) for k in HW_FIELDS)

    return Case(
        "valid" if valid else "malformed", rp.Hardware, (name, *values), check=check, expect="ok" if valid else None
    )


# ------------------------------------------------------------------ CostModel
def cost_case(x: Any) -> Case:
    base, bad, a_quad = x
    scal = [bad.get(i, v) for i, v in enumerate(base)]
    kw = dict(zip([f for f in COST_FIELDS if f != "a_quad"], scal), a_quad=a_quad)
    valid = (
        all(finite_number_ok(kw[k], strict=k.startswith("bw_")) for k in kw if k != "a_quad")
        and isinstance(a_quad, (list, tuple))
        and len(a_quad) >= 1
        and all(finite_number_ok(v) for v in a_quad)
    )
    # a cost model must price some work (every coefficient but the bandwidths 0 is refused)
    valid = valid and (any(a_quad) or any(kw[k] for k in kw if k not in ("a_quad", "bw_intra", "bw_inter")))

    def check(c: rp.CostModel) -> None:
        for k in COST_FIELDS:
            v = getattr(c, k)
            vals = v if k == "a_quad" else [v]
            assert all(type(x) is float and math.isfinite(x) and x >= 0 for x in vals), f"cost.{k} = {v!r}"
        assert c.bw_intra > 0 and c.bw_inter > 0
        assert rp.CostModel.from_json(c.to_json()) == c, "JSON round trip differs"

    return Case("valid" if valid else "malformed", rp.CostModel, (), kw, check=check, expect="ok" if valid else "error")


COST_STRATEGY = st.tuples(
    st.lists(st.floats(1e-12, 1e12), min_size=9, max_size=9),
    st.dictionaries(st.integers(0, 8), numbers(), max_size=2),
    st.one_of(
        st.lists(st.floats(0, 1e-6), min_size=1, max_size=4),
        st.lists(numbers(), max_size=4),
        st.none(),
        st.text(max_size=3),
        numbers(),
        st.dictionaries(st.integers(0, 3), st.floats(0, 1), max_size=2),
        st.frozensets(st.floats(0, 1), max_size=2),
    ),
)


def a_cost(rng: np.random.Generator, layers: int) -> rp.CostModel:
    from random_plans import random_cost

    return random_cost(rng, layers)


def from_model_case(rng: np.random.Generator) -> Case:
    L = int(rng.integers(1, 8))
    E = int(rng.choice([2, 4, 8, 16, 64]))
    model = rp.ModelShape(
        L,
        E,
        int(rng.integers(1, min(E, 8) + 1)),
        int(rng.choice([8, 512, 7168])),
        int(rng.choice([8, 256, 2048])),
        attention=list(rng.choice(["linear", "full"], L)),
        shared_experts=int(rng.integers(0, 3)),
        expert_groups=int(rng.choice([1, 2])),
    )
    hw = rp.Hardware.h200()
    wb: Any = float(rng.choice([2, 1, 0.5, 4]))
    kind = "valid"
    args: List[Any] = [model, hw]
    r = rng.random()
    if r < 0.25:
        kind, wb = "malformed", pick(rng, BAD_FLOATS + [0, 0.0, -2])
    elif r < 0.4:
        kind = "malformed"
        args[int(rng.integers(2))] = pick(rng, BAD_OBJECTS)
    elif r < 0.5:  # odd but valid: a huge model, a tiny rate
        kind = "edge"
        args[0] = dataclasses.replace(model, hidden=int(rng.choice([2**20, 10**9])))
        args[1] = dataclasses.replace(hw, flops=float(rng.choice([1e-300, 1.0, 1e300])))

    def check(c: rp.CostModel) -> None:
        assert c.num_layers == model.num_layers
        for k in COST_FIELDS:
            v = getattr(c, k)
            assert all(math.isfinite(x) and x >= 0 for x in (v if k == "a_quad" else [v])), f"cost.{k} = {v!r}"
        assert c.bw_intra > 0 and c.bw_inter > 0

    return Case(
        kind,
        rp.CostModel.from_model,
        tuple(args),
        {"weight_bytes": wb},
        check=check,
        expect="ok" if kind == "valid" else None,
    )


def from_json_case(x: Any) -> Case:
    kind, text = x

    def check(c: rp.CostModel) -> None:
        assert rp.CostModel.from_json(c.to_json()) == c

    return Case(kind, rp.CostModel.from_json, (text,), check=check)


def _corrupted_json(drop: Any, extra: Any, replace: Any) -> str:
    base = json.loads(rp.traces.profile("tiny").cost().to_json())
    data = {k: v for k, v in {**base, **replace}.items() if k not in drop}
    data.update({k: v for k, v in extra.items() if k not in COST_FIELDS})
    return json.dumps(data)


FROM_JSON_STRATEGY = st.one_of(
    st.tuples(
        st.just("malformed"),
        st.one_of(st.text(max_size=40), JSON_VALUES.map(json.dumps), st.binary(max_size=20), st.none(), st.integers()),
    ),
    st.tuples(
        st.just("tampered"),
        st.builds(
            _corrupted_json,
            st.sets(st.sampled_from(COST_FIELDS), max_size=2),
            st.dictionaries(st.text(min_size=1, max_size=4), JSON_VALUES, max_size=2),
            st.dictionaries(st.sampled_from(COST_FIELDS + ["expert_groups"]), JSON_VALUES, max_size=3),
        ),
    ),
    st.tuples(
        st.just("valid"), st.sampled_from(["tiny", "flash"]).map(lambda n: rp.traces.profile(n).cost().to_json())
    ),
)


def cost_load_case(rng: np.random.Generator) -> Case:
    cost = a_cost(rng, int(rng.integers(1, 5)))
    path = tmp_path("cost")
    if rng.random() < 0.3:

        def setup() -> Any:
            cost.save(path)
            return (path,), {}

        def check(c: rp.CostModel) -> None:
            assert c == cost, "loaded cost model differs from the saved one"

        return Case("valid", rp.CostModel.load, (path,), check=check, expect="ok", setup=setup)
    label, raw = damage_text(rng, cost.to_json())

    def setup_damaged() -> Any:
        Path(path).write_bytes(raw)
        return (path,), {}

    return Case("damaged", rp.CostModel.load, (path,), note=label, names=(path,), setup=setup_damaged)


def cost_save_case(rng: np.random.Generator) -> Case:
    cost = a_cost(rng, 2)
    if rng.random() < 0.5:
        path = tmp_path("cost")
        return Case(
            "valid",
            cost.save,
            (Path(path) if rng.random() < 0.5 else path,),
            expect="ok",
            check=lambda _: _same(rp.CostModel.load(path), cost),
        )
    bad = pick(rng, [None, 3.5, {}, [], 2**40, -1, b"\0", "", object()])
    return Case("malformed", cost.save, (bad,), note="path of a wrong type")


def _same(a: Any, b: Any) -> None:
    assert a == b, "round trip differs"


# ------------------------------------------------------------------ Policy
def policy_case(rng: np.random.Generator) -> Case:
    from routepack.stages import PACKINGS, PLACEMENTS, REPLICATIONS

    choices = [sorted(PLACEMENTS), sorted(PACKINGS), sorted(REPLICATIONS), ["window", "previous"]]
    args = [str(rng.choice(c)) for c in choices]
    kind = "valid"
    if rng.random() < 0.4:
        kind = "malformed"
        i = int(rng.integers(4))
        args[i] = bad_for(rng, args[i])

    def check(p: Any) -> None:
        # Policy is a plain record; a bad choice must be refused when it is resolved
        from routepack.policies import resolve

        try:
            resolve(p)
        except rp.RoutepackError:
            assert kind != "valid", "a valid policy did not resolve"
        else:
            assert kind == "valid" or all(isinstance(a, str) for a in args), f"resolved a bad policy {p!r}"

    return Case(kind, rp.Policy, tuple(args), check=check)


TARGETS = [
    Target(
        "Topology",
        rp.Topology,
        both(
            hyp_gen(topology_args(), lambda a: topology_case(a, "malformed")),
            mixed((3, topology_from_rng), (1, replica_slots_case)),
        ),
        weight=3,
        names=("topo", "topo.dp", "topo.ep", "topo.gpus_per_node", "topo.slots_per_rank", "topo.replica_slots"),
    ),
    Target(
        "Topology.check_experts", rp.Topology.check_experts, mixed((1, check_experts_case)), weight=2, names=("topo",)
    ),
    Target("ModelShape", rp.ModelShape, hyp_gen(MODEL_STRATEGY, model_case), weight=3, names=("model",)),
    Target(
        "Hardware",
        rp.Hardware,
        hyp_gen(
            st.tuples(
                HW_BASE,
                st.dictionaries(st.integers(0, 5), numbers(), max_size=2),
                st.one_of(st.just("fuzz"), st.none(), st.integers()),
            ),
            hardware_case,
        ),
        weight=2,
        names=("hardware",),
    ),
    Target(
        "Hardware.h200",
        rp.Hardware.h200,
        mixed(
            (
                1,
                lambda rng: Case(
                    "valid",
                    rp.Hardware.h200,
                    (),
                    expect="ok",
                    check=lambda hw: hardware_case(
                        (
                            (
                                hw.flops,
                                hw.flops_efficiency,
                                hw.bw_intra,
                                hw.bw_inter,
                                hw.comm_efficiency,
                                hw.expert_overhead_s,
                            ),
                            {},
                            hw.name,
                        )
                    ).check(hw),
                ),
            )
        ),
        weight=1,
    ),
    Target("CostModel", rp.CostModel, hyp_gen(COST_STRATEGY, cost_case), weight=3, names=("cost",)),
    Target(
        "CostModel.from_model",
        rp.CostModel.from_model,
        mixed((1, from_model_case)),
        weight=2,
        names=("cost", "model", "hardware"),
    ),
    Target(
        "CostModel.from_json",
        rp.CostModel.from_json,
        hyp_gen(FROM_JSON_STRATEGY, from_json_case),
        weight=3,
        names=("cost JSON", "cost", "text"),
    ),
    Target("CostModel.load", rp.CostModel.load, mixed((1, cost_load_case)), weight=2, names=("cost JSON", "cost")),
    Target("CostModel.save", rp.CostModel.save, mixed((1, cost_save_case)), weight=1),
    Target("Policy", rp.Policy, mixed((1, policy_case)), weight=1, names=("policy",)),
]
