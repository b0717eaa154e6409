"""Packing and layout quality on the synthetic profiles (issue 4's acceptance figures).

Prints:
1. rows vs the lower bound over N windows per profile: the plan's row count (a multiple of
   dp) against dp·ceil(max(L1, L2)/dp), and the plain bin count against max(L1, L2);
2. simulated step time of routepack packing+layout against `kk` (verl) and `sequential`
   (Megatron) with `static` placement: median (and range) of the ratios over M windows;
3. annealed cost against the move budget (budgets equivalent to about 0.1, 0.3, 1 and 3 s of
   annealing at the rate measured here);
4. how the layout proxy tracks `simulate` (static placement, and a placement with replicas);
5. planning time of a `flash` window with the default budget.

Windows come from `routepack.traces.synthetic(profile, n, seed)` and are cached as one .npz
per window (a `flash` window takes seconds to generate and 268 MB to keep).

    python benches/packing_quality.py [--windows 20] [--ratio-windows 8] [--cache DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

import routepack as rp
from routepack import _core
from routepack.packing import DEFAULT_ANNEAL_MOVES


def _path(cache: Path, profile: str, seed: int, i: int) -> Path:
    return cache / f"{profile}_seed{seed}_w{i}.npz"


def _ensure(profile: str, n: int, seed: int, cache: Path) -> None:
    """Generates and caches windows 0..n-1 (one file each) unless all are cached already."""
    cache.mkdir(parents=True, exist_ok=True)
    if all(_path(cache, profile, seed, i).exists() for i in range(n)):
        return
    for i, w in enumerate(rp.traces.synthetic(profile, n, seed)):
        path = _path(cache, profile, seed, i)
        if not path.exists():
            np.savez(path, seq_lens=w.seq_lens, expert_tokens=w.counts)


def windows(profile: str, n: int, seed: int, cache: Path) -> Iterator[rp.Window]:
    """The first n windows of the profile, read one at a time from the cache."""
    _ensure(profile, n, seed, cache)
    for i in range(n):
        with np.load(_path(cache, profile, seed, i)) as z:
            yield rp.Window(z["seq_lens"], z["expert_tokens"])


def lengths(profile: str, n: int, seed: int, cache: Path) -> List[np.ndarray]:
    """Only the lengths (cheap to read from the cache)."""
    _ensure(profile, n, seed, cache)
    out = []
    for i in range(n):
        with np.load(_path(cache, profile, seed, i)) as z:
            out.append(z["seq_lens"])
    return out


def policy(packing: str) -> rp.Policy:
    return rp.Policy("static", packing, "none")


def rows_table(profile: str, n: int, seed: int, cache: Path) -> Dict:
    prof = rp.traces.profile(profile)
    dp, cap = prof.dp, prof.token_cap
    out = []
    for i, lens in enumerate(lengths(profile, n, seed, cache)):
        r = _core.pack_rows(lens, cap, dp)
        b = _core.pack_rows(lens, cap, 1)
        out.append(
            {
                "window": i,
                "rows": r["rows"],
                "bound": r["lower_bound"],
                "certified": r["certified"],
                "gap": r["gap"],
                "L1": r["l1"],
                "L2": r["l2"],
                "bins": b["rows"],
                "bins_bound": b["lower_bound"],
                "bins_certified": b["certified"],
                "bins_method": b["method"],
                "nodes": b["nodes"],
            }
        )
    cert = sum(x["certified"] for x in out)
    bins_cert = sum(x["bins_certified"] for x in out)
    print(
        f"\n[rows] {profile}: plan rows (multiple of dp={dp}) certified on {cert}/{n} windows; "
        f"plain bins certified on {bins_cert}/{n}"
    )
    print("  window  rows  bound  gap |  L1   L2  bins  bins_bound  method  nodes")
    for x in out:
        print(
            f"  {x['window']:>6} {x['rows']:>5} {x['bound']:>6} {x['gap']:>4} | {x['L1']:>4} {x['L2']:>4} {x['bins']:>5}"
            f" {x['bins_bound']:>11}  {x['bins_method']:>6} {x['nodes']:>6}"
        )
    return {"profile": profile, "certified": cert, "bins_certified": bins_cert, "windows": out}


def ratios(profile: str, n: int, seed: int, cache: Path) -> Dict:
    prof = rp.traces.profile(profile)
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    rows = []
    for i, w in enumerate(windows(profile, n, seed, cache)):
        t = {}
        for packing in ("sequential", "kk", "routepack"):
            p = rp.plan_window(w, topo, cost, token_cap=cap, policy=policy(packing), seed=0)
            p.validate(w, topo, cap)
            t[packing] = p.report["predicted"]["step_time"]
            t[packing + "_micro"] = p.num_micro
            t[packing + "_xnode"] = p.report["predicted"]["cross_node_bytes_per_token"] / 1e3
        t["vs_kk"] = t["routepack"] / t["kk"]
        t["vs_sequential"] = t["routepack"] / t["sequential"]
        rows.append(t)
        print(
            f"  {profile} window {i}: step time (s) sequential {t['sequential']:.4f} (M={t['sequential_micro']}), "
            f"kk {t['kk']:.4f} (M={t['kk_micro']}), routepack {t['routepack']:.4f} (M={t['routepack_micro']}); "
            f"cross-node kB/token sequential {t['sequential_xnode']:.2f}, kk {t['kk_xnode']:.2f}, "
            f"routepack {t['routepack_xnode']:.2f}; "
            f"routepack/kk {t['vs_kk']:.4f}, routepack/sequential {t['vs_sequential']:.4f}",
            flush=True,
        )
    kk = [r["vs_kk"] for r in rows]
    sq = [r["vs_sequential"] for r in rows]
    print(
        f"[ratio] {profile}: median routepack/kk {statistics.median(kk):.4f} (min {min(kk):.4f}, max {max(kk):.4f}); "
        f"median routepack/sequential {statistics.median(sq):.4f} (min {min(sq):.4f}, max {max(sq):.4f}) "
        f"over {n} windows, static placement, anneal_moves={DEFAULT_ANNEAL_MOVES}"
    )
    return {
        "profile": profile,
        "median_vs_kk": statistics.median(kk),
        "median_vs_sequential": statistics.median(sq),
        "windows": rows,
    }


def budgets(profile: str, n: int, seed: int, cache: Path) -> Dict:
    """Annealed cost (proxy = simulated step time with static placement) against the budget."""
    prof = rp.traces.profile(profile)
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    ws = list(windows(profile, n, seed, cache))
    # the rate: moves per wall second of annealing with the default budget, here and now
    p = rp.plan_window(ws[0], topo, cost, token_cap=cap, policy=policy("routepack"))
    r = p.report["packing"]
    rate = r["moves"] / r["seconds"]["anneal"]
    print(
        f"\n[budget] {profile}: measured {rate:,.0f} moves per wall second of annealing "
        f"({os.environ.get('RAYON_NUM_THREADS', 'all')} threads, load average {os.getloadavg()[0]:.1f})"
    )
    out = {"profile": profile, "moves_per_s": rate, "budgets": []}
    for secs in (0.0, 0.1, 0.3, 1.0, 3.0):
        moves = int(rate * secs)
        costs, sims, walls = [], [], []
        for w in ws:
            p = rp.plan_window(w, topo, cost, token_cap=cap, policy=policy("routepack"), anneal_moves=moves)
            walls.append(p.report["packing"]["seconds"]["anneal"])
            rr = p.report["packing"]
            costs.append(rr["annealed_cost"] / rr["initial_cost"])
            sims.append(p.report["predicted"]["step_time"])
        print(
            f"  ~{secs:>4} s = {moves:>9,} moves: annealed/initial cost {np.mean(costs):.5f} "
            f"(windows {', '.join(f'{c:.5f}' for c in costs)}), mean step time {np.mean(sims):.4f} s, "
            f"anneal wall {np.mean(walls):.2f} s"
        )
        out["budgets"].append(
            {"seconds": secs, "moves": moves, "cost_ratio": costs, "step_time": sims, "anneal_wall": walls}
        )
    h = p.report["packing"]["anneal_history"]
    print("  best cost per temperature step (last run):", ", ".join(f"{x:.4f}" for x in h["best_cost"]))
    return out


def replicated_placement(w: rp.Window, topo: rp.Topology) -> rp.Placement:
    """A placement with replicas, to exercise the proxy's even split: static slots, and each
    layer's spare slots given to the hottest experts (one extra replica each), filled on the
    ranks in order."""
    base = rp.Placement.static(w.num_layers, w.num_experts, topo)
    phy = base.phy2log.copy()
    load = w.layer_expert_load()
    for l in range(w.num_layers):
        free = np.flatnonzero(phy[l] < 0)
        hot = np.argsort(-load[l], kind="stable")[: len(free)]
        # spread the copies: the j-th hottest goes to the j-th free slot in rank-interleaved order
        order = sorted(free, key=lambda p: (p % topo.slots_per_rank, p // topo.slots_per_rank))
        for p, e in zip(order, hot):
            phy[l, p] = e
    return rp.Placement(phy, w.num_experts, topo.slots_per_rank)


def proxy_check(profile: str, seed: int, cache: Path) -> Dict:
    prof = rp.traces.profile(profile)
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    w = next(windows(profile, 1, seed, cache))
    out = {}
    for name, pl in (
        ("static", rp.Placement.static(w.num_layers, w.num_experts, topo)),
        ("replicated", replicated_placement(w, topo)),
    ):
        proxy, sim = [], []
        for packing, moves in (
            ("sequential", None),
            ("kk", None),
            ("routepack", 0),
            ("routepack", 100_000),
            ("routepack", None),
        ):
            if packing == "routepack":
                rank, micro, m, _ = _core.pack_routepack(
                    w.seq_lens,
                    w.counts,
                    topo,
                    cost,
                    pl.phy2log,
                    cap,
                    anneal_moves=DEFAULT_ANNEAL_MOVES if moves is None else moves,
                )
            elif packing == "kk":
                rank, micro, m, _ = _core.pack_kk(w.seq_lens, cap, topo.dp)
            else:
                rank, micro, m, _ = _core.pack_sequential(w.seq_lens, cap, topo.dp)
            plan = rp.Plan(pl, rank, micro, m)
            plan.validate(w, topo, cap)
            sim.append(rp.simulate(plan, w, topo, cost, cap).step_time)
            proxy.append(_core.layout_proxy_cost(plan, w.seq_lens, w.counts, topo, cost))
        rel = max(abs(a - b) / b for a, b in zip(proxy, sim))
        r = float(np.corrcoef(proxy, sim)[0, 1])
        print(
            f"[proxy] {profile}, {name} placement: proxy vs simulate over {len(sim)} layouts: Pearson r {r:.6f}, "
            f"max relative difference {rel:.2e}; simulate {', '.join(f'{x:.4f}' for x in sim)}"
        )
        out[name] = {"pearson": r, "max_rel_diff": rel, "proxy": proxy, "simulate": sim}
    return out


def planning_time(seed: int, cache: Path) -> Dict:
    prof = rp.traces.profile("flash")
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    w = next(windows("flash", 1, seed, cache))
    out = []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        p = rp.plan_window(w, topo, cost, token_cap=cap, policy=policy("routepack"))
        out.append(
            {
                "wall": time.perf_counter() - wall,
                "cpu": time.process_time() - cpu,
                "stages": p.report["stage_seconds"],
                "packing": p.report["packing"]["seconds"],
            }
        )
    best = min(out, key=lambda x: x["wall"])
    print(
        f"\n[time] flash plan_window, static + routepack packing, default anneal_moves={DEFAULT_ANNEAL_MOVES}: "
        f"wall {best['wall']:.2f} s (process CPU {best['cpu']:.2f} s; best of 3; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); packing parts "
        + ", ".join(f"{k} {v:.3f} s" for k, v in best["packing"].items())
    )
    return {"runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=20, help="windows per profile for the rows table")
    ap.add_argument("--ratio-windows", type=int, default=8, help="windows per profile for step-time ratios")
    ap.add_argument("--budget-windows", type=int, default=2, help="windows per profile for the budget sweep")
    ap.add_argument("--profiles", default="tiny,flash")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/routepack_windows"))
    ap.add_argument("--parts", default="rows,ratios,budgets,proxy,time")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    result: Dict = {}
    for profile in a.profiles.split(","):
        res = result.setdefault(profile, {})
        if "rows" in parts:
            res["rows"] = rows_table(profile, a.windows, a.seed, a.cache)
        if "ratios" in parts:
            print(f"\n[ratio] {profile}: {a.ratio_windows} windows")
            res["ratios"] = ratios(profile, a.ratio_windows, a.seed, a.cache)
        if "budgets" in parts:
            res["budgets"] = budgets(profile, a.budget_windows, a.seed, a.cache)
        if "proxy" in parts:
            res["proxy"] = proxy_check(profile, a.seed, a.cache)
    if "time" in parts and "flash" in a.profiles.split(","):
        result["time"] = planning_time(a.seed, a.cache)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
