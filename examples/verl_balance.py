"""routepack in a verl trainer: plan the batch from its routing replay, then let the plan
decide what ``_balance_batch`` and ``rearrange_micro_batches`` decided.

Runs on a synthetic batch in verl's own layout (no GPU, no download): ``routed_experts``
int16 [B, prompt + response, L, k] left-pad aligned, zero where nothing was recorded (the
final response row included: R3), ``attention_mask`` and ``response_mask``. With
``--verl`` (verl installed) it also runs the two swapped calls on a real ``DataProto``.

    python examples/verl_balance.py [--verl]
"""

import argparse
import importlib.util
import sys

import numpy as np

import routepack as rp
from routepack.integrations import verl as rv

DP, EXPERTS, LAYERS, K, PROMPT, RESPONSE = 4, 8, 2, 2, 24, 40


def synthetic_batch(rng, batch=16):
    """verl's batch fields for `batch` samples, as its agent loop writes them."""
    total = PROMPT + RESPONSE
    routed = np.zeros((batch, total, LAYERS, K), dtype=np.int16)
    mask = np.zeros((batch, total), dtype=np.int64)
    response_mask = np.zeros((batch, RESPONSE), dtype=np.int64)
    for b in range(batch):
        p, r = int(rng.integers(4, PROMPT + 1)), int(rng.integers(1, RESPONSE + 1))
        mask[b, PROMPT - p : PROMPT + r] = 1
        response_mask[b, :r] = 1
        recorded = p + r - 1  # the rollout engine does not route the last generated token
        keys = rng.random((recorded, LAYERS, EXPERTS)) ** np.linspace(3, 0.3, EXPERTS)  # some experts hot
        routed[b, PROMPT - p : PROMPT - p + recorded] = np.argsort(-keys, axis=2)[:, :, :K]
    return {"routed_experts": routed, "attention_mask": mask, "response_mask": response_mask}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verl", action="store_true", help="also run the swapped calls on a real verl DataProto")
    args = ap.parse_args()
    if args.verl and importlib.util.find_spec("verl") is None:
        # before any work: say what to install instead of a traceback at the import below
        sys.exit(
            "verl_balance.py: error: --verl needs verl and torch: pip install 'verl>=0.9' torch "
            '(from a clone of routepack: pip install ".[verl]"); without --verl it runs on numpy alone'
        )
    rng = np.random.default_rng(0)
    fields = synthetic_batch(rng)
    topo = rp.Topology(dp=DP, ep=2, gpus_per_node=2, slots_per_rank=5)
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
    max_token_len = 96

    window = rv.window_from_verl(fields, num_experts=EXPERTS)  # R3: the final response row is not counted
    plan = rv.plan_batch(window, topo, cost, max_token_len, anneal_moves=2000)  # equal sample counts per rank
    partitions = rv.balance_partitions(plan)  # what _balance_batch computes (global_partition_lst)
    print(f"{window}; {plan.num_micro} microbatches per DP rank")
    for r, part in enumerate(partitions):
        micro = rv.micro_batch_indices(plan, r)  # what rearrange_micro_batches returns second
        tokens = [int(window.seq_lens[[part[i] for i in m]].sum()) for m in micro]
        print(f"  DP rank {r}: samples {part} -> microbatches {micro} ({tokens} tokens, cap {max_token_len})")
        assert all(t <= max_token_len for t in tokens)

    if args.verl:
        import torch
        from verl.protocol import DataProto

        batch = DataProto.from_dict({k: torch.from_numpy(v) for k, v in fields.items()})
        metrics = {}
        rv.balance_batch(batch, plan, metrics)  # was: self._balance_batch(batch, metrics=metrics)
        for r, chunk in enumerate(batch.chunk(DP)):  # verl's dispatch: equal chunks
            # was: rearrange_micro_batches(chunk.batch, max_token_len)
            micro_batches, idx = rv.rearrange_micro_batches(chunk.batch, max_token_len, plan, r)
            print(f"  verl DP rank {r}: {[int(m['attention_mask'].sum()) for m in micro_batches]} tokens")
        print("  metrics:", metrics)


if __name__ == "__main__":
    main()
