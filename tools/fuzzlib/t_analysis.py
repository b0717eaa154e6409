"""Targets of `routepack.placement` (EPLB's entry point, imbalance), `routepack.traces`,
`routepack.compare` and `routepack.figures` (the command line: `fuzzlib.t_cli`)."""

from __future__ import annotations

import itertools
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import routepack as rp
from routepack import compare, figures, placement, traces

import eplb_reference
from random_plans import random_window
from test_traces_fuzz import PROFILE_FIELDS, SMALL_PROFILE
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import BAD_INTS, BAD_OBJECTS, is_huge, mutate_array, pick, spoil_one
from fuzzlib.t_model import tmp_path
from fuzzlib.t_planner import TOPOS


# ------------------------------------------------------------------ placement analysis
def rebalance_case(rng: np.random.Generator) -> Case:
    """DeepSeek's argument rules: num_gpus a multiple of num_nodes, num_replicas of
    num_gpus and >= E; the hierarchical policy when num_groups % num_nodes == 0 (then
    E % num_groups == 0 and the nodes divide the replicas)."""
    nodes = int(rng.choice([1, 2, 4]))
    gpus = nodes * int(rng.choice([1, 2, 4]))
    hier = rng.random() < 0.5
    groups = nodes * int(rng.integers(1, 4)) if hier else nodes * int(rng.integers(1, 4)) + 1
    E = groups * int(rng.integers(1, 5))
    per = -(-E // gpus) + int(rng.integers(0, 3))
    R = per * gpus
    L = int(rng.integers(1, 4))
    ties = rng.random() < 0.3
    w = (rng.integers(0, 5, (L, E)) if ties else rng.random((L, E)) * 100).astype(np.float64)
    args: List[Any] = [w, R, groups, nodes, gpus]
    kind, expect, note = "valid", "ok", ""
    if hier and (E % nodes or R % nodes):
        expect = None
    r = rng.random()
    if r < 0.15:
        note, args[0] = mutate_array(rng, w, only_same=True)
        kind = "edge"
        if note == "list":
            expect = None
    elif r < 0.4:
        kind, expect = "malformed", None
        i = int(rng.integers(5))
        if i == 0:
            note, args[0] = mutate_array(rng, w)
            note = "weight " + note
        else:
            args[i] = pick(rng, BAD_INTS + [R + 1, 0])
            note = ("weight", "num_replicas", "num_groups", "num_nodes", "num_gpus")[i]
            if is_huge(args[i]):
                kind = "absurd"
    elif r < 0.45:
        kind, expect, note = "absurd", None, "num_replicas = 2**40"
        args[1] = 2**40

    def check(out: Any) -> None:
        phy2log, log2phy, logcnt = out
        Rr = args[1]
        L, E = np.asarray(args[0]).shape
        assert phy2log.shape == (L, Rr) and logcnt.shape == (L, E) and log2phy.shape[:2] == (L, E)
        assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == Rr).all()
        for l in range(L):
            assert np.array_equal(np.bincount(phy2log[l], minlength=E), logcnt[l]), "logcnt != phy2log's counts"
            for e in range(E):
                slots = sorted(s for s in log2phy[l, e].tolist() if s >= 0)
                assert slots == np.flatnonzero(phy2log[l] == e).tolist(), "log2phy != phy2log"
        if not ties and kind == "valid":
            ref = eplb_reference.rebalance_experts(w, Rr, groups, nodes, gpus)
            for a, b in zip(out, ref):
                assert np.array_equal(a, b), "differs from DeepSeek's eplb.py (tests/eplb_reference.py)"

    return Case(kind, placement.rebalance_experts, tuple(args), check=check, expect=expect, note=note)


