"""routepack in Megatron-Core: a plan's placement carried out by the stock MoE layer.

Megatron pins expert p to EP rank p // num_local_experts and names it ep_rank * n_local + i
in checkpoints. With num_moe_experts = the plan's physical slots, `PlanRouter` (around the
logical TopKRouter and its RouterReplay) routes every replayed logical pair to a slot, and
weight{i} of each slot holds its logical expert. Here, on CPU with 2 simulated EP ranks (no
GPU, no download): the weight layout, the logical checkpoint loaded into it and exported
back, the replayed top-k mapped to slots (the plan's routing rule), and a toy MoE computed
both ways giving the same output.

    python examples/megatron_router.py
"""

import argparse
import numpy as np

import routepack as rp
from routepack.integrations import megatron as rm

EXPERTS, LAYERS, K, HIDDEN = 6, 2, 2, 4


def main():
    # no options: --help prints what the example does
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=4)  # 8 slots for 6 experts
    lens = rng.integers(8, 32, size=8)
    hot = np.array([8, 1, 1, 1, 1, 4], dtype=float)  # expert 0 hot: worth a second copy
    counts = np.stack([rng.multinomial(n * K, hot / hot.sum(), size=LAYERS) for n in lens]).clip(
        max=lens[:, None, None]
    )
    window = rp.Window(lens, counts.astype(np.int32))
    model = rp.ModelShape(
        num_layers=LAYERS,
        num_experts=EXPERTS,
        top_k=K,
        hidden=256,
        expert_ffn=128,
        attention=["full"] * LAYERS,
        expert_groups=1,
    )
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    plan = rp.plan_window(window, topo, cost, token_cap=64, policy="routepack_no_replication", anneal_moves=2000)

    print(f"num_moe_experts = {rm.num_moe_experts(plan)} (physical slots), num_local_experts = {topo.slots_per_rank}")
    local = rm.local_experts(plan)  # [L, ep, n_local]: logical expert in weight{i} of EP rank r
    for l in range(LAYERS):
        print(
            f"  layer {l}: "
            + "; ".join(
                f"EP rank {r}: " + ", ".join(f"weight{i}=expert {e}" for i, e in enumerate(local[l, r]))
                for r in range(topo.ep)
            )
        )

    layer = 0
    logical_ckpt = rng.standard_normal((EXPERTS, HIDDEN, HIDDEN))  # W[e]: expert e's weights
    load = rm.logical_to_checkpoint(plan, layer)  # physical checkpoint index -> logical expert (-1: empty)
    physical = np.zeros((topo.num_slots, HIDDEN, HIDDEN))
    physical[load >= 0] = logical_ckpt[load[load >= 0]]
    assert np.array_equal(physical[rm.checkpoint_to_logical(plan, layer)], logical_ckpt)  # export in logical ids

    # replayed logical top-k of each EP rank's tokens (what RouterReplay feeds), all-gathered counts
    ids = [
        np.stack([rng.choice(EXPERTS, K, replace=False, p=hot / hot.sum()) for _ in range(5)]) for _ in range(topo.ep)
    ]
    origin = np.stack([np.bincount(i.reshape(-1), minlength=EXPERTS) for i in ids])
    for r in range(topo.ep):
        slots = rm.slot_topk(ids[r], origin, plan.placement.phy2log[layer], topo, r)
        print(f"  EP rank {r}: logical {ids[r].tolist()} -> slots {slots.tolist()}")
        x = rng.standard_normal((len(ids[r]), HIDDEN))
        gate = rng.random((len(ids[r]), K))
        y_logical = np.einsum("tk,tkij,tj->ti", gate, logical_ckpt[ids[r]], x)
        y_physical = np.einsum("tk,tkij,tj->ti", gate, physical[slots], x)
        assert np.allclose(y_logical, y_physical)  # the layer computes the logical model's function
    print("physical layout computes the logical MoE: ok")


if __name__ == "__main__":
    main()
