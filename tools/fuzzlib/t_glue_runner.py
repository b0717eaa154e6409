"""``glue.PlanRunner``'s cases (`fuzzlib.t_glue`): one window end to end on 2 EP ranks (dp = ep
= 2): a random window of routed ids, a plan from one of `plan_window`'s presets (placements with
redundant experts, replicas, migration from the static placement), `EPMoE` layers under a
`PlanRunner` with Adam, every microbatch's forward and backward, ``finish_step``, the
optimizer's step. Valid: the step's audit is clean and each rank received the tokens the plan
predicts in every cell. Faults, each refused on both ranks (a `RoutepackError`; the audit's
`AuditError` is one): rank 1 holds another plan, passes no optimizer or feeds other ids than
the replay; both ranks skip a microbatch, or plan under a cap below a sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import routepack as rp
import torch

import routepack.torch as rt
from fuzzlib.engine import Case
from fuzzlib.t_glue_limits import WAIT
from routepack.plan import Placement
from routepack.torch.replay import rank_microbatches

PRESETS = ["static", "eplb", "hot_n", "relibra", "routepack"]
FAULTS = ["other plan", "no optimizer", "other ids", "skip micro", "cap"]


def _window(rng: np.random.Generator, L: int, E: int, k: int) -> tuple:
    lens = rng.integers(1, 12, size=int(rng.integers(8, 16)))  # dp * ep * 2 rows at least
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    routed = np.argsort(rng.random((int(cu[-1]), L, E)), axis=2)[:, :, :k].astype(np.int32)
    return rp.Window.from_routed_experts(routed, cu, E), routed, cu


def runner_case(rng: np.random.Generator) -> Case:
    L, E, k, H, I = int(rng.integers(1, 3)), int(rng.integers(2, 9)), 0, 8, 4
    k = int(rng.integers(1, min(E, 3) + 1))
    topo = rp.Topology(2, 2, 2, -(-E // 2) + int(rng.integers(0, 3)))
    window, routed, cu = _window(rng, L, E, k)
    cost = rp.CostModel.from_model(rp.ModelShape(L, E, k, H, I), rp.Hardware.h200())
    cap = int(window.seq_lens.max()) * int(rng.choice([1, 2, 8]))
    static = Placement.static(L, E, topo)
    policy, seed = str(rng.choice(PRESETS)), int(rng.integers(0, 1000))
    plan = rp.plan_window(
        window,
        topo,
        cost,
        token_cap=cap,
        policy=policy,
        previous=static,
        previous_window=window,
        seed=seed,
        anneal_moves=0,
    )
    other = rp.plan_window(window, topo, cost, token_cap=cap, policy="static", previous=static, seed=seed + 1)
    fault = str(rng.choice(FAULTS)) if rng.random() < 0.5 else ""
    if fault == "other plan" and other.same_as(plan):
        fault = ""
    if fault == "skip micro" and plan.num_micro < 2:
        fault = ""
    if fault == "cap" and int(window.seq_lens.max()) < 2:
        fault = ""
    precomputed = fault == "other ids" or bool(rng.random() < 0.5)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    w1, w2 = torch.randn(L, E, H, 2 * I, generator=g) / H**0.5, torch.randn(L, E, I, H, generator=g) / I**0.5
    routers = torch.randn(L, H, E, generator=g) / H**0.5
    inputs = [torch.randn(int(cu[-1]), H, generator=g), torch.randn(int(cu[-1]), H, generator=g)]

    def fn(rank: int) -> Any:
        layers = [rt.EPMoE(l, E, H, I, topo, static.phy2log[l]) for l in range(L)]
        for l, mod in enumerate(layers):
            mod.load_logical(w1[l], w2[l])
        rts = [torch.nn.Parameter(routers[l].clone()) for l in range(L)]
        opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)] + rts, lr=1e-3)
        runner = rt.PlanRunner(layers, topo, timeout=WAIT)
        mine = other if fault == "other plan" and rank == 1 else plan
        mbs = rank_microbatches(mine, routed, rank, cu, dp=2)
        runner.begin_window(
            mine,
            window,
            None if fault == "no optimizer" and rank == 1 else opt,
            token_cap=1 if fault == "cap" else cap,
            microbatches=mbs if precomputed else None,
        )
        for mb in mbs:
            if fault == "skip micro" and mb.micro == 0:
                continue
            runner.start_micro(mb.micro)
            rows = torch.from_numpy(np.concatenate([np.arange(cu[s], cu[s + 1]) for s in mb.samples]))
            h, ids = inputs[0][rows], mb.routed.long()
            if fault == "other ids" and rank == 1:
                ids = ids.flip(-1) if k > 1 else (ids + 1) % E
            for l, mod in enumerate(layers):
                a = torch.tanh(h)
                gate = torch.softmax(a @ rts[l], dim=-1).gather(1, ids[:, l])
                h = h + mod(a, ids[:, l], gate)
            (h * inputs[1][rows]).sum().backward()
        runner.finish_step()
        rep = runner.last_audit()
        assert rep is not None and rep.verdict == "ok", rep
        assert np.array_equal(runner.received, runner.predicted_received()), "received other tokens than the plan's"
        opt.step()
        return rep

    fn.__qualname__ = "PlanRunner"
    return Case(
        "malformed" if fault else "valid",
        fn,
        (),
        expect="error" if fault else "ok",
        note=f"{policy}, {'precomputed' if precomputed else 'live'} routes, {plan.num_micro} micro, "
        f"{plan.replicas.size} replica rows, {plan.migration.size} moves{', ' + fault if fault else ''}",
        names=("plan", "optimizer", "topk_ids", "token_cap", "finish_step", "begin_window", "window", "EP rank(s)"),
    )
