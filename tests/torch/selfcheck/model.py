"""The self-checks' test model: its weights, forward pass and EP share (`EPModel`, a
`PlanRunner` over `EPMoE` layers), the process groups, and the figures compared across ranks
(relative errors, slot fingerprints, logical weights, per-microbatch inputs)."""

from __future__ import annotations

import datetime
import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import routepack as rp
from routepack.plan import Placement
from routepack.torch.migrate import expert_state, pack_slot
from routepack.torch.moe import EPMoE
from routepack.torch.runner import PlanRunner
from selfcheck.case import Case


class Weights:
    """Logical parameters: ``w1`` ``[L, E, H, 2I]``, ``w2`` ``[L, E, I, H]``, ``router``
    ``[L, H, E]`` (drawn on the CPU from the seed, identical on every rank)."""

    def __init__(self, case: Case, device: Any) -> None:
        g = torch.Generator().manual_seed(case.seed)
        L, E, H, I = case.layers, case.experts, case.hidden, case.ffn
        self.w1 = (torch.randn(L, E, H, 2 * I, generator=g) / H**0.5).to(device)
        self.w2 = (torch.randn(L, E, I, H, generator=g) / I**0.5).to(device)
        self.router = (torch.randn(L, H, E, generator=g) / H**0.5).to(device)


def forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    routers: Sequence[torch.Tensor],
    moe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
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
        self.layers = [
            EPMoE(l, case.experts, case.hidden, case.ffn, topo, static.phy2log[l], group, device=device)
            for l in range(case.layers)
        ]
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


def inputs(case: Case, w: int, rank: int, m: int, tokens: int, device: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, cotangent) of rank ``rank``'s microbatch ``m`` in window ``w``: ``[T, H]`` each."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([case.seed, 5, w, rank, m]).generate_state(1)[0]))
    return (
        torch.randn(tokens, case.hidden, generator=g).to(device),
        torch.randn(tokens, case.hidden, generator=g).to(device),
    )
