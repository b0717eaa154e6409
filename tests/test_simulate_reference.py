"""`routepack.simulate` against an independent pure-numpy implementation of docs/design.md's cost
model, written from the documented rules (crates/routepack-core/src/simulate.rs and flow/
module docs), not by calling Rust:

* cells: the samples of DP rank d at step m; EP group g = ranks g·ep .. g·ep+ep-1;
* attention of a rank: Σ a_lin·n_s + a_quad_l·n_s² (one pass; ×3 in the layer time);
* token flow of expert e from EP-local origin r: replicas in table order take
  round(share·T) (half away from zero, at most what is left), drawn from the dst rank's own
  tokens, then its node's ranks ascending, then the others ascending; the rest goes to e's
  placement slots (ascending) node first: slot j's quota is Σ_r rem_r // c plus one per origin
  with (j − r) mod c < rem_r mod c; a node with more tokens than its slots' quotas sends the
  surplus, shared by its ranks in proportion to their tokens, a node with less receives the
  deficit, shared by its slots in proportion to their quotas, each such slot drawing it from
  every sender in proportion to what it has still to send; then each slot takes from its own
  rank, then from its node's ranks in proportion to what each has left (every share: floors,
  then one more to the first with a fraction);
* expert work of rank p: c_tok·tokens(p) + c_exp·(distinct logical experts with tokens on p)
  + c_call when p computes any token (one kernel call);
* all-to-all: per rank, per link, max(sent, received) routed tokens × token_bytes over that
  link's bandwidth; slowest rank; plus a2a_latency; ×2 (dispatch, combine) ×2 (passes);
* replication: per (expert, src) a chain src → dsts (same node first, then rank) of weights
  (forward) and fp32 gradients back (backward); per rank max(sent, received) per link; the
  part over 1× (forward) / 2× (backward) the layer's attention is exposed;
* intra-/cross-node bytes: Σ over every exchange of the routed tokens sent to another rank of
  the same / another node × token_bytes × 2 (dispatch, combine) × 2 (passes); per token: over Σ n_s;
* step time = max_g Σ_m Σ_l T + migration (per rank max(sent, received) bytes per link);
* ideal at the lower-bound microbatch count: every max a mean, uniform all-to-all.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, List, Tuple

import numpy as np
import pytest

import routepack as rp
from random_plans import TOPOLOGIES, local_node, random_case

COMPUTE_PASSES = 3.0
COMM_PASSES = 2.0


def round_half_away(x: float) -> int:
    """Rounds x >= 0 to the nearest integer, halves away from zero (numpy's round is
    half-to-even, which the rule does not use)."""
    f = math.floor(x)
    return int(f) + (1 if x - f >= 0.5 else 0)


def link_time(send_intra, recv_intra, send_inter, recv_inter, cost) -> float:
    """Slowest rank: per link max(sent, received) over the link's bandwidth, links added."""
    per_rank = np.maximum(send_intra, recv_intra) / cost.bw_intra + np.maximum(send_inter, recv_inter) / cost.bw_inter
    return float(max(0.0, per_rank.max()))


def replica_time(hops: List[Tuple[int, int, float]], topo, cost) -> float:
    """The slowest rank's replication time of ``hops`` (from, to, bytes): its link time plus
    ``c_replica`` per byte it sends or receives."""
    si, ri, se, re_ = link_bytes(hops, topo)
    per_rank = np.maximum(si, ri) / cost.bw_intra + np.maximum(se, re_) / cost.bw_inter
    if cost.c_replica > 0:
        per_rank = per_rank + cost.c_replica * (si + ri + se + re_)
    return float(max(0.0, per_rank.max()))


def link_bytes(pairs: List[Tuple[int, int, float]], topo) -> Tuple[np.ndarray, ...]:
    """(send_intra, recv_intra, send_inter, recv_inter) [ep] from (src, dst, bytes) transfers."""
    out = [np.zeros(topo.ep) for _ in range(4)]
    for s, d, b in pairs:
        if s == d:
            continue
        k = 0 if local_node(s, topo) == local_node(d, topo) else 2
        out[k][s] += b
        out[k + 1][d] += b
    return tuple(out)


