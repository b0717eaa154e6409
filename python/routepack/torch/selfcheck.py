"""Self-checks of `routepack.torch`, shared by ``tests/torch`` (gloo, 4 CPU processes) and
``tools/gpu_check.py`` (NCCL on GPUs).

Each ``check_*`` function runs on every rank of an initialised process group and returns a
dict of measured figures (errors, equalities, counts); the callers assert on them. Everything
is generated from ``Case.seed``, so every rank builds the same windows and plans, and every
plan passes `Plan.validate` before use.

* `check_windows`: several windows in sequence, each with a plan that migrates experts
  (weights + Adam state), replicates hot experts (ReLibra rows in odd cells, MindSpeed rows in
  even ones) and holds redundant slots; forward outputs, input/router/expert gradients against
  a single-process dense reference; a static-placement twin trained on the same data; the load
  each rank received against ``_core.rank_tokens`` and ``simulate``'s imbalance.
* `check_faults`: bad plans refused before any transfer; a fault raised on one rank at each
  protocol point leaves every rank intact; the migration then succeeds bit for bit;
  `broadcast_plan`.
* `check_peer_death`: a rank exits in the middle of a migration; the others raise within the
  timeout with their state intact.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import routepack as rp
from routepack.errors import RoutepackError
from routepack import _core
from routepack.plan import MIGRATION_DTYPE, REPLICA_DTYPE, Placement, Plan
from routepack.torch.broadcast import broadcast_plan, plan_digest
from routepack.torch.migrate import expert_state, pack_slot
from routepack.torch.moe import EPMoE, dense_moe
from routepack.torch.replay import rank_microbatches
from routepack.torch.runner import PlanRunner


@dataclass(frozen=True)
class Case:
    """Sizes of a self-check. Defaults: 2 nodes × 2 ranks, 8 experts in 12 slots (4 redundant)."""

    dp: int = 4
    ep: int = 4
    gpus_per_node: int = 2
    slots_per_rank: int = 3
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 16
    ffn: int = 8
    micro: int = 2
    samples: int = 12
    windows: int = 4
    seed: int = 0
    lr: float = 1e-2

    def topology(self) -> rp.Topology:
        return rp.Topology(self.dp, self.ep, self.gpus_per_node, self.slots_per_rank)


# ---------------------------------------------------------------- data and plans
def make_window(case: Case, w: int) -> Tuple[rp.Window, np.ndarray, np.ndarray]:
    """Window ``w``: (Window, routed int32 ``[T, L, k]`` distinct ids per token, cu ``[S+1]``).
    Per-layer popularity is skewed so some experts are hot."""
    rng = np.random.default_rng([case.seed, 1, w])
    lens = rng.integers(2, 10, size=case.samples)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t_n = int(cu[-1])
    routed = np.zeros((t_n, case.layers, case.top_k), dtype=np.int32)
    for l in range(case.layers):
        pop = rng.dirichlet(np.full(case.experts, 0.6))
        for t in range(t_n):
            routed[t, l] = rng.choice(case.experts, size=case.top_k, replace=False, p=pop)
    return rp.Window.from_routed_experts(routed, cu, case.experts), routed, cu


def make_layout(case: Case, w: int) -> Tuple[np.ndarray, np.ndarray]:
    """(sample_rank, sample_micro): a random layout with every (rank, micro) cell non-empty."""
    rng = np.random.default_rng([case.seed, 2, w])
    perm = rng.permutation(case.samples)
    cells = case.dp * case.micro
    slot = np.where(np.arange(case.samples) < cells, np.arange(case.samples), rng.integers(0, cells, case.samples))
    rank = np.zeros(case.samples, dtype=np.int32)
    micro = np.zeros(case.samples, dtype=np.int32)
    rank[perm] = slot % case.dp
    micro[perm] = slot // case.dp
    return rank, micro


def make_placement(case: Case, w: int) -> Placement:
    """Every expert once plus the spare slots filled with (hot-biased) redundant copies, shuffled
    per layer; some spare slots may stay empty."""
    rng = np.random.default_rng([case.seed, 3, w])
    topo = case.topology()
    rows = []
    for _ in range(case.layers):
        extra = topo.num_slots - case.experts
        spare = rng.choice(case.experts, size=extra, replace=True)
        if extra:
            spare[rng.random(extra) < 0.2] = -1
        row = np.concatenate([np.arange(case.experts), spare]).astype(np.int32)
        rows.append(rng.permutation(row))
    return Placement(np.stack(rows), case.experts, case.slots_per_rank)


def cell_origin(case: Case, window: rp.Window, rank: np.ndarray, micro: np.ndarray, g: int, m: int, l: int) -> np.ndarray:
    """int64 ``[ep, E]``: tokens of each expert from each EP rank of group g at (m, l)."""
    out = np.zeros((case.ep, case.experts), dtype=np.int64)
    for r in range(case.ep):
        sel = (rank == g * case.ep + r) & (micro == m)
        out[r] = window.expert_tokens[sel, l].sum(axis=0)
    return out


def make_replicas(case: Case, window: rp.Window, placement: Placement, rank: np.ndarray,
                  micro: np.ndarray, w: int) -> np.ndarray:
    """Hot-expert rows per (group, micro, layer): MindSpeed-style in even cells (the hottest
    expert copied to every other EP rank, each computing its own tokens), ReLibra-style in odd
    cells (the two hottest copied to a node mate with a fixed share)."""
    rng = np.random.default_rng([case.seed, 4, w])
    topo = case.topology()
    rows = []
    if case.ep < 2:
        return np.zeros(0, dtype=REPLICA_DTYPE)
    per_node = min(case.gpus_per_node, case.ep)
    for g in range(topo.num_groups):
        for m in range(case.micro):
            for l in range(case.layers):
                origin = cell_origin(case, window, rank, micro, g, m, l)
                hot = np.argsort(-origin.sum(axis=0), kind="stable")
                cell = (g * case.micro + m) * case.layers + l
                hosts = lambda e: np.flatnonzero(placement.phy2log[l] == e) // case.slots_per_rank  # noqa: E731
                if cell % 2 == 0:
                    e = int(hot[0])
                    src = int(hosts(e)[0])
                    total = origin[:, e].sum()
                    for d in range(case.ep):
                        if d != src and total > 0:
                            rows.append((m, g, l, e, src, d, np.float32(origin[d, e] / total)))
                else:
                    for e in hot[:2].tolist():
                        src = int(hosts(e)[0])
                        mates = [d for d in range(case.ep) if d // per_node == src // per_node and d != src]
                        if mates:
                            rows.append((m, g, l, e, src, int(rng.choice(mates)), np.float32(rng.uniform(0.2, 0.5))))
    return np.array(rows, dtype=REPLICA_DTYPE)


def migration_rows(previous: Placement, nxt: Placement, bytes_per_expert: float = 1.0) -> np.ndarray:
    cols = _core.migration_diff(previous.phy2log, nxt.phy2log, nxt.num_experts, nxt.slots_per_rank, bytes_per_expert)
    out = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
    for name, col in zip(MIGRATION_DTYPE.names, cols):
        out[name] = col
    return out


def make_plans(case: Case, w: int, previous: Placement) -> Tuple[Plan, Plan, rp.Window, np.ndarray, np.ndarray]:
    """(rebalanced plan, static plan, window, routed, cu) of window ``w``. The rebalanced plan
    migrates from ``previous``; the static one keeps Megatron's placement and no replicas.
    Both share the layout and pass `Plan.validate`."""
    topo = case.topology()
    window, routed, cu = make_window(case, w)
    rank, micro = make_layout(case, w)
    placement = make_placement(case, w)
    plan = Plan(placement, rank, micro, case.micro,
                make_replicas(case, window, placement, rank, micro, w),
                migration_rows(previous, placement), policy="selfcheck")
    static = Plan(Placement.static(case.layers, case.experts, topo), rank, micro, case.micro, policy="static")
    cap = 1 << 20
    return plan.validate(window, topo, cap), static.validate(window, topo, cap), window, routed, cu


# ------------------------------------------------------------------- models
class Weights:
    """Logical parameters: ``w1`` ``[L, E, H, 2I]``, ``w2`` ``[L, E, I, H]``, ``router``
    ``[L, H, E]`` (drawn on the CPU from the seed, identical on every rank)."""

    def __init__(self, case: Case, device: Any) -> None:
        g = torch.Generator().manual_seed(case.seed)
        L, E, H, I = case.layers, case.experts, case.hidden, case.ffn
        self.w1 = (torch.randn(L, E, H, 2 * I, generator=g) / H ** 0.5).to(device)
        self.w2 = (torch.randn(L, E, I, H, generator=g) / I ** 0.5).to(device)
        self.router = (torch.randn(L, H, E, generator=g) / H ** 0.5).to(device)


def forward(x: torch.Tensor, ids: torch.Tensor, routers: Sequence[torch.Tensor],
            moe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The test model: ``h += moe_l(tanh(h), ids[:, l], softmax(tanh(h) @ router_l)[ids])`` per
    layer. Routing is replayed (``ids`` ``[T, L, k]``); gate weights come from the router."""
    h = x
    for l, router in enumerate(routers):
        a = torch.tanh(h)
        idx = ids[:, l].long()
        gate = torch.softmax(a @ router, dim=-1).gather(1, idx)
        h = h + moe(l, a, idx, gate)
    return h


