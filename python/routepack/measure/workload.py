"""The measured run's workload: a small MoE model's window with recorded routing, its
topology, and the plans compared on it (every rank builds them identically from the seed).

The routing is topic-like, as RL rollouts are: each sample leans on a few experts of each
layer (its "topic"), on top of a skewed per-layer popularity, so the placement (which experts
are hot) and the packing (which samples share a rank and step) both have something to
balance, as in the profiles `routepack bench` plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from routepack._checks import finite_float, positive_int
from routepack.errors import RoutepackError
from routepack.model import CostModel, ModelShape, Topology
from routepack.plan import Plan
from routepack.planner import plan_window
from routepack.window import Window


@dataclass(frozen=True)
class Workload:
    """Sizes of the measured run: a window of ``samples`` samples of ``min_len..max_len``
    tokens, ``layers`` MoE layers of ``experts`` experts (top ``top_k``, hidden ``hidden``,
    expert FFN ``ffn``) on ``ranks`` EP ranks (one EP group, one node) with ``slots_per_rank``
    slots each, ``micro`` microbatches per rank (the token cap follows), seeded by ``seed``;
    ``popularity`` is the Dirichlet concentration of each layer's expert popularity."""

    ranks: int = 2
    layers: int = 2
    experts: int = 16
    top_k: int = 2
    hidden: int = 256
    ffn: int = 256
    slots_per_rank: int = 10
    samples: int = 48
    min_len: int = 16
    max_len: int = 192
    micro: int = 3
    seed: int = 0
    popularity: float = 0.3  # Dirichlet concentration of each layer's expert popularity (lower: more skewed)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if name != "popularity":
                positive_int(getattr(self, name), f"workload.{name}", minimum=0 if name == "seed" else 1)
        finite_float(self.popularity, "workload.popularity", strict=True)
        self.topology().check_experts(self.experts)
        if self.top_k > self.experts:
            raise RoutepackError(f"workload.top_k: {self.top_k} > experts {self.experts}")
        if self.min_len > self.max_len:
            raise RoutepackError(f"workload.min_len: {self.min_len} > max_len {self.max_len}")

    def topology(self) -> Topology:
        return Topology(self.ranks, self.ranks, self.ranks, self.slots_per_rank)

    def model(self) -> ModelShape:
        return ModelShape(
            self.layers,
            self.experts,
            self.top_k,
            self.hidden,
            self.ffn,
            attention=("linear",) * self.layers,
            shared_experts=0,
        )

    def window(self) -> Tuple[Window, np.ndarray, np.ndarray]:
        """(Window, routed int32 ``[T, L, k]`` distinct ids per token, cu_seqlens int64 ``[S+1]``)."""
        rng = np.random.default_rng([self.seed, 11])
        lens = rng.integers(self.min_len, self.max_len + 1, size=self.samples)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        routed = np.zeros((int(cu[-1]), self.layers, self.top_k), dtype=np.int32)
        for l in range(self.layers):
            pop = rng.dirichlet(np.full(self.experts, self.popularity))
            for s in range(self.samples):
                topic = rng.choice(self.experts, size=min(self.experts, 2 * self.top_k), replace=False)
                p = 0.4 * pop
                p[topic] += 0.6 / topic.size
                p /= p.sum()
                for t in range(int(cu[s]), int(cu[s + 1])):
                    routed[t, l] = rng.choice(self.experts, size=self.top_k, replace=False, p=p)
        return Window.from_routed_experts(routed, cu, self.experts), routed, cu

    def token_cap(self, window: Window) -> int:
        """The cap that gives about ``micro`` microbatches per rank (never below the longest
        sample)."""
        per_row = -(-window.total_tokens // (self.ranks * self.micro))
        return int(max(per_row * 1.1, window.seq_lens.max()))


def make_plans(work: Workload, window: Window, cost: CostModel, policies: Tuple[str, ...]) -> Dict[str, Plan]:
    """policy → its plan of the window under ``cost`` (every plan validated)."""
    topo, cap = work.topology(), work.token_cap(window)
    out = {}
    for name in policies:
        plan = plan_window(window, topo, cost, token_cap=cap, policy=name, seed=work.seed)
        plan.validate(window, topo, cap)
        out[name] = plan
    return out
