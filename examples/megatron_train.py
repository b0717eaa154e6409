"""Train a small Megatron-Core GPT model under routepack plans: placement, migration,
redundant experts and intra-batch replicas, all inside Megatron's own MoE layer.

Two gloo ranks on CPU (expert parallel size 2): a GPT model (local spec, 8 experts, top-2,
the stock all-to-all dispatcher, Megatron's DDP and Adam) trains 3 windows. Each window
routepack plans the replayed routes (``routepack.plan_window``), and the model carries the
plan out: the runner migrates experts with their optimizer state, redundant copies of hot
experts share their gradient, replicas take a share of hot experts' tokens per microbatch.
The same model under Megatron's static placement trains on the same data beside it; the
losses and the final logical weights must agree. The change to the training loop is::

    spec = rm.plan_layer_spec(get_gpt_layer_local_spec(num_experts=E), topo, replica_slots=2)
    runner = rm.MegatronRunner(ddp_model, topo)
    runner.begin_window(plan, window, optimizer)                 # each window
    forward_backward_func(..., data_iterator=runner.microbatches(data_iterator))
    runner.finish_step(); optimizer.step()

The model, its data and the comparison are the tests' (tests/megatron_selfcheck.py, run from
a clone). Without a GPU, Megatron's CUDA-only calls are stood in for by tests/megatron_cpu.py
(each with its reason; docs/megatron.md lists them).

    python examples/megatron_train.py
"""

import sys
from pathlib import Path

import numpy as np

RANKS, EP, WINDOWS = 2, 2, 3


def rank_main(rank, world, device):
    import torch

    # the training case is the tests' harness (tests/megatron_selfcheck.py), not part of the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if not torch.cuda.is_available():
        import megatron_cpu

        megatron_cpu.install(optimizers=True)
    import megatron_selfcheck as ms
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    case = ms.MegatronCase(dp=world, ep=EP, samples=16, windows=WINDOWS)
    static = ms.train(case, False, rank, device)
    planned = ms.train(case, True, rank, device)
    return {
        "diff": ms.compare(static, planned),
        "static": static["losses"],
        "planned": planned["losses"],
        "migrated": planned["migrated"],
        "replicated": planned["replicated"],
    }


def main():
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        sys.exit("this example needs megatron-core: pip install --no-deps megatron-core")
    from routepack.torch.spawn import run_ranks

    out = run_ranks(rank_main, RANKS, join_timeout_s=900, pg_timeout_s=300)
    for w in range(WINDOWS):
        s = np.mean([np.mean(out[r]["static"][w]) for r in out])
        p = np.mean([np.mean(out[r]["planned"][w]) for r in out])
        print(f"window {w}: loss static placement {s:.6f}, routepack plan {p:.6f}")
    diff = max(out[r]["diff"]["loss"] for r in out)
    wdiff = max(out[r]["diff"]["weights"] for r in out)
    print(f"largest loss difference against static placement: {diff:.2e}")
    print(f"largest logical-weight difference after {WINDOWS} windows: {wdiff:.2e}")
    print(f"experts migrated: {out[0]['migrated']}, replica copies: {out[0]['replicated']} (over {WINDOWS} windows)")
    if diff > 1e-5 or wdiff > 1e-5:
        sys.exit("the plan changed what the model computes")
    print("the plan's model trains like the stock one: ok")


if __name__ == "__main__":
    main()
