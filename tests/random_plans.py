"""Random small windows, topologies, cost models and plans for the tests.

Plans built here are well-formed (every sample once, no empty cell, replicas that
`Plan.validate` accepts, migration rows from `_core.migration_diff`) but otherwise arbitrary:
random placements with redundant copies (two copies of one expert on one rank included),
random layouts, random replicas and shares. Everything is drawn from a
`numpy.random.Generator`, so a seed reproduces a case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

import routepack as rp
from routepack import _core
from routepack.plan import MIGRATION_DTYPE, REPLICA_DTYPE

#: (dp, ep, gpus_per_node, slots_per_rank): one EP group inside one node, groups spanning
#: 2 or 4 nodes, several groups per node (ep < gpus_per_node), one GPU per node (every link
#: inter-node), ep = 1.
TOPOLOGIES = [
    (4, 2, 2, 3),
    (8, 4, 2, 2),
    (4, 4, 8, 2),
    (8, 8, 4, 2),
    (6, 2, 1, 3),
    (3, 1, 1, 4),
    (16, 8, 2, 2),
    (16, 4, 8, 3),
]


def local_node(rank: int, topo: rp.Topology) -> int:
    """Node index of EP-local rank `rank` inside its group (groups start on node boundaries)."""
    return rank // min(topo.gpus_per_node, topo.ep)


def random_window(
    rng: np.random.Generator, num_samples: int, num_layers: int, num_experts: int, max_len: int = 40
) -> rp.Window:
    """seq_lens int64 [S] in [1, max_len]; expert_tokens int32 [S, L, E] in [0, n_s] with
    about a third of the entries zero (so some experts have no tokens in a cell)."""
    seq_lens = rng.integers(1, max_len + 1, size=num_samples)
    counts = rng.integers(0, seq_lens[:, None, None] + 1, size=(num_samples, num_layers, num_experts))
    counts[rng.random(counts.shape) < 0.35] = 0
    return rp.Window(seq_lens, counts.astype(np.int32))


def random_phy2log(
    rng: np.random.Generator, num_layers: int, num_experts: int, topo: rp.Topology, same_rank_pair: bool = False
) -> np.ndarray:
    """int32 [L, ep*slots]: every expert at least once, surplus slots either empty (-1) or a
    redundant copy of a random expert. With `same_rank_pair`, each layer puts two copies of
    one expert on one rank (needs slots_per_rank >= 2)."""
    n_slots = topo.num_slots
    spr = topo.slots_per_rank
    out = np.empty((num_layers, n_slots), dtype=np.int32)
    for l in range(num_layers):
        extra = n_slots - num_experts
        fill = np.where(rng.random(extra) < 0.6, rng.integers(0, num_experts, size=extra), -1)
        entries = np.concatenate([np.arange(num_experts), fill]).astype(np.int32)
        if same_rank_pair and spr >= 2 and extra >= 1:
            # two copies of expert e in slots a, a+1 of one rank; the rest placed at random
            e = int(rng.integers(num_experts))
            entries[num_experts] = e  # the duplicate replaces one surplus entry
            a = int(rng.integers(topo.ep)) * spr + int(rng.integers(spr - 1))
            rest = np.delete(entries, [e, num_experts])
            free = np.array([p for p in range(n_slots) if p not in (a, a + 1)], dtype=np.int64)
            layer = np.empty(n_slots, dtype=np.int32)
            layer[[a, a + 1]] = e
            layer[free] = rng.permutation(rest)
        else:
            layer = rng.permutation(entries)
        out[l] = layer
    return out


def random_layout(rng: np.random.Generator, num_samples: int, dp: int, num_micro: int):
    """(sample_rank, sample_micro) int32 [S] with every (rank, micro) cell non-empty.
    Needs num_samples >= dp * num_micro."""
    cells = dp * num_micro
    assert num_samples >= cells
    cell = np.concatenate([np.arange(cells), rng.integers(0, cells, size=num_samples - cells)])
    cell = rng.permutation(cell)
    return (cell // num_micro).astype(np.int32), (cell % num_micro).astype(np.int32)


def random_shares(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [n] in [0, 1] summing to at most 1 (sometimes exactly 1, or 0.5 / 0.25 / 0 rows
    that exercise round-half-away-from-zero and empty takes)."""
    kind = rng.integers(4)
    if kind == 0:
        shares = rng.choice(np.array([0.0, 0.25, 0.5]), size=n)
        if shares.sum() > 1:
            shares = np.full(n, 1.0 / n)
    elif kind == 1:
        shares = rng.dirichlet(np.ones(n + 1))[:n]
    elif kind == 2:
        shares = rng.dirichlet(np.ones(n))  # the replicas take everything
    else:
        shares = rng.dirichlet(np.ones(n)) * rng.uniform(0, 1)
    return shares.astype(np.float32)


