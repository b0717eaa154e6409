"""The cases of the ``glue.*`` targets (`fuzzlib.t_glue`): each a function of the rank and its
arguments, built from the batch's seed alike on both ranks; what each checks is in
`fuzzlib.t_glue`'s docstring. A function checks its own rank's result (an assertion fails the
case on either rank) and, after a refusal, that nothing moved. Imported with torch."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import routepack as rp
import torch

import routepack.torch as rt
from random_plans import migration_rows, random_phy2log, random_window
from fuzzlib.engine import Case
from fuzzlib.inputs import BAD_OBJECTS, damage, pick
from fuzzlib.t_glue_limits import WAIT
from fuzzlib.t_model import tmp_path
from fuzzlib.valid import valid_plan

#: cheap presets the planner targets draw from
PRESETS = ["static", "eplb", "hot_n", "relibra", "routepack"]


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__qualname__ = name
    return fn


# ------------------------------------------------------------------ agreements
def broadcast_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    src, bad, others_none = int(rng.integers(2)), rng.random() < 0.3, rng.random() < 0.5
    junk = pick(rng, BAD_OBJECTS)

    def fn(rank: int, plan: Any) -> Any:
        mine = (junk if bad else plan) if rank == src else (None if others_none else junk)
        got = rt.broadcast_plan(mine, src, timeout=WAIT)
        assert got.same_as(plan) and got.report == plan.report, "broadcast changed the plan"
        return got

    kind = "malformed" if bad else "valid"
    return Case(kind, _named(fn, "broadcast_plan"), (pc.plan,), expect="error" if bad else "ok", names=("plan", "src"))


def load_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    src, damaged = int(rng.integers(2)), rng.random() < 0.4
    buf = io.BytesIO()
    pc.plan.save(buf)
    raw = buf.getvalue()
    label, bad, forged = damage(rng, raw) if damaged else ("", raw, False)
    path = tmp_path("gluep")
    Path(path).write_bytes(bad)

    def fn(rank: int, path: str) -> Any:
        got = rt.load_plan(path, src, timeout=WAIT)
        assert forged or got.same_as(pc.plan), f"the plan loaded ({label or 'intact'}) is another"
        return got

    kind = "damaged" if damaged else "valid"
    return Case(
        kind, _named(fn, "load_plan"), (path,), expect=None if damaged else "ok", note=label, names=("plan file", path)
    )


def agree_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    other = copy.deepcopy(pc.plan)
    how = str(rng.choice(["same", "same", "other", "junk"]))
    if how == "other":
        other = valid_plan(rng).plan
    culprit, junk = int(rng.integers(2)), pick(rng, BAD_OBJECTS)

    def fn(rank: int, plan: Any) -> Any:
        mine = plan if rank != culprit else {"same": plan, "other": other, "junk": junk}[how]
        return rt.agree_on_plan(mine, timeout=WAIT)

    differ = how == "junk" or (how == "other" and not other.same_as(pc.plan))
    return Case(
        "valid" if not differ else "malformed",
        _named(fn, "agree_on_plan"),
        (pc.plan,),
        expect="error" if differ else "ok",
        names=("plan", "digest"),
    )


def gather_case(rng: np.random.Generator) -> Case:
    n = int(rng.integers(1, 5))
    vals = [[int(x) for x in rng.integers(-(2**62), 2**62, size=n)] for _ in range(2)]
    how = str(rng.choice(["ok", "ok", "bad", "count"]))
    culprit = int(rng.integers(2))
    bad = pick(rng, [[2**63], [1.5], ["x"], None, [[1]], 3, [-(2**63) - 1]])

    def fn(rank: int) -> Any:
        mine = vals[rank]
        if rank == culprit and how != "ok":
            mine = bad if how == "bad" else mine + [1]
        out = rt.gather_ints(mine, timeout=WAIT)
        assert out.shape == (2, n) and [r.tolist() for r in out] == vals, "gathered other values"
        return out

    return Case(
        "valid" if how == "ok" else "malformed",
        _named(fn, "gather_ints"),
        (),
        expect="ok" if how == "ok" else "error",
        names=("values",),
    )


# ------------------------------------------------------------------ planning and windows
def pwd_case(rng: np.random.Generator) -> Case:
    pc = valid_plan(rng)
    policy, seed = str(rng.choice(PRESETS)), int(rng.integers(0, 1000))
    kwargs: Dict[str, Any] = {
        "token_cap": pc.cap,
        "policy": policy,
        "seed": seed,
        "anneal_moves": int(rng.choice([0, 200])),
    }
    how = str(rng.choice(["ok", "ok", "both", "one"]))
    culprit = int(rng.integers(2))
    field, value = {
        0: ("token_cap", 0),
        1: ("policy", "nope"),
        2: ("time_budget_s", 1.0),
        3: ("seed", -1),
    }[int(rng.integers(4))]
    differ_field, differ_value = (("seed", seed + 1), ("policy", "static" if policy != "static" else "eplb"))[
        int(rng.integers(2))
    ]

    def fn(rank: int, window: Any, topo: Any, cost: Any) -> Any:
        kw = dict(kwargs, previous_window=window)  # the presets that place from the previous window's loads
        if how == "both":
            kw[field] = value
        elif how == "one" and rank == culprit:
            kw[differ_field] = differ_value
        got = rt.plan_window_distributed(window, topo, cost, timeout=WAIT, **kw)
        want = rp.plan_window(window, topo, cost, **kw)
        assert got.same_as(want) and got.digest() == want.digest(), "not plan_window's plan"
        got.validate(window, topo, kw["token_cap"])
        return got

    names = ("token_cap", "policy", "time_budget_s", "seed", "window", "topo", "cost")
    return Case(
        "valid" if how == "ok" else "malformed",
        _named(fn, "plan_window_distributed"),
        (pc.window, pc.topo, pc.cost),
        expect="ok" if how == "ok" else "error",
        note=f"{policy} {how} {field if how == 'both' else differ_field if how == 'one' else ''}",
        names=names,
    )


def gather_window_case(rng: np.random.Generator) -> Case:
    L, E = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    parts = [random_window(rng, int(rng.integers(1, 6)), L, E, max_len=20) for _ in range(2)]
    how = str(rng.choice(["ok", "ok", "ok", "shape", "junk"]))
    culprit = int(rng.integers(2))
    odd = (
        random_window(rng, 2, L + 1, E, max_len=5) if rng.random() < 0.5 else random_window(rng, 2, L, E + 1, max_len=5)
    )
    junk = pick(rng, BAD_OBJECTS)

    def fn(rank: int) -> Any:
        mine: Any = parts[rank]
        if rank == culprit and how != "ok":
            mine = odd if how == "shape" else junk
        got = rt.gather_window(mine, timeout=WAIT)
        w = got.window
        assert np.array_equal(w.seq_lens, np.concatenate([p.seq_lens for p in parts])), "samples differ"
        assert np.array_equal(w.expert_tokens, np.concatenate([p.expert_tokens for p in parts])), "counts differ"
        return got

    return Case(
        "valid" if how == "ok" else "malformed",
        _named(fn, "gather_window"),
        (),
        expect="ok" if how == "ok" else "error",
        names=("local", "L (layers)", "E (experts)"),
    )


# ------------------------------------------------------------------ migration
def _layers(topo: Any, rows: np.ndarray, w1: torch.Tensor, w2: torch.Tensor) -> List[Any]:
    out = []
    for l in range(rows.shape[0]):
        mod = rt.EPMoE(l, w1.shape[0], w1.shape[1], w2.shape[1], topo, rows[l])
        mod.load_logical(w1, w2)
        out.append(mod)
    return out


def _adam(layers: List[Any]) -> torch.optim.Optimizer:
    """Adam over the slots, stepped once with each slot's gradient a function of its expert's
    weights (so every copy of an expert holds the same moments)."""
    opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)], lr=1e-3)
    for m in layers:
        m.w1.grad, m.w2.grad = 0.01 * m.w1.detach(), 0.01 * m.w2.detach()
    opt.step()
    return opt


def migrate_case(rng: np.random.Generator) -> Case:
    L, E = int(rng.integers(1, 3)), int(rng.integers(2, 7))
    topo = rp.Topology(2, 2, 2, -(-E // 2) + int(rng.integers(0, 3)))
    prev, nxt = random_phy2log(rng, L, E, topo), random_phy2log(rng, L, E, topo)
    mig = migration_rows(prev, nxt, E, topo.slots_per_rank, 1.0)
    plan = rp.Plan(
        rp.Placement(nxt, E, topo.slots_per_rank), np.arange(2, dtype=np.int32), np.zeros(2, np.int32), 1, migration=mig
    )
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    w1, w2 = torch.randn(E, 4, 6, generator=g), torch.randn(E, 3, 4, generator=g)
    how = str(rng.choice(["ok", "ok", "tamper", "no optimizer"])) if len(mig) else "ok"
    culprit, tamper = int(rng.integers(2)), str(rng.choice(["dup", "expert", "slot", "drop"]))
    bad = copy.deepcopy(plan)
    if how == "tamper":
        m = plan.migration.copy()
        if tamper == "dup":
            bad.migration = np.concatenate([m, m[:1]])
        elif tamper == "expert":
            m["expert"][0] = (m["expert"][0] + 1) % E
            bad.migration = m
        elif tamper == "slot":
            m["dst_slot"][0] = topo.num_slots + 3
            bad.migration = m
        else:
            bad.migration = m[1:]

    def fn(rank: int) -> Any:
        layers = _layers(topo, prev, w1, w2)
        opt = _adam(layers)
        before = [(m.w1.detach().clone(), opt.state[m.w1]["exp_avg"].clone(), m.phy2log.copy()) for m in layers]
        mine = bad if how == "tamper" and rank == culprit else plan
        try:
            report = rt.migrate(layers, mine, None if how == "no optimizer" and rank == culprit else opt, timeout=WAIT)
        except rp.RoutepackError:
            for (w, a, row), m in zip(before, layers):
                assert torch.equal(w, m.w1) and torch.equal(a, opt.state[m.w1]["exp_avg"]), "a refusal moved state"
                assert np.array_equal(row, m.phy2log), "a refusal changed the placement"
            raise
        for l, m in enumerate(layers):
            assert np.array_equal(m.phy2log, nxt[l]), "placement not applied"
            for s, e in enumerate(m.local_experts().tolist()):
                if e >= 0:
                    assert torch.equal(m.w1.detach()[s] + 0.0, _stepped(w1[e])), (
                        f"slot {s} of layer {l}: not expert {e}"
                    )
                    moment = opt.state[m.w1]["exp_avg"][s]
                    assert torch.allclose(moment, 0.1 * (0.01 * w1[e]), rtol=1e-6, atol=0), f"slot {s}: not {e}'s Adam"
        return report

    return Case(
        "valid" if how == "ok" else "tampered",
        _named(fn, "migrate"),
        (),
        expect="ok" if how == "ok" else "error",
        note=f"{how} {tamper if how == 'tamper' else ''} on rank {culprit}",
        names=("migration row", "migration rows", "slot", "plan", "migration", "optimizer", "EP rank(s)"),
    )


def _stepped(w: torch.Tensor) -> torch.Tensor:
    """``w`` after `_adam`'s one step (the same arithmetic on one tensor)."""
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([p], lr=1e-3)
    p.grad = 0.01 * p.detach()
    opt.step()
    return p.detach()


def makers() -> Dict[str, Callable[[np.random.Generator], Case]]:
    from fuzzlib.t_glue_runner import runner_case

    torch.set_num_threads(1)
    return {
        "broadcast_plan": broadcast_case,
        "load_plan": load_case,
        "agree_on_plan": agree_case,
        "gather_ints": gather_case,
        "plan_window_distributed": pwd_case,
        "gather_window": gather_window_case,
        "migrate": migrate_case,
        "PlanRunner": runner_case,
    }
