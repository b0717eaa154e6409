"""What a plan's routing adds to Megatron-Core's MoE layer (issue 31): forward + backward of
the stock ``MoELayer`` against `PlanMoELayer` on the same tokens, CPU, 2 gloo ranks, EP 2.

Both layers are Megatron's own (``TopKRouter`` with RouterReplay feeding the same replayed
top-k, the all-to-all dispatcher, ``SequentialMLP``); the plan's layer adds the on-device slot
map after the router (one cumulative sum, a comparison, a gather, two scatters) and the slot
link on the dispatched tokens, under a `MegatronRunner` whose window tables are uploaded once
(`begin_window`) and whose microbatch is current (`start_micro`). Two placements:

* ``same``: the static placement in E/ep slots a rank (the physical experts are the stock
  ones: the routing's own cost);
* ``redundant``: one more slot a rank holding a redundant copy of the hottest expert, and one
  replica buffer (unused here), i.e. 2 more physical experts a rank for SequentialMLP to loop
  over, plus the redundant expert's once-per-step gradient sum.

Stock and plan iterations alternate (ABAB, so the machine's drift hits both alike); each
iteration's CPU time of the process (``time.process_time``: the shared machine's other load
does not count) and wall time are kept; the figure is the ratio of medians, per rank, repeated
``--rounds`` times. The load average is printed with it (a shared 2-core machine is noisy).

    python benches/megatron_overhead.py                 # T=1024 tokens a rank, H=256, I=512
    python benches/megatron_overhead.py --tokens 4096 --iters 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

E, K = 8, 2


def rank_main(rank, world, device, args):
    import torch

    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import megatron_cpu

        megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    import routepack as rp
    from routepack.integrations import megatron as rm
    from routepack.plan import Placement, Plan

    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=args.ffn,
        moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        expert_model_parallel_size=world,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=torch.float32,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    stock = spec.module(cfg, spec.submodules, layer_number=1)
    g = np.random.default_rng([1, rank])
    pop = np.array([6, 3, 2, 1, 1, 1, 1, 1], dtype=float)
    ids = np.stack([g.choice(E, K, replace=False, p=pop / pop.sum()) for _ in range(args.tokens)])
    routed = torch.from_numpy(ids)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(rank))
    # the window of both ranks' tokens: every rank knows every rank's ids (same seeds)
    all_ids = [
        np.stack(
            [np.random.default_rng([1, r]).choice(E, K, replace=False, p=pop / pop.sum()) for _ in range(args.tokens)]
        )
        for r in range(world)
    ]
    window = rp.Window.from_routed_experts(
        np.concatenate(all_ids)[:, None, :].astype(np.int32), np.arange(world + 1) * args.tokens, E
    )
    out = {}
    for name, spr in (("same", E // world), ("redundant", E // world + 1)):
        topo = rp.Topology(world, world, world, spr)
        ps = rm.plan_layer_spec(spec, topo, replica_slots=1 if name == "redundant" else 0)
        plan_layer = ps.module(cfg, ps.submodules, layer_number=1, **ps.params)
        plan_layer.load_state_dict({k: v for k, v in stock.state_dict().items() if "experts" not in k}, strict=False)
        runner = rm.MegatronRunner(plan_layer, topo)
        phy2log = Placement.static(1, E, topo).phy2log.copy()
        if name == "redundant":
            for r in range(world):
                phy2log[0, r * spr + spr - 1] = 0  # a second copy of the hottest expert on each rank
        placement = Placement(phy2log, E, spr)
        static = Placement.static(1, E, topo)
        from routepack import _core
        from routepack.plan import MIGRATION_DTYPE

        cols = _core.migration_diff(static.phy2log, placement.phy2log, E, spr, 1.0)
        mig = np.zeros(len(cols[0]), dtype=MIGRATION_DTYPE)
        for n_, c in zip(MIGRATION_DTYPE.names, cols):
            mig[n_] = c
        plan = Plan(placement, np.arange(world, dtype=np.int32), np.zeros(world, dtype=np.int32), 1, migration=mig)
        runner.begin_window(plan, window)
        times = {"stock": [], "plan": []}
        for it in range(args.warmup + args.iters):
            for which, layer in (("stock", stock), ("plan", plan_layer)):
                layer.router.router_replay.clear_indices()
                layer.router.router_replay.set_target_indices(routed)
                layer.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                if which == "plan":
                    runner.start_micro(0)
                x = hidden.clone().requires_grad_()
                torch.distributed.barrier()
                c0, w0 = time.process_time(), time.perf_counter()
                y, _ = layer(x)
                y.sum().backward()
                c1, w1 = time.process_time(), time.perf_counter()
                if which == "plan":
                    runner.finish_step()
                if it >= args.warmup:
                    times[which].append((c1 - c0, w1 - w0))
        s, p = np.asarray(times["stock"]), np.asarray(times["plan"])
        # the slot map alone on this rank's routing (forward + backward of its scatter)
        sm = plan_layer.slot_map
        sm.micro = 0
        probs = torch.zeros(args.tokens, E).scatter(1, routed, 0.5).requires_grad_()
        rmap = probs.detach() > 0
        alone = []
        for _ in range(args.iters * 5):
            c0 = time.process_time()
            pp, pm = sm.physical(probs, rmap)
            (pp * pm).sum().backward()
            alone.append(time.process_time() - c0)
        out[name] = {
            "map_cpu_ms": 1e3 * float(np.median(alone)),
            "stock_cpu_ms": 1e3 * float(np.median(s[:, 0])),
            "plan_cpu_ms": 1e3 * float(np.median(p[:, 0])),
            "stock_wall_ms": 1e3 * float(np.median(s[:, 1])),
            "plan_wall_ms": 1e3 * float(np.median(p[:, 1])),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from routepack.torch.spawn import run_ranks

    print(f"T={args.tokens} tokens a rank, H={args.hidden}, I={args.ffn}, E={E}, top-{K}, 2 gloo ranks (EP 2)")
    ratios = {"same": [], "redundant": []}
    maps = []
    for rnd in range(args.rounds):
        load = os.getloadavg()[0]
        out = run_ranks(rank_main, 2, args, join_timeout_s=1800, pg_timeout_s=600)
        for name in ratios:
            for r in sorted(out):
                f = out[r][name]
                cpu, wall = f["plan_cpu_ms"] / f["stock_cpu_ms"], f["plan_wall_ms"] / f["stock_wall_ms"]
                ratios[name].append(cpu)
                maps.append(f["map_cpu_ms"] / f["stock_cpu_ms"])
                print(
                    f"round {rnd} load {load:5.2f} {name:9s} rank {r}: map {f['map_cpu_ms']:5.2f} ms, "
                    f"stock {f['stock_cpu_ms']:7.2f} ms cpu "
                    f"({f['stock_wall_ms']:7.2f} wall), plan {f['plan_cpu_ms']:7.2f} ms cpu "
                    f"({f['plan_wall_ms']:7.2f} wall): {100 * (cpu - 1):+5.1f}% cpu, {100 * (wall - 1):+5.1f}% wall"
                )
    for name, r in ratios.items():
        print(
            f"{name}: plan/stock forward+backward CPU time, median over rounds and ranks: {100 * (np.median(r) - 1):+.1f}%"
        )


if __name__ == "__main__":
    main()