def make_groups(topo: rp.Topology) -> Tuple[Any, Any]:
    """(EP group, EDP group) of this rank when the world is ``topo.dp`` ranks: EP groups are
    consecutive blocks of ``ep`` ranks; EDP groups the ranks with the same EP-local rank.
    (None, None) with a single EP group. Every rank creates every group (collective)."""
    if topo.num_groups == 1:
        return None, None
    me = dist.get_rank()
    ep_group = edp_group = None
    for g in range(topo.num_groups):
        grp = dist.new_group(list(range(g * topo.ep, (g + 1) * topo.ep)))
        if me // topo.ep == g:
            ep_group = grp
    for r in range(topo.ep):
        grp = dist.new_group(list(range(r, topo.dp, topo.ep)))
        if me % topo.ep == r:
            edp_group = grp
    return ep_group, edp_group


class EPModel:
    """This rank's share of the test model: `EPMoE` layers + a replicated router."""

    def __init__(self, case: Case, weights: Weights, device: Any, groups: Tuple[Any, Any] = (None, None)) -> None:
        topo = case.topology()
        static = Placement.static(case.layers, case.experts, topo)
        group, edp_group = groups
        self.layers = [EPMoE(l, case.experts, case.hidden, case.ffn, topo, static.phy2log[l], group,
                             device=device) for l in range(case.layers)]
        for l, mod in enumerate(self.layers):
            mod.load_logical(weights.w1[l], weights.w2[l])
        self.routers = [torch.nn.Parameter(weights.router[l].clone()) for l in range(case.layers)]
        self.runner = PlanRunner(self.layers, topo, group, edp_group, timeout=datetime.timedelta(seconds=60))
        self.opt = torch.optim.Adam(self.parameters(), lr=case.lr)

    def parameters(self) -> List[torch.nn.Parameter]:
        return [p for mod in self.layers for p in (mod.w1, mod.w2)] + self.routers

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return forward(x, ids, self.routers, lambda l, a, i, g: self.layers[l](a, i, g))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are exactly zero; inf when only ``b`` is)."""
    num = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    den = float(b.double().abs().max()) if b.numel() else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def fingerprints(layers: Sequence[EPMoE], opt: Optional[torch.optim.Optimizer]) -> Dict[Tuple[int, int], set]:
    """(layer, expert) → set of SHA-256 digests of every slot holding it, over all EP ranks;
    each digest covers the slot's weights and optimizer state, byte for byte."""
    mine = {}
    for l, mod in enumerate(layers):
        st = expert_state(mod, opt)
        for s, e in enumerate(mod.local_experts().tolist()):
            if e >= 0:
                digest = hashlib.sha256(pack_slot(st, s).cpu().numpy().tobytes()).hexdigest()
                mine.setdefault((l, e), set()).add(digest)
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    merged: Dict[Tuple[int, int], set] = {}
    for part in out:
        for k, v in part.items():
            merged.setdefault(k, set()).update(v)
    return merged


