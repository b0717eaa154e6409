"""What the execution audit costs a `PlanRunner` step (issue 40), measured: 2 gloo ranks on this
machine's CPU, the same model, plan and data run by two runners, one with ``audit="raise"`` (the
default) and one with ``audit="off"``, their steps interleaved (on, off, on, off, ...) so that
load from other processes falls on both alike.

    PYTHONPATH=python python3 benches/audit_overhead.py [--steps 40] [--routes both]

A step is what a trainer runs: ``start_micro`` + forward + backward for each of the rank's
microbatches, ``finish_step`` and ``optimizer.step`` (Adam), timed between two barriers on the
process's CPU clock (``time.process_time``: this rank's work, gloo's threads included, not the
time it waits for a core on a shared machine, which the wall clock adds; what `routepack
measure` judges a run by) and on the wall clock; each step's time is the slower rank's. The plan: EPLB placement with redundant
experts and hot_n replicas (``routepack.plan_window``), 4 MoE layers of 16 experts, dp = ep = 2,
about 4 microbatches a rank (a 256-token cap). ``--routes precomputed`` runs the routes `begin_window(...,
microbatches=)` computed from the replay (the forward compares ids on the device); ``live``
routes in the forward (a host copy and an all-gather of counts per layer); ``both`` (default)
runs each.

Prints, per route mode and clock: the median step with the audit on and off, the median of the
per-pair ratios (on / off, each pair two adjacent steps) with its interquartile range, and the
load average before and after (the machine is shared: a ratio measured under load spreads more,
the wall clock's most), and the CPU time spent inside the audit's own calls in the "on" runner
(each of its public methods timed: the overhead counted directly, free of the pairs' noise),
split into the per-layer counting and the step's exchange (``finish``, whose CPU time includes
gloo's threads polling while the peer is on its way).
Numbers, not assertions. On a GPU the audit adds per layer a host-side count (``EPMoE``'s unit
counts are host arrays) and, with precomputed routes, one device compare (already there for
the replay check); per step one device-to-host copy of the ``[2, M, L]`` cell flags and one
all-gather of ``3 + 17`` int64 a rank per group (EP, then expert-data-parallel and pipeline
where they exist): a few tens of microseconds on NVLink, against steps of hundreds of
milliseconds (a prediction from the design, not a GPU measurement).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Any, Dict, List

import numpy as np

L, E, K, H, I = 4, 16, 2, 256, 128
DP = EP = 2
SLOTS = 10  # 20 slots a layer for 16 experts: 4 redundant
SAMPLES, CAP = 48, 256


def _plan() -> tuple:
    """(plan, window, routed, cu): every rank computes the same."""
    import routepack as rp

    rng = np.random.default_rng(40)
    lens = rng.integers(16, 64, size=SAMPLES)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    routed = np.zeros((int(cu[-1]), L, K), dtype=np.int32)
    for l in range(L):
        pop = rng.dirichlet(np.full(E, 0.4))
        routed[:, l] = np.stack([rng.choice(E, size=K, replace=False, p=pop) for _ in range(routed.shape[0])])
    window = rp.Window.from_routed_experts(routed, cu, E)
    topo = rp.Topology(DP, EP, EP, SLOTS)
    shape = rp.ModelShape(num_layers=L, num_experts=E, top_k=K, hidden=H, expert_ffn=I, attention=["full"] * L)
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    policy = rp.Policy(placement="eplb", packing="routepack", replication="hot_n", loads="window")
    plan = rp.plan_window(window, topo, cost, token_cap=CAP, policy=policy)
    return plan.validate(window, topo, CAP), window, routed, cu


def _rank(rank: int, world: int, device: Any, steps: int, routes: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import routepack as rp
    from routepack.torch import EPMoE, PlanRunner
    from routepack.torch.replay import rank_microbatches

    torch.manual_seed(0)
    plan, window, routed, cu = _plan()
    topo = rp.Topology(DP, EP, EP, SLOTS)
    mbs = rank_microbatches(plan, routed, rank, cu)
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(L, E, H, 2 * I, generator=g) / H**0.5, torch.randn(L, E, I, H, generator=g) / I**0.5
    routers = torch.randn(L, H, E, generator=g) / H**0.5
    data = [
        (torch.randn(mb.routed.shape[0], H, generator=g), torch.randn(mb.routed.shape[0], H, generator=g)) for mb in mbs
    ]

    def model(audit: str):
        layers = [EPMoE(l, E, H, I, topo, plan.placement.phy2log[l]) for l in range(L)]
        for l, mod in enumerate(layers):
            mod.load_logical(w1[l], w2[l])
        rts = [torch.nn.Parameter(routers[l].clone()) for l in range(L)]
        runner = PlanRunner(layers, topo, timeout=datetime.timedelta(seconds=120), audit=audit)
        opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)] + rts, lr=1e-4)
        runner.begin_window(plan, window, opt, microbatches=mbs if routes == "precomputed" else None)
        return layers, rts, runner, opt

    def step(m) -> tuple:
        layers, rts, runner, opt = m
        dist.barrier()
        t0, c0, a0, f0 = time.perf_counter(), time.process_time(), spent[0], spent[1]
        for mb, (x, r) in zip(mbs, data):
            runner.start_micro(mb.micro)
            h, ids = x, mb.routed.long()
            for l, mod in enumerate(layers):
                a = torch.tanh(h)
                gate = torch.softmax(a @ rts[l], dim=-1).gather(1, ids[:, l])
                h = h + mod(a, ids[:, l], gate)
            (h * r).sum().backward()
        runner.finish_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        took = [time.process_time() - c0, time.perf_counter() - t0, spent[0] - a0, spent[1] - f0]
        got = torch.tensor(took, dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        return tuple(float(x) for x in got)

    on, off = model("raise"), model("off")
    # CPU seconds inside the audit's calls on this rank (the "on" runner only): [0] the
    # per-layer counting, [1] the step's exchange (`finish`: gloo's threads polling while the
    # peer is on its way count here too)
    spent = [0.0, 0.0]

    def timed(fn: Any, k: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            c = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[k] += time.process_time() - c

        return call

    audit = on[2].audit
    for name in ("note_forward", "note_micro", "note_units", "note_ids", "note_backward", "finish", "holds"):
        setattr(audit, name, timed(getattr(audit, name), int(name == "finish")))
    for _ in range(3):  # warm-up: allocator, gloo buffers, grouped kernels
        step(on)
        step(off)
    times: Dict[str, List[tuple]] = {"on": [], "off": []}
    for i in range(steps):
        first, second = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))
        for name, m in (first, second):
            times[name].append(step(m))
    report = on[2].last_audit()
    return {"times": times, "verdict": report.verdict if report is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="steps of each runner (interleaved)")
    ap.add_argument("--routes", choices=("precomputed", "live", "both"), default="both")
    args = ap.parse_args()
    from routepack.torch.spawn import run_ranks

    plan = _plan()[0]
    print(
        f"audit overhead: 2 gloo ranks, L={L} E={E} k={K} H={H} I={I}, {SLOTS} slots a rank, "
        f"{plan.num_micro} microbatches a rank, {plan.replicas.size} replica rows, "
        f"{int(sum((np.bincount(r[r >= 0]) > 1).sum() for r in plan.placement.phy2log))} redundant experts"
    )
    for routes in ("precomputed", "live") if args.routes == "both" else (args.routes,):
        load0 = os.getloadavg()
        out = run_ranks(_rank, 2, args.steps, routes, join_timeout_s=3600, pg_timeout_s=600)[0]
        load1 = os.getloadavg()
        for k, clock in enumerate(("CPU", "wall")):
            on, off = np.asarray(out["times"]["on"])[:, k], np.asarray(out["times"]["off"])[:, k]
            ratios = on / off
            q1, q3 = np.percentile(ratios, [25, 75])
            print(
                f"  {routes:11s} {clock:4s}: step on {1e3 * np.median(on):7.2f} ms, off {1e3 * np.median(off):7.2f} ms;"
                f" on/off median {np.median(ratios):.4f} (IQR {q1:.4f}-{q3:.4f}, {len(ratios)} pairs; ratio of "
                f"medians {np.median(on) / np.median(off):.4f})"
            )
        off_cpu = np.median(np.asarray(out["times"]["off"])[:, 0])
        for k, what in ((2, "counting (per layer)"), (3, "exchange (finish)")):
            inside = np.asarray(out["times"]["on"])[:, k]
            print(
                f"  {routes:11s} audit {what:20s} CPU, the slower rank: median {1e3 * np.median(inside):.3f} ms a "
                f"step (max {1e3 * inside.max():.3f}), {np.median(inside) / off_cpu:.2%} of the step off"
            )
        print(f"  {routes:11s}: audit verdict {out['verdict']!r}; load average {load0[0]:.1f} -> {load1[0]:.1f}")


if __name__ == "__main__":
    main()
