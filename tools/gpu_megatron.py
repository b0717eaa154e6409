#!/usr/bin/env python
"""GPU check of routepack.integrations.megatron on ONE GPU: Megatron-Core's stock CUDA path
(``GPTModel``, ``MoELayer``, the all-to-all dispatcher, the expert modules ``SequentialMLP``,
``GroupedMLP`` (``grouped_gemm``) and ``TEGroupedMLP`` (Transformer Engine's ``GroupedLinear``),
DDP, optimizers, ``forward_backward_func``; no stand-ins) under routepack plans.

    python tools/gpu_megatron.py                  # one CUDA GPU, about a minute a module
    python tools/gpu_megatron.py --cpu-standins   # a rehearsal on CPU with tests/megatron_cpu.py
    python tools/gpu_megatron.py --experts te_grouped grouped --no-timing

``--experts`` (default: all three; with ``--cpu-standins`` sequential, the grouped modules in a
run of their own) picks the expert modules; on a GPU a grouped module whose
kernel package (``grouped_gemm``, ``transformer_engine``) is not installed is reported as not
run (status 0 for it, the line says so). ``GroupedMLP`` runs with ``bf16=True`` as Megatron
asserts (its parameters fp32 as built here; ``grouped_gemm``'s kernel is bf16-only, so on a GPU
the check may fail in the kernel: that is its finding). ``--cpu-standins`` stands in for both
kernels (tests/megatron_cpu.py stand-ins 10, 11).

Without CUDA (and without ``--cpu-standins``) it exits at once with status 2, saying so.

EP 1 on one GPU: ``Topology(dp=1, ep=1, gpus_per_node=1, slots_per_rank=12)`` for 8 logical
experts (4 redundant copies of the window's hottest experts, re-placed and migrated every
window) and 2 replica buffers a rank, so the slot map splits hot experts' tokens between copies
and the layer holds 14 physical experts. (Intra-batch replica rows need 2 EP ranks; the CPU
tests run them.) Checks, one line each:

1. fp32, Megatron's FP32 optimizer: 3 windows against the same model under static placement on
   the same data: losses, grad norms and exported logical weights within ``TOL`` (TF32 off);
   every physical expert received exactly the tokens the plan's flow table gives it.
2. The same with ``DistributedOptimizer`` (its flat buffers and shards on the GPU; migration
   moves its master and Adam moments).
3. Timing: the stock ``MoELayer`` against `PlanMoELayer` forward + backward (CUDA events,
   T=16384 tokens, H=1024, I=2048), same placement and with redundant copies.

Exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

# the Megatron training case and Megatron's CPU stand-ins are the tests' harness
# (tests/megatron_selfcheck.py, tests/megatron_cpu.py), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TOL = 1e-4
#: ``MegatronCase.experts_module`` -> the packages its CUDA kernels come from
KERNELS = {"sequential": (), "grouped": ("grouped_gemm",), "te_grouped": ("transformer_engine",)}
E, SPR, REPLICA_SLOTS, WINDOWS, MICRO = 8, 12, 2, 3, 2


def hand_plans(case, micro=MICRO):
    """``plans(w, previous)`` for one DP rank: the window's hottest experts copied into the
    spare slots (each expert at least once), shuffled, migrated from ``previous``; samples
    round-robin over ``micro`` microbatches."""
    from routepack import _core
    from megatron_selfcheck import synthetic_window, topology
    from routepack.plan import MIGRATION_DTYPE, Placement, Plan

    topo = topology(case)

    def plans(w, previous):
        window, routed, cu = synthetic_window(case, w)
        rng = np.random.default_rng([case.seed, 11, w])
        rows = []
        for l in range(case.layers):
            hot = np.argsort(-window.counts[:, l].sum(axis=0), kind="stable")
            row = np.concatenate([np.arange(case.experts), hot[: topo.num_slots - case.experts]])
            rows.append(rng.permutation(row))
        placement = Placement(np.stack(rows).astype(np.int32), case.experts, topo.slots_per_rank)
        cols = _core.migration_diff(previous.phy2log, placement.phy2log, case.experts, topo.slots_per_rank, 1.0)
        mig = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
        for name, col in zip(MIGRATION_DTYPE.names, cols):
            mig[name] = col
        s = window.num_samples
        rank, mic = np.zeros(s, dtype=np.int32), (np.arange(s) % micro).astype(np.int32)
        plan = Plan(placement, rank, mic, micro, migration=mig).validate(window, topo, 1 << 30)
        static = Plan(Placement.static(case.layers, case.experts, topo), rank, mic, micro)
        return plan, static.validate(window, topo, 1 << 30), window, routed, cu

    return plans


def check_training(case, device, say):
    """Checks 1-2 for ``case``; returns whether they passed."""
    import megatron_selfcheck as ms
    from routepack.torch import flow_table
    from routepack.torch.routes import cell_origins

    plans = hand_plans(case)
    per_slot = {"ok": True, "cells": 0}

    def record(w, model, opt, runner):
        runner.recording = True

    def check(w, model, opt, runner):
        plan, window = runner.plan, runner._window
        origins = cell_origins(plan, window, 0, 1)
        for (m, l), counts in runner.received.items():
            flows = flow_table(
                np.ascontiguousarray(origins[m, :, l]), plan.placement.phy2log[l], ms.topology(case), plan.replicas[:0]
            )
            want = np.bincount(flows["dst_slot"], weights=flows["count"], minlength=case.slots_per_rank)
            per_slot["cells"] += 1
            per_slot["ok"] &= np.array_equal(np.asarray(counts[: case.slots_per_rank]), want.astype(np.int64))

    t0 = time.perf_counter()
    static = ms.train(case, False, 0, device, plans=plans)
    planned = ms.train(case, True, 0, device, plans=plans, before_step=record, after_window=check)
    c = ms.compare(static, planned)
    name = f"{case.experts_module} ({'/'.join(planned['experts'])}), " + (
        "DistributedOptimizer" if case.distributed_optimizer else "FP32Optimizer"
    )
    ok = c["missing"] == 0 and max(c["loss"], c["weights"], c["grad_norm"]) <= TOL
    say(
        f"{name}: {case.windows} windows, {planned['migrated']} migration rows: loss diff {c['loss']:.2e}, "
        f"weights diff {c['weights']:.2e}, grad norm diff {c['grad_norm']:.2e} ({time.perf_counter() - t0:.1f} s)",
        ok,
    )
    say(f"{name}: tokens per physical expert = the plan's flow table in {per_slot['cells']} cells", per_slot["ok"])
    return ok and per_slot["ok"] and per_slot["cells"] > 0


def timing(device, say, tokens=16384, hidden=1024, ffn=2048, iters=20, warmup=5):
    """Check 3: stock MoELayer vs PlanMoELayer forward + backward on the GPU."""
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    import routepack as rp
    from routepack.integrations import megatron as rm
    from routepack.plan import Placement, Plan

    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, num_moe_experts=E, moe_router_topk=2,
        moe_ffn_hidden_size=ffn, moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none", use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, params_dtype=torch.float32,
    )  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    stock = spec.module(cfg, spec.submodules, layer_number=1).to(device)
    rng = np.random.default_rng(0)
    pop = np.array([6, 3, 2, 1, 1, 1, 1, 1], dtype=float)
    ids = np.stack([rng.choice(E, 2, replace=False, p=pop / pop.sum()) for _ in range(tokens)])
    window = rp.Window.from_routed_experts(ids[:, None, :].astype(np.int32), np.array([0, tokens]), E)
    routed = torch.from_numpy(ids).to(device)
    x0 = torch.randn(tokens, 1, hidden, device=device)
    ok = True
    for name, spr in (("same placement", E), ("2 redundant copies", E + 2)):
        topo = rp.Topology(1, 1, 1, spr)
        ps = rm.plan_layer_spec(spec, topo, replica_slots=0)
        layer = ps.module(cfg, ps.submodules, layer_number=1, **ps.params).to(device)
        runner = rm.MegatronRunner(layer, topo)
        row = Placement.static(1, E, topo).phy2log.copy()
        row[0, E:] = [0, 1][: spr - E]  # the two hottest experts twice
        plan = Plan(Placement(row, E, spr), np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32), 1)
        if spr > E:
            from routepack import _core
            from routepack.plan import MIGRATION_DTYPE

            cols = _core.migration_diff(Placement.static(1, E, topo).phy2log, row, E, spr, 1.0)
            mig = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
            for n, c in zip(MIGRATION_DTYPE.names, cols):
                mig[n] = c
            plan = Plan(plan.placement, plan.sample_rank, plan.sample_micro, 1, migration=mig)
        runner.begin_window(plan, window)
        times = {"stock": [], "plan": []}
        for it in range(warmup + iters):
            for which, mod in (("stock", stock), ("plan", layer)):
                mod.router.router_replay.clear_indices()
                mod.router.router_replay.set_target_indices(routed)
                mod.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                if which == "plan":
                    runner.start_micro(0)
                x = x0.clone().requires_grad_()
                if device == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                t0 = time.perf_counter()
                y, _ = mod(x)
                y.sum().backward()
                if device == "cuda":
                    b.record()
                    torch.cuda.synchronize()
                ms = a.elapsed_time(b) if device == "cuda" else 1e3 * (time.perf_counter() - t0)
                if which == "plan":
                    runner.finish_step()
                if it >= warmup:
                    times[which].append(ms)
        s, p = float(np.median(times["stock"])), float(np.median(times["plan"]))
        say(f"timing, {name}: stock {s:.3f} ms, plan {p:.3f} ms forward+backward ({100 * (p / s - 1):+.1f}%)", True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-standins", action="store_true", help="rehearse on CPU with tests/megatron_cpu.py")
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--experts", nargs="+", choices=list(KERNELS), help="default: all three (on CPU: sequential)")
    args = ap.parse_args()
    import torch

    if args.experts is None:
        args.experts = ["sequential"] if args.cpu_standins else list(KERNELS)
    grouped = [m for m in args.experts if KERNELS[m]]
    if args.cpu_standins and grouped:
        if "sequential" in args.experts:
            # with the TE stand-in installed Megatron builds TE's norm for the local spec's block
            print("--cpu-standins: rehearse sequential and the grouped modules in separate runs; nothing was run")
            sys.exit(2)
        import megatron_cpu  # before megatron.core is imported: it looks for grouped_gemm and TE at import

        megatron_cpu.install(kernels=True)

    if not torch.cuda.is_available() and not args.cpu_standins:
        print("tools/gpu_megatron.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run")
        sys.exit(2)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("tools/gpu_megatron.py needs megatron-core (pip install --no-deps megatron-core); nothing was run")
        sys.exit(2)
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 without Transformer Engine leaves the name undefined (its TE import
        # fails first) while the router's gating reads it; None is the value its code checks for
        moe_utils.te_general_gemm = None
    device = "cpu" if args.cpu_standins else "cuda"
    if args.cpu_standins:
        import megatron_cpu

        megatron_cpu.install(optimizers=True)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo" if args.cpu_standins else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state

    from megatron_selfcheck import MegatronCase

    parallel_state.initialize_model_parallel()
    if device == "cuda":  # the CUDA RNG tracker's model-parallel state, which Megatron's attention forks
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    failed = []

    def say(line, ok):
        print(("ok   " if ok else "FAIL ") + line, flush=True)
        if not ok:
            failed.append(line)

    say(f"device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}, torch {torch.__version__}", True)
    for module in args.experts:
        missing = [] if args.cpu_standins else [p for p in KERNELS[module] if importlib.util.find_spec(p) is None]
        if missing:
            say(f"{module}: {', '.join(missing)} not installed on this device: not run", True)
            continue
        for distributed in (False, True):
            case = MegatronCase(
                dp=1, ep=1, gpus_per_node=1, slots_per_rank=SPR, replica_slots=REPLICA_SLOTS, samples=12,
                windows=args.windows, micro=MICRO, distributed_optimizer=distributed, experts_module=module,
            )  # fmt: skip
            check_training(case, device, say)
    if not args.no_timing:
        if device == "cuda":
            timing(device, say)
        else:  # the rehearsal: the same code at CPU sizes
            timing(device, say, tokens=1024, hidden=64, ffn=128, iters=3, warmup=1)
    dist.destroy_process_group()
    print("ALL CHECKS PASSED" if not failed else f"{len(failed)} CHECK(S) FAILED")
    sys.exit(0 if not failed else 1)


if __name__ == "__main__":
    main()