def route(origin: np.ndarray, slots: List[int], reps: List[Tuple[int, float]], topo) -> np.ndarray:
    """flow[o, p]: tokens of one expert from EP-local origin o computed on EP rank p."""
    ep, spr = topo.ep, topo.slots_per_rank
    flow = np.zeros((ep, ep), dtype=np.int64)
    rem = origin.astype(np.int64).copy()
    total = int(origin.sum())
    left = total
    for dst, share in reps:
        need = min(max(round_half_away(float(np.float32(share)) * total), 0), left)
        left -= need
        node = local_node(dst, topo)
        order = (
            [dst]
            + [r for r in range(ep) if r != dst and local_node(r, topo) == node]
            + [r for r in range(ep) if local_node(r, topo) != node]
        )
        for r in order:
            take = min(int(rem[r]), need)
            rem[r] -= take
            need -= take
            flow[r, dst] += take
        assert need == 0  # left == Σ rem, so a row always gets what it asks for
    c = len(slots)
    quota = [sum(int(x) // c + (1 if (j - r) % c < int(x) % c else 0) for r, x in enumerate(rem)) for j in range(c)]
    dst = [p // spr for p in slots]
    if c == 1:
        flow[:, dst[0]] += rem
        return flow
    nodes = sorted({local_node(r, topo) for r in range(ep)})
    out = np.zeros(ep, dtype=np.int64)
    inflow = [0] * c
    for n in nodes:
        ranks = [r for r in range(ep) if local_node(r, topo) == n]
        js = [j for j in range(c) if local_node(dst[j], topo) == n]
        supply, demand = sum(int(rem[r]) for r in ranks), sum(quota[j] for j in js)
        if supply > demand:
            for r, k in zip(ranks, shares(supply - demand, [int(rem[r]) for r in ranks])):
                out[r] = k
        elif demand > supply:
            for j, k in zip(js, shares(demand - supply, [quota[j] for j in js])):
                inflow[j] = k
    for j in range(c):
        if inflow[j]:
            for r, k in enumerate(shares(inflow[j], [int(x) for x in out])):
                out[r] -= k
                rem[r] -= k
                flow[r, dst[j]] += k
            quota[j] -= inflow[j]
    assert not out.any()
    for j in range(c):
        k = min(int(rem[dst[j]]), quota[j])
        rem[dst[j]] -= k
        quota[j] -= k
        flow[dst[j], dst[j]] += k
    for j in range(c):
        if quota[j]:
            mates = [r for r in range(ep) if local_node(r, topo) == local_node(dst[j], topo)]
            for r, k in zip(mates, shares(quota[j], [int(rem[r]) for r in mates])):
                rem[r] -= k
                flow[r, dst[j]] += k
            quota[j] = 0
    assert not rem.any()
    return flow


def shares(need: int, weights: List[int]) -> List[int]:
    """need (at most Σ weights) in proportion to weights: floors, then one more to each of the
    first whose share had a fraction until need is met."""
    total = sum(weights)
    assert need <= total
    out = [need * w // total for w in weights]
    over = need - sum(out)
    for i, w in enumerate(weights):
        if over and (need * w) % total:
            out[i] += 1
            over -= 1
    assert over == 0
    return out


def reference(plan: rp.Plan, window: rp.Window, topo: rp.Topology, cost: rp.CostModel, token_cap) -> Dict[str, object]:
    """Every field of SimResult, from the equations."""
    n = window.seq_lens.astype(np.float64)
    x = window.expert_tokens.astype(np.int64)
    S, L, E = x.shape
    ep, G, M = topo.ep, topo.num_groups, plan.num_micro
    phy2log = plan.placement.phy2log
    slots = [[list(np.flatnonzero(phy2log[l] == e)) for e in range(E)] for l in range(L)]

    attention = np.zeros((G, M, L))
    a2a = np.zeros((G, M, L))
    expert = np.zeros((G, M, L))
    replication = np.zeros((G, M, L))
    rep_parts = np.zeros((G, M, L, 2))  # (forward copies, backward reduction) exposed
    imbalance = np.zeros((G, M, L))
    reps = plan.replicas
    node_bytes = {"intra": 0.0, "cross": 0.0}
    for g in range(G):
        for m in range(M):
            members = [np.flatnonzero((plan.sample_rank == g * ep + r) & (plan.sample_micro == m)) for r in range(ep)]
            lin = np.array([n[s].sum() for s in members])
            quad = np.array([(n[s] ** 2).sum() for s in members])
            for l in range(L):
                attn_max = float((cost.a_lin * lin + cost.a_quad[l] * quad).max())
                origin = np.stack([x[s, l, :].sum(axis=0) for s in members])  # [ep, E]
                cell = reps[(reps["group"] == g) & (reps["micro"] == m) & (reps["layer"] == l)]
                tokens = np.zeros(ep, dtype=np.int64)
                active = np.zeros(ep, dtype=np.int64)
                moved = np.zeros((ep, ep), dtype=np.int64)
                for e in range(E):
                    rows = cell[cell["expert"] == e]
                    flow = route(
                        origin[:, e], slots[l][e], [(int(r["dst_rank"]), float(r["share"])) for r in rows], topo
                    )
                    assert flow.sum() == origin[:, e].sum()
                    received = flow.sum(axis=0)
                    tokens += received
                    active += received > 0
                    moved += flow
                x_max = float((cost.c_tok * tokens + cost.c_exp * active + cost.c_call * (tokens > 0)).max())
                total = tokens.sum()
                imbalance[g, m, l] = tokens.max() * ep / total if total > 0 else 1.0
                pairs = [(o, p, moved[o, p] * cost.token_bytes) for o in range(ep) for p in range(ep)]
                for o, p, b in pairs:
                    if o != p:
                        node_bytes["intra" if local_node(o, topo) == local_node(p, topo) else "cross"] += (
                            2 * COMM_PASSES * b
                        )
                a2a[g, m, l] = 2 * COMM_PASSES * (link_time(*link_bytes(pairs, topo), cost) + cost.a2a_latency)
                if len(cell):
                    fwd, bwd = [], []
                    for e, src in sorted({(int(r["expert"]), int(r["src_rank"])) for r in cell}):
                        dsts = {int(r["dst_rank"]) for r in cell if r["expert"] == e and r["src_rank"] == src}
                        node = local_node(src, topo)
                        prev = src
                        for d in sorted(dsts, key=lambda d: (local_node(d, topo) != node, d)):
                            fwd.append((prev, d, cost.expert_weight_bytes))
                            bwd.append((d, prev, cost.expert_grad_bytes))
                            prev = d
                    t_fwd = replica_time(fwd, topo, cost)
                    t_bwd = replica_time(bwd, topo, cost)
                    rep_parts[g, m, l] = max(t_fwd - attn_max, 0.0), max(t_bwd - 2 * attn_max, 0.0)
                    replication[g, m, l] = rep_parts[g, m, l].sum()
                attention[g, m, l] = COMPUTE_PASSES * attn_max
                expert[g, m, l] = COMPUTE_PASSES * x_max
    layer_time = attention + a2a + expert + replication
    group_times = layer_time.reshape(G, -1).sum(axis=1)
    critical = int(np.argmax(group_times))

    mig = plan.migration
    pairs = [(int(r["src_rank"]), int(r["dst_rank"]), float(r["bytes"])) for r in mig]
    migration = link_time(*link_bytes(pairs, topo), cost)
    # redundant experts' gradients, summed once per step: a ring all-reduce over the EP group
    redundant = sum(int((np.bincount(row[row >= 0], minlength=E) > 1).sum()) for row in plan.placement.phy2log)
    ring = 2 * (ep - 1) / ep * redundant * cost.expert_grad_bytes
    spans_nodes = ep > topo.gpus_per_node
    inside = cost.bw_reduce if cost.bw_reduce > 0 else cost.bw_intra  # an all-reduce's own bandwidth where set
    redundant_grads = ring / (cost.bw_inter if spans_nodes else inside) if ep > 1 else 0.0
    step = float(group_times[critical]) + migration + redundant_grads

    # ideal at the lower-bound microbatch count (the plan's own count without a cap)
    tokens_total = float(n.sum())
    if token_cap:
        ideal_micro = max(1, math.ceil(math.ceil(tokens_total / token_cap) / topo.dp))
    else:
        ideal_micro = M
    rpn = min(topo.gpus_per_node, ep)
    ideal = 0.0
    for l in range(L):
        tt = float(x[:, l, :].sum())
        ideal += COMPUTE_PASSES * (cost.a_lin * n.sum() + cost.a_quad[l] * (n**2).sum()) / topo.dp
        ideal += COMPUTE_PASSES * (cost.c_tok * tt / topo.dp + cost.c_exp * ideal_micro * E / ep)
        per_rank = tt / topo.dp * cost.token_bytes
        ideal += 2 * COMM_PASSES * per_rank * ((rpn - 1) / ep / cost.bw_intra + (ep - rpn) / ep / cost.bw_inter)
    return {
        "step_time": step,
        "ideal_time": ideal,
        "throughput": tokens_total / step,
        "ideal_throughput": tokens_total / ideal,
        "attention": float(attention[critical].sum()),
        "expert": float(expert[critical].sum()),
        "all_to_all": float(a2a[critical].sum()),
        "replication": float(replication[critical].sum()),
        "migration": migration,
        "redundant_grads": redundant_grads,
        "critical_group": critical,
        "group_times": group_times,
        "imbalance": imbalance,
        "mean_imbalance": float(imbalance.mean()),
        "intra_node_bytes": node_bytes["intra"],
        "cross_node_bytes": node_bytes["cross"],
        "cross_node_bytes_per_token": node_bytes["cross"] / tokens_total,
        # per exchange [G, M, L], all passes (what tests/test_pipeline.py schedules)
        "exchanges": {"attention": attention, "all_to_all": a2a, "expert": expert, "replication": rep_parts},
    }


FLOAT_FIELDS = [
    "step_time",
    "ideal_time",
    "throughput",
    "ideal_throughput",
    "attention",
    "expert",
    "all_to_all",
    "replication",
    "migration",
    "redundant_grads",
    "mean_imbalance",
    "intra_node_bytes",
    "cross_node_bytes",
    "cross_node_bytes_per_token",
]


def assert_matches(res: rp.SimResult, ref: Dict[str, object]) -> None:
    for f in FLOAT_FIELDS:
        np.testing.assert_allclose(getattr(res, f), ref[f], rtol=1e-9, atol=0, err_msg=f)
    assert res.critical_group == ref["critical_group"]
    np.testing.assert_allclose(res.group_times, ref["group_times"], rtol=1e-9, atol=0, err_msg="group_times")
    assert res.imbalance.shape == ref["imbalance"].shape
    np.testing.assert_allclose(res.imbalance, ref["imbalance"], rtol=1e-9, atol=0, err_msg="imbalance")
    # the parts of the critical group add up to the step time
    parts = res.attention + res.expert + res.all_to_all + res.replication + res.migration + res.redundant_grads
    np.testing.assert_allclose(parts, res.step_time, rtol=1e-9)


@pytest.mark.parametrize("seed", range(160))
def test_simulate_matches_reference(seed):
    case = random_case(seed, TOPOLOGIES[seed % len(TOPOLOGIES)])
    case.plan.validate(case.window, case.topo, 10**9)
    # every other case with a kernel call's fixed cost (c_call), from a tenth of an expert's
    # overhead to 30 of them
    cost = replace(case.cost, c_call=case.cost.c_exp * [0.1, 1.0, 30.0][seed // 2 % 3]) if seed % 2 else case.cost
    # and every third with an all-to-all latency (a tenth to ten times an expert's overhead)
    if seed % 3 == 1:
        cost = replace(cost, a2a_latency=case.cost.c_exp * [0.1, 10.0][seed // 3 % 2])
    # and every fifth with an all-reduce bandwidth of its own (a tenth to twice the all-to-all's)
    if seed % 5 == 2:
        cost = replace(cost, bw_reduce=case.cost.bw_intra * [0.1, 2.0][seed // 5 % 2])
    # and every fourth with the copies' staging per byte (a hundredth to ten times the link's)
    if seed % 4 == 3:
        cost = replace(cost, c_replica=[0.01, 10.0][seed // 4 % 2] / case.cost.bw_intra)
    res = rp.simulate(case.plan, case.window, case.topo, cost, case.token_cap)
    assert_matches(res, reference(case.plan, case.window, case.topo, cost, case.token_cap))


def test_generator_covers_the_rules():
    """The randomized cases above exercise every rule: replicas (exposed and hidden),
    migration with local and remote moves, two copies of an expert on one rank, experts with
    several slots, a cap-derived ideal, several groups, and groups spanning nodes."""
    seen = set()
    for seed in range(160):
        c = random_case(seed, TOPOLOGIES[seed % len(TOPOLOGIES)])
        res = rp.simulate(c.plan, c.window, c.topo, c.cost, c.token_cap)
        spr = c.topo.slots_per_rank
        p2l = c.plan.placement.phy2log
        ranks = p2l.reshape(p2l.shape[0], c.topo.ep, spr)
        for l in range(p2l.shape[0]):
            for r in range(c.topo.ep):
                vals = ranks[l, r][ranks[l, r] >= 0]
                if len(vals) != len(set(vals.tolist())):
                    seen.add("same_rank_pair")
        if (c.plan.placement.logcnt > 1).any():
            seen.add("redundant")
        if len(c.plan.replicas):
            seen.add("replicas")
            seen.add("exposed" if res.replication > 0 else "hidden")
        if len(c.plan.migration):
            seen.add("migration_remote" if res.migration > 0 else "migration_local")
            if (c.plan.migration["bytes"] == 0).any():
                seen.add("migration_local")
        if c.token_cap:
            seen.add("cap")
        if c.topo.num_groups > 1:
            seen.add("groups")
        if c.topo.ep > c.topo.gpus_per_node:
            seen.add("spans_nodes")
        if c.topo.ep < c.topo.gpus_per_node:
            seen.add("inside_node")
        if (c.plan.replicas["share"] == 0.5).any():
            seen.add("half_share")
    assert seen >= {
        "same_rank_pair",
        "redundant",
        "replicas",
        "exposed",
        "hidden",
        "migration_remote",
        "migration_local",
        "cap",
        "groups",
        "spans_nodes",
        "inside_node",
        "half_share",
    }, seen


def test_reference_route_rules_by_hand():
    """The reference's routing on the flow/ doc example (so the reference itself is checked
    against numbers worked out by hand, not only against Rust)."""
    topo = rp.Topology(4, 4, 2, 2)
    # expert on slots 1 (rank 0) and 6 (rank 3); origins 5, 7, 0, 3 (T = 15); replica on rank 2
    # takes round(0.5·15) = 8: rank 2 has none, its node-mate rank 3 gives 3, then rank 0 gives 5
    flow = route(np.array([5, 7, 0, 3]), [1, 6], [(2, 0.5)], topo)
    assert flow[:, 2].tolist() == [5, 0, 0, 3]
    # left: rank 1's 7 tokens split over the slots, origin 1 → the extra goes to slot index 1
    assert flow[1].tolist() == [3, 0, 0, 4]
    assert flow.sum() == 15
    # quotas of the even split (1 and 1), each rank's token kept on itself
    topo2 = rp.Topology(2, 2, 2, 2)
    assert route(np.array([1, 1]), [0, 2], [], topo2).tolist() == [[1, 0], [0, 1]]
    # node first: copies on rank 0 (node 0) and rank 2 (node 1), quotas 10 and 10; node 1 keeps
    # its 4, node 0's surplus of 6 crosses from ranks 0 and 1 as 6·10/16 and 6·6/16 (3.75,
    # 2.25 → 4, 2); rank 0 keeps 6 and takes rank 1's other 4
    topo3 = rp.Topology(4, 4, 2, 1)
    assert route(np.array([10, 6, 0, 4]), [0, 2], [], topo3).tolist() == [
        [6, 0, 4, 0],
        [4, 0, 2, 0],
        [0, 0, 0, 0],
        [0, 0, 4, 0],
    ]
    assert round_half_away(2.5) == 3 and round_half_away(0.49999999999999994) == 0


def test_simulate_single_cell_by_hand():
    """One group, one micro, one layer, worked out by hand: ep=2 on one node, E=2, static
    placement, two samples (one per rank)."""
    topo = rp.Topology(2, 2, 2, 1)
    cost = rp.CostModel(
        a_lin=1.0,
        a_quad=[0.5],
        c_tok=10.0,
        c_exp=100.0,
        token_bytes=2.0,
        bw_intra=4.0,
        bw_inter=1.0,
        expert_weight_bytes=1.0,
        expert_grad_bytes=1.0,
        expert_state_bytes=1.0,
    )
    window = rp.Window(np.array([3, 6]), np.array([[[3, 1]], [[0, 6]]], dtype=np.int32))
    placement = rp.Placement(np.array([[0, 1]], dtype=np.int32), 2, 1)
    plan = rp.Plan(placement, np.array([0, 1]), np.array([0, 0]), 1)
    res = rp.simulate(plan, window, topo, cost)
    # attention: max(1·3 + 0.5·9, 1·6 + 0.5·36) = 24, ×3
    assert res.attention == pytest.approx(72.0)
    # expert 0: 3 tokens on rank 0 (local); expert 1: 1 from rank 0 → rank 1, 6 local on rank 1
    # tokens [3, 7], one active expert each: max(30 + 100, 70 + 100) = 170, ×3
    assert res.expert == pytest.approx(510.0)
    # a2a: rank 0 sends 1 token (2 bytes), rank 1 receives it: 2 / 4 = 0.5, ×2×2
    assert res.all_to_all == pytest.approx(2.0)
    assert res.step_time == pytest.approx(584.0)
    assert res.imbalance[0, 0, 0] == pytest.approx(7 * 2 / 10)
    # ideal (no cap: M = 1): attention (9 + 0.5·45)/2·3 = 47.25; expert 3·(10·10/2 + 100·1·2/2)
    # = 450; a2a 4 · (10/2·2) · (1/2/4) = 5
    assert res.ideal_time == pytest.approx(47.25 + 450 + 5)
    assert_matches(res, reference(plan, window, topo, cost, None))