def logical_weights(layers: Sequence[EPMoE]) -> Dict[Tuple[int, int], np.ndarray]:
    """(layer, expert) → flat float64 weights, from whichever rank holds it (all copies equal)."""
    mine = {}
    for l, mod in enumerate(layers):
        for s, e in enumerate(mod.local_experts().tolist()):
            if e >= 0:
                mine[(l, e)] = torch.cat([mod.w1[s].reshape(-1), mod.w2[s].reshape(-1)]).detach().double().cpu().numpy()
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    merged = {}
    for part in out:
        merged.update(part)
    return merged


def _inputs(case: Case, w: int, rank: int, m: int, tokens: int, device: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, cotangent) of rank ``rank``'s microbatch ``m`` in window ``w``: ``[T, H]`` each."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([case.seed, 5, w, rank, m]).generate_state(1)[0]))
    return (torch.randn(tokens, case.hidden, generator=g).to(device),
            torch.randn(tokens, case.hidden, generator=g).to(device))


# ------------------------------------------------------------------- checks
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

    figs: Dict[str, Any] = {"out": 0.0, "x_grad": 0.0, "expert_grad": 0.0, "router_grad": 0.0,
                            "static_out": 0.0, "static_expert_grad": 0.0, "moved_rows": 0,
                            "replica_rows": 0, "replica_tokens": 0, "migration_identical": True, "copies_identical": True,
                            "loads_equal": True, "imbalance_equal": True, "received": [], "predicted": []}
    previous = Placement.static(case.layers, case.experts, topo)
    for w in range(case.windows):
        plan, static, window, routed, cu = make_plans(case, w, previous)
        previous = plan.placement
        before = fingerprints(reb.layers, reb.opt)
        reb.runner.begin_window(plan, window, reb.opt)
        after = fingerprints(reb.layers, reb.opt)
        figs["moved_rows"] += int(plan.migration.size)
        figs["replica_rows"] += int(plan.replicas.size)
        # every expert's bytes (weights + optimizer state) unchanged, only located elsewhere
        figs["migration_identical"] &= all(len(before[k]) == 1 and after.get(k) == before[k] for k in before)
        figs["migration_identical"] &= set(after) == set(before)
        sta.runner.begin_window(static, window, sta.opt)

        # dense reference over every rank's microbatches
        batches = {d: rank_microbatches(plan, routed, d, cu) for d in range(topo.dp)}
        ref_out, ref_xg = {}, {}
        loss = 0.0
        for d in range(topo.dp):
            for mb in batches[d]:
                x, r = _inputs(case, w, d, mb.micro, mb.routed.shape[0], device)
                x.requires_grad_(True)
                y = forward(x, mb.routed.to(device), list(ref_router),
                            lambda l, a, i, g: dense_moe(a, i, g, ref_w1[l], ref_w2[l]))
                loss = loss + (y * r).sum()
                ref_out[(d, mb.micro)], ref_xg[(d, mb.micro)] = y.detach(), x
        loss.backward()

        for name, model in (("", reb), ("static_", sta)):
            for mb in batches[rank]:
                model.runner.start_micro(mb.micro)
                x, r = _inputs(case, w, rank, mb.micro, mb.routed.shape[0], device)
                x.requires_grad_(True)
                y = model(x, mb.routed.to(device))
                if not name:  # (token, expert) rows this rank computed on replica copies
                    figs["replica_tokens"] += sum(int((mod.last_route.recv_unit >= mod.slots_per_rank).sum())
                                                  for mod in model.layers)
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
        sim = rp.simulate(plan, window, topo, rp.CostModel.from_model(
            rp.ModelShape(case.layers, case.experts, case.top_k, case.hidden, case.ffn), rp.Hardware.h200()))
        tot = per_rank.sum(-1)
        imb = np.where(tot > 0, per_rank.max(-1) * float(topo.ep) / np.maximum(tot, 1), 1.0)
        figs["imbalance_equal"] &= bool(np.array_equal(imb, sim.imbalance))

        for opt in (reb.opt, sta.opt, ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
        # redundant copies stepped with the same summed gradient: still identical, bit for bit
        figs["copies_identical"] &= all(len(v) == 1 for v in fingerprints(reb.layers, reb.opt).values())

    a, b = logical_weights(reb.layers), logical_weights(sta.layers)
    figs["trained_vs_static"] = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b)
    ref = {(l, e): torch.cat([ref_w1[l, e].reshape(-1), ref_w2[l, e].reshape(-1)]).detach().double().cpu().numpy()
           for l in range(case.layers) for e in range(case.experts)}
    figs["trained_vs_dense"] = max(float(np.abs(a[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in ref)
    figs["router_vs_dense"] = max(rel_err(p.detach(), ref_router[l].detach()) for l, p in enumerate(reb.routers))
    figs["weights_changed"] = max(float(np.abs(a[k] - b0).max()) for k, b0 in (
        ((l, e), torch.cat([weights.w1[l, e].reshape(-1), weights.w2[l, e].reshape(-1)]).double().cpu().numpy())
        for l in range(case.layers) for e in range(case.experts)))
    return figs


@contextlib.contextmanager
def count_transfers():
    """Counts batched point-to-point exchanges started while inside (``[calls, tensors]``)."""
    seen = [0, 0]
    orig = dist.batch_isend_irecv

    def counting(ops):
        seen[0] += 1
        seen[1] += len(ops)
        return orig(ops)

    dist.batch_isend_irecv = counting
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = orig


def _snapshot(model: EPModel) -> List[bytes]:
    return [pack_slot(expert_state(mod, model.opt), s).cpu().numpy().tobytes()
            for mod in model.layers for s in range(mod.slots_per_rank)] + [mod.phy2log.tobytes() for mod in model.layers]


def _trained_model(case: Case, device: Any) -> Tuple[EPModel, Plan, rp.Window]:
    """A rebalanced model after window 0 (migrated, one Adam step, so state exists) and the plan
    of window 1 that migrates from it."""
    topo = case.topology()
    model = EPModel(case, Weights(case, device), device, make_groups(topo))
    plan0, _, window0, routed, cu = make_plans(case, 0, Placement.static(case.layers, case.experts, topo))
    model.runner.begin_window(plan0, window0, model.opt)
    for mb in rank_microbatches(plan0, routed, dist.get_rank(), cu):
        model.runner.start_micro(mb.micro)
        x, r = _inputs(case, 0, dist.get_rank(), mb.micro, mb.routed.shape[0], device)
        (model(x, mb.routed.to(device)) * r).sum().backward()
    model.runner.finish_step()
    for p in model.routers:
        dist.all_reduce(p.grad)
    model.opt.step()
    model.opt.zero_grad(set_to_none=True)
    plan1, _, window1, _, _ = make_plans(case, 1, plan0.placement)
    return model, plan1, window1


def check_faults(rank: int, world: int, device: Any, case: Case = Case()) -> Dict[str, Any]:
    """Bad plans, injected faults at every protocol point, then a clean migration and a plan
    broadcast. Returns, per scenario, the exception type raised here, whether this rank's
    weights/optimizer state/placement are byte-identical to before, and transfers started."""
    model, plan1, window1 = _trained_model(case, device)
    topo = case.topology()
    figs: Dict[str, Any] = {"bad_plans": {}, "faults": {}}
    snap = _snapshot(model)

    def attempt(plan: Plan, window: rp.Window, fault: Any = None, extra: Any = None) -> Dict[str, Any]:
        t0 = time.perf_counter()
        with count_transfers() as seen:
            try:
                model.runner.begin_window(plan, window, model.opt, fault=fault, extra_state=extra)
                raised = None
            except Exception as e:  # noqa: BLE001 (the figure is the type)
                raised = type(e).__name__
        return {"raised": raised, "intact": _snapshot(model) == snap, "transfers": seen[1],
                "seconds": time.perf_counter() - t0}

    # bad plans: each must be refused on every rank before any transfer
    # same slot count, another split over ranks (or one slot more per rank when ep is odd)
    other = (replace(case, ep=case.ep // 2, slots_per_rank=case.slots_per_rank * 2,
                     gpus_per_node=min(case.gpus_per_node, case.ep // 2))
             if case.ep % 2 == 0 else replace(case, slots_per_rank=case.slots_per_rank + 1))
    figs["bad_plans"]["other_topology"] = attempt(*make_plans(other, 1, Placement.static(
        case.layers, case.experts, other.topology()))[0:3:2])
    missing = Plan(Placement(plan1.placement.phy2log.copy(), case.experts, case.slots_per_rank),
                   plan1.sample_rank, plan1.sample_micro, plan1.num_micro, plan1.replicas.copy(), plan1.migration.copy())
    only = [s for s in range(topo.num_slots) if (missing.placement.phy2log[0] == missing.placement.phy2log[0, s]).sum() == 1]
    missing.placement.phy2log[0, only[0]] = -1
    figs["bad_plans"]["missing_slot"] = attempt(missing, window1)
    rows = plan1.replicas
    if rows.size == 0:  # ep = 1 plans have no replicas; give the bad share a row to live in
        e = int(plan1.placement.phy2log[0, 0])
        rows = np.array([(0, 0, 0, e, 0, 1 % case.ep, 0.5)], dtype=REPLICA_DTYPE)
    for name, share in (("share_above_one", 1.5), ("share_negative", -0.25)):
        bad = Plan(plan1.placement, plan1.sample_rank, plan1.sample_micro, plan1.num_micro, rows.copy(),
                   plan1.migration)
        bad.replicas["share"][0] = share
        figs["bad_plans"][name] = attempt(bad, window1)
    stale = Plan(plan1.placement, plan1.sample_rank, plan1.sample_micro, plan1.num_micro, plan1.replicas,
                 migration_rows(Placement.static(case.layers, case.experts, topo), plan1.placement))
    figs["bad_plans"]["migration_from_other_placement"] = attempt(stale, window1)
    if world > 1:  # a lone rank has nobody to disagree with
        diverged = make_plans(replace(case, seed=case.seed + 7), 1, Placement.static(case.layers, case.experts, topo))
        mine = (Plan(plan1.placement, diverged[0].sample_rank, diverged[0].sample_micro, plan1.num_micro,
                     np.zeros(0, REPLICA_DTYPE), plan1.migration), diverged[2]) if rank == 0 else (plan1, window1)
        figs["bad_plans"]["different_plan_on_rank0"] = attempt(*mine)

    # a fault on one rank at each point of the protocol
    # the commit fault fires after the failing rank has written its first slot: pick the rank
    # that receives most rows, so a real rollback happens there
    dst_rows = np.bincount(plan1.migration["dst_rank"], minlength=case.ep)
    commit_rank = int(np.argmax(dst_rows))
    figs["commit_fault_rank_rows"] = int(dst_rows[commit_rank])
    for point, bad_rank in (("checked", 0), ("packed", 1 % world), ("staged", 2 % world), ("verified", 3 % world),
                            ("commit", commit_rank)):
        def fault(p: str, point: str = point, bad_rank: int = bad_rank) -> None:
            if p == point and rank == bad_rank:
                raise RuntimeError(f"injected fault at {p}")
        figs["faults"][point] = attempt(plan1, window1, fault)

    # then the same migration succeeds, moving bytes unchanged
    # ... with an extra per-slot tensor (as fp32 master weights would be) holding its expert's id
    tags = [torch.tensor(mod.local_experts(), dtype=torch.float32, device=device)[:, None].repeat(1, 3)
            for mod in model.layers]
    before = fingerprints(model.layers, model.opt)
    ok = attempt(plan1, window1, extra={l: [t] for l, t in enumerate(tags)})
    after = fingerprints(model.layers, model.opt)
    ok["extra_state_moved"] = all(
        bool((tags[l][s] == e).all()) for l, mod in enumerate(model.layers)
        for s, e in enumerate(mod.local_experts().tolist()) if e >= 0)
    ok["bit_identical"] = set(before) == set(after) and all(after[k] == before[k] and len(before[k]) == 1 for k in before)
    ok["placement_is_plan"] = all(np.array_equal(mod.phy2log, plan1.placement.phy2log[l])
                                  for l, mod in enumerate(model.layers))
    ok["moved_rows"] = int(plan1.migration.size)
    figs["clean"] = ok

    got = broadcast_plan(plan1 if rank == 0 else None, 0)
    figs["broadcast_same"] = bool(got.same_as(plan1) and plan_digest(got) == plan_digest(plan1))
    return figs


def check_peer_death(rank: int, world: int, device: Any, case: Case = Case(), dead: int = -1) -> Dict[str, Any]:
    """Rank ``dead`` exits (``os._exit``) after staging its transfers; the survivors must raise
    `MigrationError` within the timeout with their state intact."""
    model, plan1, window1 = _trained_model(case, device)
    model.runner.timeout = datetime.timedelta(seconds=10)
    snap = _snapshot(model)
    dead = dead % world

    def fault(p: str) -> None:
        if p == "staged" and rank == dead:
            os._exit(3)

    t0 = time.perf_counter()
    try:
        model.runner.begin_window(plan1, window1, model.opt, fault=fault)
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__
    return {"raised": raised, "intact": _snapshot(model) == snap, "seconds": time.perf_counter() - t0}


# -------------------------------------------------------------------- spawn
def _entry(fn: Callable, rank: int, world: int, backend: str, store: str, pg_timeout_s: float,
           results: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        if backend in ("nccl", "nccl_shared"):
            # "nccl_shared": every rank on GPU 0 (NCCL normally refuses; tools/gpu_check.py tries)
            torch.cuda.set_device(0 if backend == "nccl_shared" else rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
            backend = "nccl"
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        results.put((rank, "ok", fn(rank, world, device, *args)))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int = 4, *args: Any, backend: str = "gloo", join_timeout_s: float = 300,
              pg_timeout_s: float = 60, may_die: Sequence[int] = ()) -> Dict[int, Any]:
    """Runs ``fn(rank, world, device, *args)`` in ``world`` spawned processes (``spawn`` start
    method, file store). Returns rank → result; raises with the tracebacks if a rank failed or
    did not report within ``join_timeout_s`` (stragglers are killed, so nothing hangs).
    Ranks in ``may_die`` may exit without reporting."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="routepack-"), "store")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, backend, store, pg_timeout_s, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: Dict[int, Any] = {}
    errors: List[str] = []
    deadline = time.monotonic() + join_timeout_s
    want = world - len(may_die)
    while len(out) + len(errors) < world:
        try:
            r, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                break
            if len(out) + len(errors) >= want and all(not procs[r].is_alive() for r in may_die):
                break
            continue
        if status == "ok":
            out[r] = value
        else:
            errors.append(f"rank {r}:\n{value}")
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stuck:
        procs[r].kill()
    missing = [r for r in range(world) if r not in out and r not in may_die]
    if errors or missing:
        raise RuntimeError(f"ranks {missing} did not finish (stuck: {stuck})\n" + "\n".join(errors))
    return out