def random_replicas(
    rng: np.random.Generator,
    phy2log: np.ndarray,
    topo: rp.Topology,
    num_micro: int,
    num_experts: int,
    rows_per_cell: float = 2.0,
) -> np.ndarray:
    """REPLICA_DTYPE rows: for random (micro, group, layer) cells, random experts copied from a
    rank that hosts them to 1..3 other ranks (sometimes the same dst twice, sometimes two
    sources of one expert), with shares of `random_shares`; a copy that would give a rank more
    than ``topo.replica_slots`` experts in the cell is left out. Rows are shuffled so table
    order is not sorted."""
    if topo.ep < 2:
        return np.zeros(0, dtype=REPLICA_DTYPE)
    spr = topo.slots_per_rank
    rows: List[tuple] = []
    for m in range(num_micro):
        for g in range(topo.num_groups):
            for l in range(phy2log.shape[0]):
                held: dict = {}  # rank -> the experts it holds copies of in this cell
                n_exp = min(num_experts, int(rng.poisson(rows_per_cell)))
                for e in rng.choice(num_experts, size=n_exp, replace=False):
                    e = int(e)
                    hosts = sorted({p // spr for p in np.flatnonzero(phy2log[l] == e)})
                    n_src = 1 + int(len(hosts) > 1 and rng.random() < 0.3)
                    srcs = rng.choice(hosts, size=n_src, replace=False)
                    picks = []
                    for src in srcs:
                        others = [r for r in range(topo.ep) if r != src]
                        for _ in range(1 + int(rng.integers(3))):
                            picks.append((int(src), int(rng.choice(others))))
                    for src, dst in list(picks):
                        mine = held.setdefault(dst, set())
                        if e not in mine and len(mine) >= topo.replica_slots:
                            picks.remove((src, dst))
                        else:
                            mine.add(e)
                    if not picks:
                        continue
                    shares = random_shares(rng, len(picks))
                    rows += [(m, g, l, e, s, d, float(sh)) for (s, d), sh in zip(picks, shares)]
    table = np.array(rows, dtype=REPLICA_DTYPE) if rows else np.zeros(0, dtype=REPLICA_DTYPE)
    return table[rng.permutation(len(table))]


def migration_rows(
    previous: np.ndarray, nxt: np.ndarray, num_experts: int, slots_per_rank: int, bytes_per_expert: float
) -> np.ndarray:
    """MIGRATION_DTYPE rows of `_core.migration_diff(previous → nxt)`."""
    cols = _core.migration_diff(previous, nxt, num_experts, slots_per_rank, float(bytes_per_expert))
    table = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
    for name, col in zip(MIGRATION_DTYPE.names, cols):
        table[name] = col
    return table


def random_cost(rng: np.random.Generator, num_layers: int) -> rp.CostModel:
    """Coefficients spread over orders of magnitude so that replication is sometimes hidden
    behind attention and sometimes exposed, and either link can be the bottleneck."""
    lu = lambda lo, hi: float(10 ** rng.uniform(lo, hi))  # noqa: E731
    return rp.CostModel(
        a_lin=lu(-8, -5),
        a_quad=[0.0 if rng.random() < 0.4 else lu(-10, -7) for _ in range(num_layers)],
        c_tok=lu(-8, -5),
        c_exp=lu(-7, -4),
        token_bytes=lu(2, 4),
        bw_intra=lu(9, 11),
        bw_inter=lu(8, 10),
        expert_weight_bytes=lu(4, 7),
        expert_grad_bytes=lu(4, 7),
        expert_state_bytes=lu(5, 8),
    )


@dataclass
class Case:
    """One randomized simulator input."""

    window: rp.Window
    topo: rp.Topology
    cost: rp.CostModel
    plan: rp.Plan
    token_cap: Optional[int]
    previous: Optional[np.ndarray]


def random_case(seed: int, topology: Optional[tuple] = None, replica_slots: Optional[int] = None) -> Case:
    """A random (window, topology, cost, plan) with replicas and, half of the time, migration
    (``replica_slots``: the topology's replica buffers; None: its default)."""
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr = topology or TOPOLOGIES[int(rng.integers(len(TOPOLOGIES)))]
    topo = rp.Topology(dp, ep, gpn, spr) if replica_slots is None else rp.Topology(dp, ep, gpn, spr, replica_slots)
    num_layers = int(rng.integers(1, 4))
    num_experts = int(rng.integers(max(1, topo.num_slots // 2), topo.num_slots + 1))
    num_micro = int(rng.integers(1, 4))
    num_samples = dp * num_micro + int(rng.integers(0, 2 * dp + 1))
    window = random_window(rng, num_samples, num_layers, num_experts)
    phy2log = random_phy2log(rng, num_layers, num_experts, topo, same_rank_pair=rng.random() < 0.5)
    rank, micro = random_layout(rng, num_samples, dp, num_micro)
    replicas = random_replicas(rng, phy2log, topo, num_micro, num_experts)
    cost = random_cost(rng, num_layers)
    previous = None
    migration = np.zeros(0, dtype=MIGRATION_DTYPE)
    if rng.random() < 0.6:
        if rng.random() < 0.5:
            previous = random_phy2log(rng, num_layers, num_experts, topo)
        else:  # a few slots swapped: some moves stay on their rank (0 bytes), some cross
            previous = phy2log.copy()
            for l in range(num_layers):
                for _ in range(int(rng.integers(1, 4))):
                    a, b = rng.integers(topo.num_slots, size=2)
                    previous[l, a], previous[l, b] = previous[l, b], previous[l, a]
        migration = migration_rows(previous, phy2log, num_experts, spr, cost.expert_state_bytes)
    placement = rp.Placement(phy2log, num_experts, spr)
    plan = rp.Plan(placement, rank, micro, num_micro, replicas, migration)
    token_cap = int(rng.integers(40, 200)) if rng.random() < 0.5 else None
    return Case(window, topo, cost, plan, token_cap, previous)


def assert_plan_invariants(plan: rp.Plan, window: rp.Window, topo: rp.Topology, token_cap: int) -> None:
    """docs/design.md's invariants checked in numpy, independently of `Plan.validate`: every sample
    exactly once on a valid (rank, micro) cell, no cell empty or over the cap, the same
    microbatch count on every rank, every logical expert with a slot in every layer, replica
    shares in [0, 1] summing to at most 1 per (micro, group, layer, expert)."""
    S, L, E = window.expert_tokens.shape
    M = plan.num_micro
    assert plan.sample_rank.shape == plan.sample_micro.shape == (S,)
    assert ((0 <= plan.sample_rank) & (plan.sample_rank < topo.dp)).all()
    assert ((0 <= plan.sample_micro) & (plan.sample_micro < M)).all()
    cell = plan.sample_rank.astype(np.int64) * M + plan.sample_micro
    count = np.bincount(cell, minlength=topo.dp * M)
    tokens = np.bincount(cell, weights=window.seq_lens.astype(np.float64), minlength=topo.dp * M)
    assert count.shape == (topo.dp * M,) and (count > 0).all(), "empty cell"
    assert tokens.max() <= token_cap, "cell over the cap"
    p2l = plan.placement.phy2log
    assert p2l.shape == (L, topo.num_slots)
    assert ((p2l >= -1) & (p2l < E)).all()
    for l in range(L):
        assert set(range(E)) <= set(p2l[l].tolist()), f"layer {l} misses an expert"
    reps = plan.replicas
    if len(reps):
        assert ((reps["share"] >= 0) & (reps["share"] <= 1)).all()
        key = np.stack([reps["micro"], reps["group"], reps["layer"], reps["expert"]], axis=1)
        _, inv = np.unique(key, axis=0, return_inverse=True)
        assert (np.bincount(inv.ravel(), weights=reps["share"].astype(np.float64)) <= 1 + 1e-5).all()
