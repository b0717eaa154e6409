"""Built-in profiles of the models RL users train, and of a rack-scale NVLink cluster.

Each is a `routepack.traces.Profile` (the synthetic trace's realism: GRPO groups, long-tailed
responses with a truncation spike, per-layer skew, topic affinity, drift), registered in
`routepack.traces.PROFILES` when routepack is imported. What is the model card's and what is
assumed:

* **Model** (public model cards / HF ``config.json``): MoE layers, routed experts E, top-k,
  ``hidden_size`` H, ``moe_intermediate_size`` I, shared experts, expert groups. Every layer
  is priced as full attention (GQA, or MLA for DeepSeek-V3 and Kimi-K2) by
  `CostModel.from_model`'s per-token formula: projections 4·H², not each model's exact
  head layout (an assumption).
* **Dense layers and MTP**: the cost model prices MoE layers. DeepSeek-V3's first 3 layers
  and Kimi-K2's first are dense (``first_k_dense_replace``); their attention and FFN work is
  the same under every placement and replication and moves with the packing alone, so it is
  left out (an assumption: step times are those of the MoE layers). DeepSeek-V3's one MTP
  module holds a MoE layer of its own experts, routed like the others: it is counted
  (58 + 1 = 59 MoE layers).
* **Group-limited routing** (DeepSeek-V3: 8 groups, 4 per token): ``expert_groups=8`` sets
  EPLB's ``num_groups`` as DeepSeek runs it (its hierarchical policy, 8 groups over 4 nodes);
  the trace draws a sample's counts from all experts (a sample of thousands of tokens, each
  limited to 4 of 8 groups, spans every group in aggregate).
* **Cluster** (assumptions, from the shipped RL recipes: REFERENCES' slime scripts): H200
  nodes of 8 GPUs at datasheet rates; EP 8 / 16 / 32 / 64 as the issue's recipes name them;
  DP = the GPUs of one pipeline stage (the cost model has no tensor parallelism: each rank is
  one GPU running its own microbatches); one redundant expert slot a rank beyond E / ep.
* **RL workload** (assumptions): GRPO groups of 8 or 16 responses per prompt; responses
  lognormal with a median of 5-9K tokens, long-tailed and truncated at 32K (Qwen3) or 64K
  (DeepSeek-V3, Kimi-K2), the truncation spike included; token cap a little above the
  longest sample (long samples fill a row alone).
* **GB200 NVL72** (``nvl72_ep32``, ``nvl72_ep64``): ``flash``'s model and trace on one rack:
  64 of its 72 GPUs, nodes (trays) of 4, one 72-GPU NVLink domain at 900 GB/s a direction
  (`Hardware.gb200_nvl72`), EP 32 (two groups) or EP 64 (one), all inside the domain.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from routepack.hardware import NVL72_DOMAIN, NVL72_GPUS_PER_NODE
from routepack.traces import PROFILES, Profile


def _full(layers: int) -> tuple:
    return ("full",) * layers


#: The models RL users train (``qwen3_30b``, ``qwen3_235b``, ``deepseek_v3``, ``kimi_k2``) and
#: the rack-scale NVLink profiles (``nvl72_ep32``, ``nvl72_ep64``).
RL_PROFILES: Dict[str, Profile] = {
    # Qwen3-30B-A3B: 48 layers, all MoE; 128 experts top-8, no shared expert; H 2048, I 768;
    # EP 8 in one node, 2 nodes of DP
    "qwen3_30b": Profile(
        name="qwen3_30b",
        num_layers=48,
        num_experts=128,
        top_k=8,
        hidden=2048,
        expert_ffn=768,
        attention=_full(48),
        dp=16,
        ep=8,
        gpus_per_node=8,
        slots_per_rank=17,
        token_cap=36864,
        samples=1024,
        group_size=8,
        prompt_median=800.0,
        response_median=5000.0,
        max_response=32768,
        response_sigma=0.9,
        expert_groups=1,
        shared_experts=0,
    ),
    # Qwen3-235B-A22B: 94 layers, all MoE; 128 experts top-8, no shared expert; H 4096, I 1536;
    # EP 16 over 2 nodes (slime's recipe: EP 16), 2 EP groups
    "qwen3_235b": Profile(
        name="qwen3_235b",
        num_layers=94,
        num_experts=128,
        top_k=8,
        hidden=4096,
        expert_ffn=1536,
        attention=_full(94),
        dp=32,
        ep=16,
        gpus_per_node=8,
        slots_per_rank=9,
        token_cap=36864,
        samples=1024,
        group_size=8,
        prompt_median=800.0,
        response_median=6000.0,
        max_response=32768,
        response_sigma=0.9,
        expert_groups=1,
        shared_experts=0,
    ),
    # DeepSeek-V3: 61 layers, the first 3 dense, + 1 MTP module: 59 MoE layers; 256 routed
    # experts top-8 in 8 groups + 1 shared; H 7168, I 2048; EP 32 over 4 nodes, 2 EP groups
    "deepseek_v3": Profile(
        name="deepseek_v3",
        num_layers=59,
        num_experts=256,
        top_k=8,
        hidden=7168,
        expert_ffn=2048,
        attention=_full(59),
        dp=64,
        ep=32,
        gpus_per_node=8,
        slots_per_rank=9,
        token_cap=69632,
        samples=1024,
        group_size=16,
        prompt_median=1000.0,
        response_median=8000.0,
        max_response=65536,
        response_sigma=0.9,
        expert_groups=8,
        shared_experts=1,
    ),
    # Kimi-K2: 61 layers, the first dense: 60 MoE layers; 384 experts top-8 + 1 shared, no
    # expert groups; H 7168, I 2048; EP 64 over 8 nodes
    "kimi_k2": Profile(
        name="kimi_k2",
        num_layers=60,
        num_experts=384,
        top_k=8,
        hidden=7168,
        expert_ffn=2048,
        attention=_full(60),
        dp=64,
        ep=64,
        gpus_per_node=8,
        slots_per_rank=7,
        token_cap=69632,
        samples=1024,
        group_size=16,
        prompt_median=1000.0,
        response_median=9000.0,
        max_response=65536,
        response_sigma=0.9,
        expert_groups=1,
        shared_experts=1,
    ),
}

# GB200 NVL72: flash's model and trace on 64 GPUs of one rack, one NVLink domain, EP 32 or 64
for _ep, _spr in ((32, 17), (64, 9)):
    RL_PROFILES[f"nvl72_ep{_ep}"] = dataclasses.replace(
        PROFILES["flash"],
        name=f"nvl72_ep{_ep}",
        dp=64,
        ep=_ep,
        slots_per_rank=_spr,
        gpus_per_node=NVL72_GPUS_PER_NODE,
        nvlink_domain=NVL72_DOMAIN,
        hardware="gb200_nvl72",
    )


def register() -> None:
    """Adds `RL_PROFILES` to `routepack.traces.PROFILES` (``routepack``'s import does)."""
    PROFILES.update(RL_PROFILES)


__all__ = ["RL_PROFILES", "register"]
