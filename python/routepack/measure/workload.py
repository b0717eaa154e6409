"""The measured run's workload: a small MoE model's windows with recorded routing, its
topology, and the plans compared on them (every rank builds them identically from the seed).

The routing is topic-like, as RL rollouts are: each sample leans on a few experts of each
layer (its "topic"), on top of a skewed per-layer popularity, so the placement (which experts
are hot) and the packing (which samples share a rank and step) both have something to
balance, as in the profiles `routepack bench` plans. From one window to the next the
popularity drifts (half of it drawn anew), so the hot experts move and a plan that follows
them migrates experts, as training does between rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from routepack._checks import finite_float, positive_int
from routepack.errors import RoutepackError
from routepack.model import CostModel, ModelShape, Topology
from routepack.plan import Placement, Plan
from routepack.planner import plan_window
from routepack.window import Window


@dataclass(frozen=True)
class Workload:
    """Sizes of the measured run: a window of ``samples`` samples of ``min_len..max_len``
    tokens, ``layers`` MoE layers of ``experts`` experts (top ``top_k``, hidden ``hidden``,
    expert FFN ``ffn``) on ``ranks`` EP ranks (one EP group, one node) with ``slots_per_rank``
    slots each, ``micro`` microbatches per rank (the token cap follows), seeded by ``seed``;
    ``popularity`` is the Dirichlet concentration of each layer's expert popularity; ``windows``
    windows in sequence (their popularity drifting); the ``ranks`` split into ``nodes`` nodes of
    ``ranks / nodes`` (the planners' topology: local processes share one machine, so the
    measured run's cost model gives the links between "nodes" the intra-node bandwidth)."""

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
    windows: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if name != "popularity":
                positive_int(getattr(self, name), f"workload.{name}", minimum=0 if name == "seed" else 1)
        finite_float(self.popularity, "workload.popularity", strict=True)
        if self.ranks % self.nodes:
            raise RoutepackError(f"workload.nodes: {self.nodes} does not divide ranks {self.ranks}")
        self.topology().check_experts(self.experts)
        if self.top_k > self.experts:
            raise RoutepackError(f"workload.top_k: {self.top_k} > experts {self.experts}")
        if self.min_len > self.max_len:
            raise RoutepackError(f"workload.min_len: {self.min_len} > max_len {self.max_len}")

    def topology(self) -> Topology:
        return Topology(self.ranks, self.ranks, self.ranks // self.nodes, self.slots_per_rank)

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

    def window(self, w: int = 0) -> Tuple[Window, np.ndarray, np.ndarray]:
        """Window ``w`` (0 to ``windows - 1``): (Window, routed int32 ``[T, L, k]`` distinct ids
        per token, cu_seqlens int64 ``[S+1]``)."""
        w = positive_int(w, "w", minimum=0)
        base = np.random.default_rng([self.seed, 11])
        pops = [base.dirichlet(np.full(self.experts, self.popularity)) for _ in range(self.layers)]
        rng = np.random.default_rng([self.seed, 12, w])
        lens = rng.integers(self.min_len, self.max_len + 1, size=self.samples)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        routed = np.zeros((int(cu[-1]), self.layers, self.top_k), dtype=np.int32)
        for l in range(self.layers):
            pop = pops[l]
            if w:  # the popularity drifts: half of it drawn anew for each later window
                pop = 0.5 * pop + 0.5 * rng.dirichlet(np.full(self.experts, self.popularity))
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
    """policy → its plan of ``window`` under ``cost``, from Megatron's static placement (every
    plan validated)."""
    return {name: plans[0] for name, plans in plan_windows(work, [window], cost, policies).items()}


def history(work: Workload) -> Window:
    """The window before the run's first (window ``work.windows``, drawn as the others and not
    run): what the history-based policies (EPLB) plan the first window's placement from."""
    return work.window(work.windows)[0]


def plan_windows(
    work: Workload,
    windows: Sequence[Window],
    cost: CostModel,
    policies: Tuple[str, ...],
    before: Optional[Window] = None,
) -> Dict[str, List[Plan]]:
    """policy → its plans of ``windows`` in sequence under ``cost``: the first from Megatron's
    static placement, each later one from the placement its policy left in force (so it
    migrates what moves), with the window before it for the history-based policies (EPLB;
    ``before``, default `history`, for the first); every plan validated."""
    topo = work.topology()
    first = history(work) if before is None else before
    out: Dict[str, List[Plan]] = {}
    for name in policies:
        previous, last, plans = Placement.static(work.layers, work.experts, topo), first, []
        for window in windows:
            cap = work.token_cap(window)
            plan = plan_window(
                window,
                topo,
                cost,
                token_cap=cap,
                policy=name,
                seed=work.seed,
                previous=previous,
                previous_window=last,
            )
            plan.validate(window, topo, cap)
            plans.append(plan)
            previous, last = plan.placement, window
        out[name] = plans
    return out
