"""Random verl batches, laid out as verl's agent loop lays them out (verl 0.9
``experimental/agent_loop/agent_loop.py``): prompts left-padded to ``P``, responses
right-padded to ``R``, ``routed_experts [B, P+R, L, k]`` starting at the prompt's first real
token, holding the rollout's routes for all but the final response token (R3), zeros
elsewhere; and plans for them. Shared by the verl adapter's tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import routepack as rp


@dataclass
class VerlBatch:
    routed_experts: np.ndarray  # [B, P+R, L, k] int16 or uint8
    attention_mask: np.ndarray  # [B, P+R] int64
    response_mask: np.ndarray  # [B, R] int64
    num_experts: int
    lens: np.ndarray  # [B] real tokens
    recorded: np.ndarray  # [B] rows the rollout recorded


def distinct_topk(rng: np.random.Generator, n: int, layers: int, k: int, num_experts: int) -> np.ndarray:
    """int64 [n, L, k]: k distinct ids in [0, E) per token and layer."""
    keys = rng.random((n, layers, num_experts))
    return np.argsort(keys, axis=2)[:, :, :k]


def verl_batch(
    rng: np.random.Generator,
    batch: int,
    prompt: int,
    response: int,
    layers: int,
    k: int,
    num_experts: int,
    dtype=np.int16,
    truncate: bool = False,
) -> VerlBatch:
    """``truncate``: some samples' recordings stop early (multi-turn: the rollout stops
    recording at the last generation), leaving trailing zero rows."""
    routed = np.zeros((batch, prompt + response, layers, k), dtype=dtype)
    mask = np.zeros((batch, prompt + response), dtype=np.int64)
    rmask = np.zeros((batch, response), dtype=np.int64)
    lens, recorded = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
    for b in range(batch):
        p = int(rng.integers(1, prompt + 1))
        r = int(rng.integers(0, response + 1))
        mask[b, prompt - p : prompt + r] = 1
        rmask[b, :r] = 1
        n = p + r
        rec = n - 1 if r > 0 else n  # no route for the final generated token
        if truncate and rec > 1 and rng.random() < 0.5:
            rec = int(rng.integers(1, rec))
        routed[b, prompt - p : prompt - p + rec] = distinct_topk(rng, rec, layers, k, num_experts)
        lens[b], recorded[b] = n, rec
    return VerlBatch(routed, mask, rmask, num_experts, lens, recorded)


def reference_counts(vb: VerlBatch) -> np.ndarray:
    """int32 [B, L, E]: each sample's recorded rows counted one by one."""
    b_n, _, layers, k = vb.routed_experts.shape
    out = np.zeros((b_n, layers, vb.num_experts), dtype=np.int32)
    for b in range(b_n):
        start = int(np.flatnonzero(vb.attention_mask[b])[0])
        for t in range(start, start + int(vb.recorded[b])):
            for l in range(layers):
                for e in vb.routed_experts[b, t, l]:
                    out[b, l, int(e)] += 1
    return out


def cost_model(layers: int, num_experts=None) -> rp.CostModel:
    """A small cost model the adapters' tests plan with."""
    return rp.CostModel(
        a_lin=1e-6,
        a_quad=[1e-9] * layers,
        c_tok=1e-6,
        c_exp=1e-5,
        token_bytes=1e3,
        bw_intra=1e11,
        bw_inter=1e10,
        expert_weight_bytes=1e6,
        expert_grad_bytes=1e6,
        expert_state_bytes=1e7,
        num_experts=num_experts,
    )


def plan_for(window: rp.Window, topo: rp.Topology, cap: int, policy: str, seed: int) -> rp.Plan:
    """`plan_batch`'s plan (equal sample counts per rank), validated again here."""
    from routepack.integrations.verl import plan_batch

    cost = cost_model(window.num_layers)
    plan = plan_batch(window, topo, cost, cap, policy=policy, seed=seed, anneal_moves=500)
    plan.validate(window, topo, cap)
    return plan
