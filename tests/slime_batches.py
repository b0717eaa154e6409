"""Random slime rollouts (per-sample ``rollout_routed_experts`` int32 [len(tokens) - 1, L, k],
rollout ids with several samples per rollout, lengths at the cap) and a plan per training
step. Shared by the slime adapter's tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import routepack as rp
from routepack.integrations import slime as rs
from verl_batches import distinct_topk

COST = dict(
    a_lin=1e-6,
    c_tok=1e-6,
    c_exp=1e-5,
    token_bytes=1e3,
    bw_intra=1e11,
    bw_inter=1e10,
    expert_weight_bytes=1e6,
    expert_grad_bytes=1e6,
    expert_state_bytes=1e7,
)


def slime_args(cap: int, balance_by_flops: bool = False, balance_data: bool = False) -> SimpleNamespace:
    """slime's args namespace as its own tests build it (tests/test_dp_schedule.py)."""
    return SimpleNamespace(
        micro_batch_size=1,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=cap,
        balance_data=balance_data,
        balance_by_flops=balance_by_flops,
        hidden_size=16,
        num_attention_heads=2,
        num_query_groups=2,
        vocab_size=32,
        ffn_hidden_size=64,
        num_experts=None,
        num_layers=2,
        kv_channels=8,
    )


def parallel_config(dp: int, cp: int = 1, vpp: int = 1, group: int = 1) -> dict:
    return {"dp_size": dp, "cp_size": cp, "vpp_size": vpp, "microbatch_group_size_per_vp_stage": group}


def rollout(rng: np.random.Generator, num_rollouts: int, cap: int, layers: int = 2, k: int = 2, experts: int = 5):
    """(routed per sample, total_lengths, rollout_indices): 1-3 samples per rollout, ids in
    shuffled first-occurrence order, lengths in [2, cap] with some exactly at the cap."""
    ids, lens = [], []
    for rid in rng.permutation(num_rollouts * 3)[:num_rollouts]:
        for _ in range(int(rng.integers(1, 4))):
            ids.append(int(rid))
            lens.append(cap if rng.random() < 0.15 else int(rng.integers(2, cap + 1)))
    routed = [distinct_topk(rng, n - 1, layers, k, experts).astype(np.int32) for n in lens]
    return routed, lens, ids


def plans_for_steps(routed, lens, ids, global_batch_size, topo, cap, policy="routepack", seed=0):
    """One validated plan per step, from that step's samples in `step_samples` order; None
    where a step's samples cannot fill a microbatch on every DP rank under the cap (no
    schedule without an empty microbatch exists: the planner refuses, saying so)."""
    plans = []
    for s, samples in enumerate(rs.step_samples(ids, global_batch_size)):
        w = rs.window_from_slime([routed[i] for i in samples], 5, total_lengths=[lens[i] for i in samples])
        cost = rp.CostModel(a_quad=[1e-9] * w.num_layers, **COST)
        try:
            plan = rp.plan_window(w, topo, cost, token_cap=cap, policy=policy, seed=seed + s, anneal_moves=500)
        except rp.InfeasibleError as e:
            assert "cannot fill" in str(e), e
            return None
        plans.append(plan.validate(w, topo, cap))
    return plans
