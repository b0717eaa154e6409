"""Train a tiny Hugging Face MoE model expert-parallel under routepack plans, on CPU.

    python examples/hf_train.py                        # Qwen3-MoE, 3 windows, 4 gloo processes
    python examples/hf_train.py --family DeepSeek-V3 --windows 4 --samples 16

Needs torch and transformers >= 5.10 (DeepSeek-V3 and GLM-4.5: >= 5.13; ``pip install 'routepack[hf]'``); nothing is
downloaded: the model is a tiny random one built from a config. What it does:

1. rollout: each window's prompts go through the model once and the experts every MoE layer
   chose are recorded (`hf.capture_routed`: what SGLang / vLLM return as routed_experts);
2. plan: `routepack.plan_window` turns each window's routing into a plan: where each expert
   lives (migration from the placement in force), which samples each of the 4 ranks runs in
   which microbatch, which hot experts to copy for a microbatch (replicas);
3. train: 4 processes (gloo), each holding a quarter of the experts' slots (`hf.shard`); per
   window one optimizer step: `begin_window` moves the experts the plan moves, with their
   Adam state, then every microbatch routes exactly as recorded (`hf.replay_routing`);
4. the same training in one process, unsharded; the losses are printed side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers

import routepack as rp
from routepack.integrations import hf
from routepack.torch import rank_microbatches

RANKS = 4
VOCAB = 64
#: 4 ranks (dp = ep = 4), 2 per node, slots per rank: every expert once, a few spare slots
#: that the planner fills with copies of hot experts
TOPO = {
    "Qwen3-MoE": rp.Topology(dp=4, ep=4, gpus_per_node=2, slots_per_rank=3),  # 8 experts, 12 slots
    "DeepSeek-V3": rp.Topology(dp=4, ep=4, gpus_per_node=2, slots_per_rank=5),
}  # 16 experts, 20 slots


def build_model(family: str, seed: int = 0):
    """A tiny random model (stands for loading the same checkpoint on every rank)."""
    common: dict = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=64,
        pad_token_id=0,
        attention_dropout=0.0,
    )
    cls: Any
    config: Any
    if family == "Qwen3-MoE":  # softmax router; layer 1 is dense
        cls = transformers.Qwen3MoeForCausalLM
        config = transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
        )
    else:  # DeepSeek-V3: sigmoid router over 4 groups of 4 experts, a shared expert, a first dense layer
        cls = transformers.DeepseekV3ForCausalLM
        config = transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config)
    with torch.no_grad():  # routers drawn wider than the default init: clear top-k choices
        for r in hf.moe_routers(model):
            r.module.weight.normal_(0.0, 1.0)
    return model.train()


def rollout(model, windows: int, samples: int, max_len: int):
    """Per window: (input_ids [S, max_len], attention_mask [S, max_len], routed).
    Right padding; each window draws its tokens from another part of the vocabulary, so
    the experts' load shifts between windows and the planner moves experts."""
    out = []
    for w in range(windows):
        g = torch.Generator().manual_seed(w)
        lengths = torch.randint(3, max_len + 1, (samples,), generator=g)
        lo = 3 + (17 * w) % (VOCAB - 24)
        ids = torch.randint(lo, lo + 20, (samples, max_len), generator=g)
        mask = (torch.arange(max_len) < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        out.append((ids, mask, hf.capture_routed(model, ids, mask)))
    return out


def plan_all(model, batches, topo, token_cap: int):
    """One plan per window, each from the placement the previous one left in force.

    The cost model is the model's own with the experts' work per token x3e5 and their bytes
    x1e-3: at its real size a tiny model has nothing worth balancing, and no plan would move
    or copy an expert. Each plan is validated against its window."""
    base = rp.CostModel.from_model(hf.model_shape(model), rp.Hardware.h200())
    cost = dataclasses.replace(
        base,
        c_tok=base.c_tok * 3e5,
        expert_weight_bytes=base.expert_weight_bytes * 1e-3,
        expert_grad_bytes=base.expert_grad_bytes * 1e-3,
        expert_state_bytes=base.expert_state_bytes * 1e-3,
    )
    plans, previous = [], None
    for w, (_, _, routed) in enumerate(batches):
        window = rp.Window.from_routed_experts(*routed)
        plan = rp.plan_window(window, topo, cost, token_cap=token_cap, previous=previous, seed=w)
        plan.validate(window, topo, token_cap=token_cap)
        plans.append((plan, window))
        previous = plan.placement
    return plans


def loss_sum(logits, ids, mask):
    """Next-token cross-entropy summed over the real tokens."""
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def n_labels(mask) -> int:
    return int((mask[:, 1:] & mask[:, :-1]).sum())


def adam(model):
    # eps above fp32 rounding noise: a near-zero gradient then steps smoothly, not by lr·sign(noise)
    return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)