def loads_and_placement(rng: np.random.Generator):
    from random_plans import random_phy2log

    topo = rp.Topology(*TOPOS[int(rng.integers(len(TOPOS)))])
    L, E = int(rng.integers(1, 4)), int(rng.integers(1, topo.num_slots + 1))
    loads = rng.random((L, E)) * 100
    if rng.random() < 0.2:
        loads[:, : max(1, E // 2)] = 0
    p = rp.Placement(random_phy2log(rng, L, E, topo), E, topo.slots_per_rank)
    return topo, loads, p


def _bad_loads(rng: np.random.Generator, loads: np.ndarray) -> Any:
    """Loads mutated (`mutate_array`), or with one NaN / negative / infinite entry."""
    if rng.random() < 0.3:
        bad = loads.copy()
        bad[0, 0] = rng.choice([np.nan, -1.0, np.inf, -1e-300])
        return bad
    return mutate_array(rng, loads)[1]


def _loads_case(rng: np.random.Generator, args: List[Any], at: int, other: int) -> Tuple[str, Any]:
    """(kind, expect) of a case whose ``args[at]`` are loads and ``args[other]`` an object;
    one of them spoiled 40% of the time (a NaN or negative load must be refused)."""
    loads = args[at]
    i = spoil_one(rng, args, {at: lambda r: _bad_loads(r, loads), other: BAD_OBJECTS}, 0.4)
    if i is None:
        return "valid", "ok"
    x = np.asarray(args[at])
    bad_value = i == at and x.dtype.kind == "f" and x.shape == loads.shape and not (np.isfinite(x) & (x >= 0)).all()
    return "malformed", "error" if bad_value else None


def aggregate_case(rng: np.random.Generator) -> Case:
    topo, loads, p = loads_and_placement(rng)
    args: List[Any] = [p, loads]
    kind, expect = _loads_case(rng, args, 1, 0)

    def check(out: Any) -> None:
        x = np.asarray(args[1], dtype=np.float64)
        spr = p.slots_per_rank
        want = []
        for l in range(p.num_layers):
            per = np.zeros(p.num_ranks)
            for s, e in enumerate(p.phy2log[l].tolist()):
                if e >= 0:
                    per[s // spr] += x[l, e] / p.logcnt[l, e]
            want.append(per.max() / per.mean() if per.mean() > 0 else 1.0)
        assert out.shape == (p.num_layers,) and np.isfinite(out).all()
        assert np.allclose(out, want, rtol=1e-9), f"aggregate_imbalance {out} != {want}"

    return Case(kind, placement.aggregate_imbalance, tuple(args), check=check, expect=expect)


def lower_bound_case(rng: np.random.Generator) -> Case:
    topo, loads, _ = loads_and_placement(rng)
    args: List[Any] = [loads, topo]
    kind, expect = _loads_case(rng, args, 0, 1)

    def check(out: Any) -> None:
        x = np.asarray(args[0], dtype=np.float64)
        assert out.shape == (x.shape[0],) and np.isfinite(out).all()
        assert (out >= 1 - 1e-12).all() and (out <= topo.ep + 1e-9).all(), f"bound {out} outside [1, ep]"
        if x.shape[0] >= 1 and x.shape[1] <= topo.num_slots:
            static = rp.Placement.static(x.shape[0], x.shape[1], topo)
            got = placement.aggregate_imbalance(static, x)
            assert (out <= got + 1e-9).all(), "the lower bound exceeds the static placement's imbalance"

    return Case(kind, placement.imbalance_lower_bound, tuple(args), check=check, expect=expect)


# ------------------------------------------------------------------ traces
def profile_case(rng: np.random.Generator) -> Case:
    name = pick(rng, ["tiny", "flash", "tiny", "", "TINY", None, 3, SMALL_PROFILE, b"tiny", ["tiny"]])
    ok = name in ("tiny", "flash") or isinstance(name, traces.Profile)
    return Case(
        "valid" if ok else "malformed",
        traces.profile,
        (name,),
        check=lambda p: None if isinstance(p, traces.Profile) else (_ for _ in ()).throw(AssertionError()),
        expect="ok" if ok else "error",
        names=("profile",),
    )


def profile_ctor_case(rng: np.random.Generator) -> Case:
    tweaks = {}
    for f in rng.choice(PROFILE_FIELDS, size=int(rng.integers(0, 3)), replace=False):
        tweaks[str(f)] = pick(
            rng, [int(rng.integers(-2, 40)), float(rng.uniform(-2, 40)), float("nan"), None, "3", 2**64, 0, True]
        )
    if rng.random() < 0.2:
        tweaks["attention"] = pick(rng, [("linear",), "full", None, ("full", "nope"), {"full": 1}])

    def make() -> Any:
        return dataclasses.replace(SMALL_PROFILE, **tweaks)

    make.__qualname__ = "Profile"
    return Case(
        "malformed" if tweaks else "valid",
        make,
        (),
        note=repr(tweaks),
        expect=None if tweaks else "ok",
        names=tuple(f"profile.{f}" for f in PROFILE_FIELDS)
        + ("profile.attention", "model.attention", "profile", "model", "topo"),
    )


def synthetic_case(rng: np.random.Generator) -> Case:
    tweaks = {}
    if rng.random() < 0.5:
        for f in rng.choice(PROFILE_FIELDS, size=int(rng.integers(1, 3)), replace=False):
            tweaks[str(f)] = pick(rng, [int(rng.integers(1, 30)), float(rng.uniform(0.1, 5)), 1, 2, 0.0])
    call: List[Any] = [tweaks, int(rng.integers(1, 3)), pick(rng, [0, 1, 2**63, 2**64 - 1])]
    kind = "valid" if spoil_one(rng, call, {1: BAD_INTS, 2: BAD_INTS}, 0.3) is None else "malformed"
    windows, seed = call[1], call[2]

    def run(prof: Any, n: Any, s: Any) -> Any:
        if isinstance(prof, dict):
            prof = dataclasses.replace(SMALL_PROFILE, **prof)
        return prof, list(itertools.islice(traces.synthetic(prof, n, s), 2))  # n may be 2**32

    run.__qualname__ = "traces.synthetic"

    def check(out: Any) -> None:
        prof, ws = out
        assert len(ws) == min(windows, 2)
        for w in ws:
            assert w.expert_tokens.shape[1:] == (prof.num_layers, prof.num_experts)
            assert (w.expert_tokens.sum(axis=2) == prof.top_k * w.seq_lens[:, None]).all(), "sum != top_k * length"
            assert (w.expert_tokens <= w.seq_lens[:, None, None]).all(), "a count above its length"

    return Case(
        kind,
        run,
        (tweaks, windows, seed),
        check=check,
        note=repr(tweaks),
        names=("windows", "seed", "profile") + tuple(f"profile.{f}" for f in PROFILE_FIELDS),
    )


# ------------------------------------------------------------------ compare and its tables
def random_rows(rng: np.random.Generator) -> List[compare.Row]:
    names = list(rng.choice(sorted(rp.PRESETS), size=int(rng.integers(1, 5)), replace=False))
    rows = []
    for wi in range(1, int(rng.integers(2, 5))):
        for n in names:
            step = float(10 ** rng.uniform(-3, 1))
            parts = rng.dirichlet(np.ones(5)) * step
            G, M, L = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
            rows.append(
                compare.Row(
                    policy=str(n),
                    window=wi,
                    step_time=step,
                    throughput=1000 / step,
                    fraction_of_balanced=float(rng.uniform(0.2, 1.2)),
                    attention=parts[0],
                    expert=parts[1],
                    all_to_all=parts[2],
                    replication=parts[3],
                    migration=parts[4],
                    imbalance=float(rng.uniform(1, 3)),
                    num_micro=M,
                    micro_lower_bound=max(1, M - 1),
                    plan_seconds=float(rng.random()),
                    ideal_time=step * 0.8,
                    fraction_of_bound=float(rng.choice([np.nan, 0.7])),
                    lower_bound_time=float(rng.choice([np.nan, step * 0.7])),
                    imbalance_map=1 + rng.random((G, M, L)),
                )
            )
    return rows


def tables_case(fn: Any, which: str):
    def make(rng: np.random.Generator) -> Case:
        rows = random_rows(rng)
        kind = "valid"
        if rng.random() < 0.15:
            rows, kind = [], "edge"
        summary = compare.summarise(rows) if rows else []
        arg: Any = {
            "rows": rows,
            "summary": summary,
            "ratios": compare.ratios(rows, str(rows[0].policy)) if rows else [],
        }[which]
        extra: tuple = ()
        if rng.random() < 0.2:
            kind = "malformed"
            arg = pick(rng, [None, "rows", 3, [None], [{"policy": 1}], {"a": 1}])

        def check(out: Any) -> None:
            if isinstance(out, str):
                assert "nan" not in out.lower() or which != "summary", "NaN printed in a table"
            elif isinstance(out, list) and out and isinstance(out[0], dict):
                for d in out:
                    for k, v in d.items():
                        assert (
                            not isinstance(v, float)
                            or math.isfinite(v)
                            or k
                            in (
                                "of_bound",
                                "vs_static",
                                "vs_best",
                                "attention",
                                "expert",
                                "all_to_all",
                                "replication",
                                "migration",
                                "plan_s",
                                "cross_node_bytes_per_token",
                                "redundant_grads",
                                "bubble",
                            )
                        ), f"{k} = {v}"

        return Case(
            kind,
            fn,
            (arg, *extra),
            check=check,
            expect="ok" if kind != "malformed" else None,
            names=("rows", "summary", "ratio_rows"),
        )

    return make


def compare_case(rng: np.random.Generator) -> Case:
    from fuzzlib.t_planner import random_inputs

    inp = random_inputs(rng, "static")
    L, E = inp.window.num_layers, inp.window.num_experts
    windows: Any = [inp.window] + [
        random_window(rng, inp.window.num_samples, L, E, max_len=int(inp.window.seq_lens.max()))
        for _ in range(int(rng.integers(1, 3)))
    ]
    cap = max(inp.cap, max(int(w.seq_lens.max()) for w in windows))
    pols = list(rng.choice(sorted(rp.PRESETS), size=int(rng.integers(1, 4)), replace=False))
    kind, expect = "valid", "ok"
    args: List[Any] = [windows, inp.topo, inp.cost, cap]
    if rng.random() < 0.3:
        kind, expect = "malformed", None
        i = int(rng.integers(5))
        if i == 0:
            args[0] = pick(rng, [windows[:1], None, "w", [None, None], windows[0]])
        elif i == 4:
            pols = pick(rng, [["nope"], "static", [None], 3])
        else:
            args[i] = pick(rng, BAD_OBJECTS if i < 3 else BAD_INTS)
    for w in windows if isinstance(windows, list) else []:
        # the later windows are drawn without a feasibility check: with under two samples a DP
        # rank, a packing that needs more rows than the fewest (sequential's greedy rows) may
        # find no plan where another does, and says so (InfeasibleError "cannot fill")
        if isinstance(w, rp.Window) and 2 * inp.topo.dp > w.num_samples:
            expect = None

    def check(rows: Any) -> None:
        assert len(rows) == (len(windows) - 1) * len(pols)
        for r in rows:
            assert math.isfinite(r.step_time) and r.step_time > 0 and r.num_micro >= r.micro_lower_bound
        compare.format_table(compare.summarise(rows, pols[0]), pols[0])

    return Case(
        kind,
        compare.compare,
        tuple(args),
        {"policies": pols, "seed": int(rng.integers(100)), "anneal_moves": 500},
        check=check,
        expect=expect,
        names=("windows", "topo", "cost", "token_cap", "policies", "policy"),
    )


def figure_case(rng: np.random.Generator) -> Case:
    rows = random_rows(rng)
    summary = compare.summarise(rows, rows[0].policy)
    path: Any = tmp_path("fig") + ".png"
    kind = "valid"
    if rng.random() < 0.2:
        kind, path = "malformed", pick(rng, [None, 3, {}])

    def check(out: Any) -> None:
        assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
        os.unlink(out)

    return Case(
        kind,
        figures.bench_figure,
        (rows, summary, path),
        {"baseline": rows[0].policy},
        check=check,
        expect="ok" if kind == "valid" else None,
    )


def legend_case(rng: np.random.Generator) -> Case:
    call: List[Any] = [str(rng.choice(sorted(rp.PRESETS))), bool(rng.random() < 0.5)]
    kind = (
        "valid"
        if spoil_one(rng, call, {0: [None, 3, b"static", ["x"]], 1: ["yes", None, 2]}, 0.3) is None
        else "malformed"
    )
    return Case(
        kind,
        compare.table_legend,
        tuple(call),
        check=lambda out: _is_text(out),
        expect="ok" if kind == "valid" else None,
        names=("baseline", "bound"),
    )


def presets_case(rng: np.random.Generator) -> Case:
    def check(out: Any) -> None:
        assert out == [n for n in rp.PRESETS], "available_presets() != the presets in order"

    return Case("valid", compare.available_presets, (), check=check, expect="ok")


def profile_cost_case(rng: np.random.Generator) -> Case:
    hw: Any = None if rng.random() < 0.5 else rp.Hardware.h200()
    kind = "valid"
    if rng.random() < 0.3:
        hw, kind = pick(rng, ["h200", 3, {}, rp.ModelShape(1, 2, 1, 4, 4)]), "malformed"

    def check(cost: Any) -> None:
        assert isinstance(cost, rp.CostModel) and cost.num_layers == SMALL_PROFILE.num_layers

    return Case(
        kind, SMALL_PROFILE.cost, (hw,), check=check, expect="ok" if kind == "valid" else "error", names=("hardware",)
    )


def _is_text(out: Any) -> None:
    assert isinstance(out, str) and out, "not a non-empty string"


TARGETS = [
    Target("placement.rebalance_experts", placement.rebalance_experts, mixed((1, rebalance_case)), weight=3),
    Target("placement.aggregate_imbalance", placement.aggregate_imbalance, mixed((1, aggregate_case)), weight=2),
    Target("placement.imbalance_lower_bound", placement.imbalance_lower_bound, mixed((1, lower_bound_case)), weight=2),
    Target("traces.profile", traces.profile, mixed((1, profile_case)), weight=1),
    Target("traces.Profile", traces.Profile, mixed((1, profile_ctor_case)), weight=1),
    Target("traces.synthetic", traces.synthetic, mixed((1, synthetic_case)), weight=1, batch=8),
    Target("compare.compare", compare.compare, mixed((1, compare_case)), weight=1, batch=8),
    Target("compare.summarise", compare.summarise, mixed((1, tables_case(compare.summarise, "rows"))), weight=1),
    Target("compare.ratios", compare.ratios, mixed((1, tables_case(compare.ratios, "rows"))), weight=1),
    Target(
        "compare.best_baseline", compare.best_baseline, mixed((1, tables_case(compare.best_baseline, "rows"))), weight=1
    ),
    Target("compare.best_of", compare.best_of, mixed((1, tables_case(compare.best_of, "rows"))), weight=1),
    Target(
        "compare.format_table", compare.format_table, mixed((1, tables_case(compare.format_table, "summary"))), weight=1
    ),
    Target(
        "compare.format_ratios",
        compare.format_ratios,
        mixed((1, tables_case(compare.format_ratios, "ratios"))),
        weight=1,
    ),
    Target("compare.table_legend", compare.table_legend, mixed((1, legend_case)), weight=1),
    Target("compare.available_presets", compare.available_presets, mixed((1, presets_case)), weight=1),
    Target("traces.Profile.cost", traces.Profile.cost, mixed((1, profile_cost_case)), weight=1),
    Target("figures.bench_figure", figures.bench_figure, mixed((1, figure_case)), weight=1, batch=4, names=("path",)),
]
