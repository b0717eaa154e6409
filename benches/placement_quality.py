"""Placement quality (issue 3): EPLB against routepack on the synthetic profiles.

    python benches/placement_quality.py [--profiles tiny flash] [--seed 0] [--cache DIR]

Two successive windows W0, W1 of each profile (`routepack.traces.synthetic`, cached as .npz
under --cache because `flash` takes minutes to generate). Everything is scored on W1:

1. aggregate imbalance per layer (max / mean rank load over the window; each expert's load
   split evenly over its replicas) against the lower bound (optimal replication); "(dup)"
   counts the layers routepack trails where the baseline put two copies of one expert on one
   rank, an arrangement routepack refuses while another exists;
2. per-microbatch expert imbalance and step time from `routepack.simulate`, with static
   (sequential) packing and no replication, so only the placement differs; "shuffled" scores
   the same placements with the window's samples in a random order (cells then share nothing
   with the consecutive-sample chunks routepack balanced);
3. migration from a placement planned on W0: network moves per layer, exposed migration
   seconds and step time, for routepack (migration-aware; relabelling only), a naive
   re-placement (routepack from scratch, diffed slot by slot), EPLB re-placed, and keeping W0's.

EPLB runs with this window's loads (oracle) and with W0's (what it does in practice), in its
global policy (the default for these models, which route without groups: `eplb_num_groups=1`)
and its hierarchical policy (placement `eplb_hierarchical`: one group per node).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import routepack as rp
from routepack.placement import aggregate_imbalance, imbalance_lower_bound


def load_windows(name: str, seed: int, cache: Path):
    paths = [cache / f"{name}_s{seed}_w{i}.npz" for i in range(2)]
    if not all(p.exists() for p in paths):
        cache.mkdir(parents=True, exist_ok=True)
        for p, w in zip(paths, rp.traces.synthetic(name, 2, seed)):
            w.save(p)
    return [rp.Window.load(p) for p in paths]


def policy(placement: str, loads: str = "window") -> rp.Policy:
    return rp.Policy(placement, "sequential", "none", loads)


def shares_a_rank(placement: rp.Placement, topo) -> np.ndarray:
    """[L] bool: some rank holds two copies of one expert (EPLB's greedy packing can; routepack
    never does while another arrangement exists, so it may trail such a layer's balance)."""
    ph = placement.phy2log.reshape(placement.phy2log.shape[0], topo.ep, -1)
    srt = np.sort(ph, axis=2)
    return ((srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)).any(axis=(1, 2))


def moves_per_layer(migration: np.ndarray, layers: int) -> np.ndarray:
    net = migration[migration["bytes"] > 0]
    return np.bincount(net["layer"], minlength=layers)


def with_migration(plan: rp.Plan, previous: rp.Placement, topo, cost) -> rp.Plan:
    """`plan` with the moves from `previous` (slot by slot, as plan_window would list them)."""
    cols = rp._core.migration_diff(
        previous.phy2log,
        plan.placement.phy2log,
        plan.placement.num_experts,
        topo.slots_per_rank,
        cost.expert_state_bytes,
        min(topo.gpus_per_node, topo.ep),
    )
    mig = np.zeros(len(cols[0]), dtype=rp.MIGRATION_DTYPE)
    for name, col in zip(rp.MIGRATION_DTYPE.names, cols):
        mig[name] = col
    return rp.Plan(
        plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, migration=mig, report=plan.report
    )


def run(name: str, seed: int, cache: Path) -> None:
    prof = rp.traces.profile(name)
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    w0, w1 = load_windows(name, seed, cache)
    L = w1.num_layers
    loads = w1.layer_expert_load()
    lb = imbalance_lower_bound(loads, topo)

    def plan(pol, window=w1, **kw):
        t = time.perf_counter()
        p = rp.plan_window(window, topo, cost, token_cap=cap, policy=pol, previous_window=w0, **kw)
        p.validate(window, topo, cap)
        p.report["wall_s"] = time.perf_counter() - t
        return p

    print(
        f"\n=== {name}: L={L} E={w1.num_experts} slots={topo.num_slots} over ep={topo.ep} ranks, "
        f"{topo.nodes_per_group} node(s) per EP group; scored on window 1 (seed {seed}) ==="
    )
    rows = {
        "EPLB hierarchical, oracle loads": plan(policy("eplb_hierarchical")),
        "EPLB global, oracle loads": plan(policy("eplb"), eplb_num_groups=1),
        "EPLB hierarchical, previous loads": plan(policy("eplb_hierarchical", "previous")),
        "EPLB global, previous loads": plan(policy("eplb", "previous"), eplb_num_groups=1),
        "routepack, oracle loads": plan(policy("routepack")),
        "routepack, previous loads": plan(policy("routepack", "previous")),
    }
    static = plan("static")
    ours = aggregate_imbalance(rows["routepack, oracle loads"].placement, loads)

    print("\n1. aggregate imbalance over the window (max/mean rank load), per layer")
    print(
        f"{'placement':36s} {'mean':>8s} {'max':>8s} {'mean/LB':>8s} {'layers routepack(oracle) worse':>31s}"
        f" {'(dup)':>6s}"
    )
    print(f"{'lower bound (optimal replication)':36s} {lb.mean():8.4f} {lb.max():8.4f} {1.0:8.4f}")
    for label, p in rows.items():
        agg = aggregate_imbalance(p.placement, loads)
        worse = ours > agg + 1e-12
        dup = shares_a_rank(p.placement, topo) & worse
        print(
            f"{label:36s} {agg.mean():8.4f} {agg.max():8.4f} {np.mean(agg / lb):8.4f} {int(worse.sum()):>24d} of {L}"
            f" {int(dup.sum()):6d}"
        )

    perm = np.random.default_rng(seed + 1).permutation(w1.num_samples)
    ws = rp.Window(w1.seq_lens[perm], w1.counts[perm])
    packed = rp.plan_window(ws, topo, cost, token_cap=cap, policy="static")

    def shuffled(p):
        q = rp.Plan(p.placement, packed.sample_rank, packed.sample_micro, packed.num_micro).validate(ws, topo, cap)
        return rp.simulate(q, ws, topo, cost, cap)

    print("\n2. simulate, static packing, no replication (per-microbatch imbalance = mean over group, micro, layer)")
    print(
        f"{'placement':36s} {'micro imb':>9s} {'step s':>9s} {'shuffled imb':>12s} {'shuffled step':>13s} {'place s':>8s}"
        f" {'xnode kB/tok':>12s}"
    )
    for label, p in [("static (Megatron)", static)] + list(rows.items()):
        pr = p.report["predicted"]
        s = shuffled(p)
        print(
            f"{label:36s} {pr['mean_imbalance']:9.4f} {pr['step_time']:9.3f} {s.mean_imbalance:12.4f} "
            f"{s.step_time:13.3f} {p.report['stage_seconds']['placement']:8.3f} "
            f"{pr['cross_node_bytes_per_token'] / 1e3:12.2f}"
        )

    print("\n3. migration from the placement planned on window 0 (network moves per layer)")
    print(
        f"{'':36s} {'moves mean':>10s} {'max':>5s} {'migration s':>11s} {'step s':>9s} {'micro imb':>9s}"
        f" {'xnode kB/tok':>12s}"
    )
    first = plan(policy("routepack"), window=w0)
    same = plan(policy("routepack"), window=w0, previous=first.placement)
    mv = moves_per_layer(same.migration, L)
    print(
        f"{'routepack, unchanged loads (W0->W0)':36s} {mv.mean():10.1f} {mv.max():5d} "
        f"{same.report['predicted']['migration']:11.4f}"
    )
    fresh = rows["routepack, oracle loads"]
    naive = with_migration(fresh, first.placement, topo, cost)
    keep = rp.Plan(first.placement, static.sample_rank, static.sample_micro, static.num_micro)
    cases = [
        ("routepack, migration-aware", plan(policy("routepack"), previous=first.placement)),
        (
            "routepack, relabelling only",
            plan(policy("routepack"), previous=first.placement, placement_migration_aware=False),
        ),
        ("naive re-placement (no relabel)", naive),
    ]
    for g_label, choice in (("hierarchical", "eplb_hierarchical"), ("global", "eplb")):
        e0 = plan(policy(choice), window=w0)
        cases.append((f"EPLB {g_label} re-placed (oracle)", plan(policy(choice), previous=e0.placement)))
    for label, p in cases:
        res = rp.simulate(p, w1, topo, cost, cap)
        mv = moves_per_layer(p.migration, L)
        print(
            f"{label:36s} {mv.mean():10.1f} {mv.max():5d} {res.migration:11.4f} {res.step_time:9.3f} "
            f"{res.mean_imbalance:9.4f} {res.cross_node_bytes_per_token / 1e3:12.2f}"
        )
    res = rp.simulate(keep, w1, topo, cost, cap)
    print(
        f"{'keep window 0 routepack placement':36s} {0.0:10.1f} {0:5d} {0.0:11.4f} {res.step_time:9.3f} "
        f"{res.mean_imbalance:9.4f} {res.cross_node_bytes_per_token / 1e3:12.2f}"
    )
    aware = cases[0][1].report["stage_reports"]["placement"]
    print("   routepack choices per layer:", {c: aware["choice"].count(c) for c in sorted(set(aware["choice"]))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=["tiny", "flash"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/routepack_windows"))
    args = ap.parse_args()
    for name in args.profiles:
        run(name, args.seed, args.cache)


if __name__ == "__main__":
    main()
