"""The self-checks' data: `Case` (the sizes) and, from its seed, the windows, layouts,
placements, replicas, migrations and plans every rank builds identically."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

import routepack as rp
from routepack import _core
from routepack.plan import MIGRATION_DTYPE, REPLICA_DTYPE, Placement, Plan


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


def cell_origin(
    case: Case, window: rp.Window, rank: np.ndarray, micro: np.ndarray, g: int, m: int, l: int
) -> np.ndarray:
    """int64 ``[ep, E]``: tokens of each expert from each EP rank of group g at (m, l)."""
    out = np.zeros((case.ep, case.experts), dtype=np.int64)
    for r in range(case.ep):
        sel = (rank == g * case.ep + r) & (micro == m)
        out[r] = window.counts[sel, l].sum(axis=0, dtype=np.int64)
    return out


def make_replicas(
    case: Case, window: rp.Window, placement: Placement, rank: np.ndarray, micro: np.ndarray, w: int
) -> np.ndarray:
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
    plan = Plan(
        placement,
        rank,
        micro,
        case.micro,
        make_replicas(case, window, placement, rank, micro, w),
        migration_rows(previous, placement),
        policy="selfcheck",
    )
    static = Plan(Placement.static(case.layers, case.experts, topo), rank, micro, case.micro, policy="static")
    cap = 1 << 20
    return plan.validate(window, topo, cap), static.validate(window, topo, cap), window, routed, cu
