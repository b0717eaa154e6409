"""`check_windows`: a rebalanced EP model, a static twin and a single-process dense
reference trained side by side over several windows (see `selfcheck`)."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

import routepack as rp
from routepack.errors import RoutepackError
from routepack.plan import Placement
from routepack.torch.moe import dense_moe
from routepack.torch.replay import rank_microbatches
from selfcheck.case import Case, make_plans
from selfcheck.model import (
    EPModel,
    Weights,
    fingerprints,
    forward,
    inputs,
    logical_weights,
    make_groups,
    rel_err,
)


def check_windows(rank: int, world: int, device: Any, case: Case = Case()) -> Dict[str, Any]:
    """Trains a rebalanced EP model, a static EP model and a dense reference side by side over
    ``case.windows`` windows; returns the worst errors and the exact checks (see module doc)."""
    topo = case.topology()
    if world != topo.dp:
        raise RoutepackError(f"world: {world} ranks but the case has dp={topo.dp}")
    weights = Weights(case, device)
    groups = make_groups(topo)
    reb, sta = EPModel(case, weights, device, groups), EPModel(case, weights, device, groups)
    ref_w1 = torch.nn.Parameter(weights.w1.clone())
    ref_w2 = torch.nn.Parameter(weights.w2.clone())
    ref_router = torch.nn.Parameter(weights.router.clone())
    ref_opt = torch.optim.Adam([ref_w1, ref_w2, ref_router], lr=case.lr)

    figs: Dict[str, Any] = {
        "out": 0.0,
        "x_grad": 0.0,
        "expert_grad": 0.0,
        "router_grad": 0.0,
        "static_out": 0.0,
        "static_expert_grad": 0.0,
        "moved_rows": 0,
        "replica_rows": 0,
        "replica_tokens": 0,
        "migration_identical": True,
        "copies_identical": True,
        "loads_equal": True,
        "imbalance_equal": True,
        "received": [],
        "predicted": [],
    }
    previous = Placement.static(case.layers, case.experts, topo)
    for w in range(case.windows):
        plan, static, window, routed, cu = make_plans(case, w, previous)
        previous = plan.placement
        batches = {d: rank_microbatches(plan, routed, d, cu) for d in range(topo.dp)}
        before = fingerprints(reb.layers, reb.opt)
        # the rebalanced model runs on routes precomputed for the window, the static one
        # computes them in each forward: both against the dense reference
        reb.runner.begin_window(plan, window, reb.opt, microbatches=batches[rank])
        after = fingerprints(reb.layers, reb.opt)
        figs["moved_rows"] += int(plan.migration.size)
        figs["replica_rows"] += int(plan.replicas.size)
        # every expert's bytes (weights + optimizer state) unchanged, only located elsewhere
        figs["migration_identical"] &= all(len(before[k]) == 1 and after.get(k) == before[k] for k in before)
        figs["migration_identical"] &= set(after) == set(before)
        sta.runner.begin_window(static, window, sta.opt)

        # dense reference over every rank's microbatches
        ref_out, ref_xg = {}, {}
        loss = 0.0
        for d in range(topo.dp):
            for mb in batches[d]:
                x, r = inputs(case, w, d, mb.micro, mb.routed.shape[0], device)
                x.requires_grad_(True)
                y = forward(
                    x,
                    mb.routed.to(device),
                    list(ref_router),
                    lambda l, a, i, g: dense_moe(a, i, g, ref_w1[l], ref_w2[l]),
                )
                loss = loss + (y * r).sum()
                ref_out[(d, mb.micro)], ref_xg[(d, mb.micro)] = y.detach(), x
        loss.backward()

        for name, model in (("", reb), ("static_", sta)):
            for mb in batches[rank]:
                model.runner.start_micro(mb.micro)
                x, r = inputs(case, w, rank, mb.micro, mb.routed.shape[0], device)
                x.requires_grad_(True)
                y = model(x, mb.routed.to(device))
                if not name:  # (token, expert) rows this rank computed on replica copies
                    figs["replica_tokens"] += sum(
                        int((mod.last_route.recv_unit >= mod.slots_per_rank).sum()) for mod in model.layers
                    )
                (y * r).sum().backward()
                figs[name + "out"] = max(figs[name + "out"], rel_err(y.detach(), ref_out[(rank, mb.micro)]))
                if not name:
                    figs["x_grad"] = max(figs["x_grad"], rel_err(x.grad, ref_xg[(rank, mb.micro)].grad))
            model.runner.finish_step()
            for p in model.routers:
                dist.all_reduce(p.grad)
            for l, mod in enumerate(model.layers):
                for s, e in enumerate(mod.local_experts().tolist()):
                    if e < 0:
                        continue
                    for got, want in ((mod.w1.grad[s], ref_w1.grad[l, e]), (mod.w2.grad[s], ref_w2.grad[l, e])):
                        figs[name + "expert_grad"] = max(figs[name + "expert_grad"], rel_err(got, want))
            if not name:
                for l, p in enumerate(model.routers):
                    figs["router_grad"] = max(figs["router_grad"], rel_err(p.grad, ref_router.grad[l]))

        # the load every rank received is the plan's prediction, and the simulator's imbalance
        got = reb.runner.received
        figs["received"].append(got.tolist())
        figs["predicted"].append(reb.runner.predicted_received().tolist())
        figs["loads_equal"] &= bool(np.array_equal(got, reb.runner.predicted_received()))
        all_got = [None] * world
        dist.all_gather_object(all_got, got)
        # [dp, M, L] → [G, M, L, ep]; the simulator's imbalance from what was really received
        per_rank = np.stack(all_got).reshape(topo.num_groups, topo.ep, case.micro, case.layers).transpose(0, 2, 3, 1)
        sim = rp.simulate(
            plan,
            window,
            topo,
            rp.CostModel.from_model(
                rp.ModelShape(case.layers, case.experts, case.top_k, case.hidden, case.ffn), rp.Hardware.h200()
            ),
        )
        tot = per_rank.sum(-1)
        imb = np.where(tot > 0, per_rank.max(-1) * float(topo.ep) / np.maximum(tot, 1), 1.0)
        figs["imbalance_equal"] &= bool(np.array_equal(imb, sim.imbalance))

        for opt in (reb.opt, sta.opt, ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
        # redundant copies stepped with the same summed gradient: still identical, bit for bit
        figs["copies_identical"] &= all(len(v) == 1 for v in fingerprints(reb.layers, reb.opt).values())

    figs["mismatch"] = _replay_mismatch(case, weights, device, groups, make_plans(case, 0, previous), rank)
    a, b = logical_weights(reb.layers), logical_weights(sta.layers)
    figs["trained_vs_static"] = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b)
    ref = {
        (l, e): torch.cat([ref_w1[l, e].reshape(-1), ref_w2[l, e].reshape(-1)]).detach().double().cpu().numpy()
        for l in range(case.layers)
        for e in range(case.experts)
    }
    figs["trained_vs_dense"] = max(float(np.abs(a[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in ref)
    figs["router_vs_dense"] = max(rel_err(p.detach(), ref_router[l].detach()) for l, p in enumerate(reb.routers))
    figs["weights_changed"] = max(
        float(np.abs(a[k] - b0).max())
        for k, b0 in (
            ((l, e), torch.cat([weights.w1[l, e].reshape(-1), weights.w2[l, e].reshape(-1)]).double().cpu().numpy())
            for l in range(case.layers)
            for e in range(case.experts)
        )
    )
    return figs


def _replay_mismatch(case: Case, weights: Weights, device: Any, groups: Any, plans: tuple, rank: int) -> str:
    """One step on precomputed routes in which the last rank feeds its ids in another order
    (same counts, other pairs): what `finish_step` raised here ("nothing" if it did not)."""
    _, static, window, routed, cu = plans
    model = EPModel(case, weights, device, groups)
    mbs = rank_microbatches(static, routed, rank, cu)
    model.runner.begin_window(static, window, model.opt, microbatches=mbs)
    for mb in mbs:
        model.runner.start_micro(mb.micro)
        ids = mb.routed.flip(-1) if rank == case.dp - 1 else mb.routed
        x, r = inputs(case, 9, rank, mb.micro, mb.routed.shape[0], device)
        (model(x, ids.to(device)) * r).sum().backward()
    try:
        model.runner.finish_step()
    except RoutepackError as e:
        return str(e)
    return "nothing"