def train_rank(rank: int, family: str, batches, plans, store: str, result: str) -> None:
    """One of the 4 processes: the model sharded over the ranks, one optimizer step per window."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=120)
    )
    topo = TOPO[family]
    model = build_model(family)
    sharded = hf.shard(model, plans[0][0], topo=topo)  # this rank's slots of the first placement
    opt = adam(model)  # after shard: it owns the slot tensors the experts compute with
    rows = []
    for (ids_all, mask_all, routed), (plan, window) in zip(batches, plans):
        report = sharded.begin_window(plan, window, opt)  # migration, with the experts' Adam state
        local = 0.0
        for mb in rank_microbatches(plan, routed.routed, rank, routed.cu_seqlens, dp=topo.dp):
            if mb.samples.size:  # this rank's samples of this microbatch, trimmed to the longest
                sel = torch.from_numpy(mb.samples)
                mask = mask_all[sel]
                width = int(mask.sum(1).max())
                ids, mask = ids_all[sel][:, :width], mask[:, :width]
                sharded.start_micro(mb.micro, tokens=mask)  # padding is not sent to the experts
                with hf.replay_routing(model, mb.routed, attention_mask=mask):  # route as recorded
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                loss = loss_sum(logits, ids, mask) / n_labels(mask_all)
            else:  # no sample here: one dummy token, nothing dispatched, still in every exchange
                ids = mask = torch.ones(1, 1, dtype=torch.long)
                sharded.start_micro(mb.micro, tokens=torch.zeros_like(mask))
                loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum() * 0.0
            loss.backward()
            local += float(loss.detach())
        sharded.finish_step()  # replica and redundant-slot gradients; dense gradients summed over ranks
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        rows.append(
            {
                "loss": float(total),
                "moved": int(plan.migration.size),
                "replicas": int(plan.replicas.size),
                "bytes": 0 if report is None else report.sent_bytes + report.received_bytes,
            }
        )
    if rank == 0:
        with open(result, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def train_single(family: str, batches) -> list:
    """The reference: the same model and steps in one process, every window in one pass."""
    model = build_model(family)
    opt = adam(model)
    losses = []
    for ids, mask, routed in batches:
        with hf.replay_routing(model, routed, attention_mask=mask):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = loss_sum(logits, ids, mask) / n_labels(mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(TOPO), default="Qwen3-MoE")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--samples", type=int, default=12, help="prompts per window")
    p.add_argument("--max-len", type=int, default=12, help="tokens per prompt at most")
    p.add_argument("--token-cap", type=int, default=20, help="tokens per microbatch at most")
    args = p.parse_args()
    torch.set_num_threads(1)

    model = build_model(args.family)
    batches = rollout(model, args.windows, args.samples, args.max_len)
    plans = plan_all(model, batches, TOPO[args.family], args.token_cap)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "losses.json")
        mp.spawn(train_rank, args=(args.family, batches, plans, os.path.join(tmp, "store"), result), nprocs=RANKS)
        with open(result) as f:
            rows = json.load(f)
    single = train_single(args.family, batches)

    print(f"{args.family}: {RANKS} gloo ranks, expert-parallel under routepack plans vs one process")
    print(f"{'step':>4}  {'micro':>5}  {'moved':>5}  {'replicas':>8}  {'loss (4 ranks)':>14}  {'loss (1 process)':>16}")
    for w, (row, ref, (plan, _)) in enumerate(zip(rows, single, plans)):
        print(
            f"{w:>4}  {plan.num_micro:>5}  {row['moved']:>5}  {row['replicas']:>8}  {row['loss']:>14.7f}  {ref:>16.7f}"
        )
    worst = max(abs(r["loss"] - s) / abs(s) for r, s in zip(rows, single))
    print(f"max relative loss difference: {worst:.2e}")


if __name__ == "__main__":
    main()
