"""The acceptance check of `routepack.integrations.hf_shard` (tests/torch/test_hf_shard.py; the
tests' harness, not part of the package): a tiny random transformers MoE model trained for a
few windows on gloo ranks, expert-parallel under `routepack.plan_window` plans with migration
and replication, against the same model trained in one process. Everything comes from `Case` and its seed, so every rank builds the
same model, prompts, routing and plans (`PlanRunner.begin_window` checks they agree).

* `build_model`: the family's tiny model (fp32, train mode, no dropout), routers drawn at
  scale 1 so top-k choices are far from ties.
* `capture_windows`: each window's prompts (right-padded ``[S, max_len]``, a different
  vocabulary range per window so the routing shifts) and their routing, captured from the
  initial model (`hf.capture_routed`), as a rollout engine would record it.
* `plan_windows`: one `plan_window` per window from the placement in force, each validated.
  The cost model is the model's own with expert work per token x3e5 and expert bytes x1e-3:
  at its real size a tiny model has nothing worth balancing, so no plan would move or
  replicate an expert (at x1e5, since placement weighs what a copy costs its rank across
  nodes, Qwen3-MoE's and OLMoE's plans replicated nothing; at x3e5 every family's do).
* `train_single` / `train_rank`: the loss is the summed next-token cross-entropy of the
  window over its real tokens, divided by their count (so the ranks' losses add up to the
  single process's); one Adam step per window.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import routepack as rp
from routepack.integrations import hf
from routepack.torch import rank_microbatches

COMMON: Dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=24,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)
#: family -> (config class, model class, fields, slots per rank for 4 ranks)
FAMILIES: Dict[str, Tuple[str, str, Dict[str, Any], int]] = {
    "Qwen3-MoE": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            head_dim=8,
            mlp_only_layers=[1],
        ),
        3,
    ),
    "Qwen2-MoE": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        ),
        3,
    ),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2), 3),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8), 3),
    "DeepSeek-V3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        5,
    ),
    "GLM-4.5": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            head_dim=8,
        ),
        5,
    ),
}


@dataclass(frozen=True)
class Case:
    """One family's run: sizes, windows, planning and training settings."""

    family: str = "Qwen3-MoE"
    windows: int = 3
    samples: int = 12
    max_len: int = 12
    token_cap: int = 20
    dp: int = 4
    gpus_per_node: int = 2
    lr: float = 1e-2
    eps: float = 1e-3
    seed: int = 0

    def topology(self) -> rp.Topology:
        return rp.Topology(self.dp, self.dp, self.gpus_per_node, FAMILIES[self.family][3])


def build_model(case: Case) -> Any:
    """The family's tiny model, seeded, fp32, train mode."""
    import transformers as tf

    config_cls, model_cls, fields, _ = FAMILIES[case.family]
    torch.manual_seed(case.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(tf, model_cls)(getattr(tf, config_cls)(**{**COMMON, **fields}))
    with torch.no_grad():
        for r in hf.moe_routers(model):
            r.module.weight.normal_(0.0, 1.0)
            if hasattr(r.module, "e_score_correction_bias"):
                r.module.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model.train()


@dataclass(frozen=True)
class Batch:
    """One window's prompts and routing: ``input_ids`` / ``mask`` int64 ``[S, max_len]``
    (right padding), ``routed`` (`hf.Routed`), ``window`` (`routepack.Window`)."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    routed: Any
    window: rp.Window


def capture_windows(model: Any, case: Case) -> List[Batch]:
    """``case.windows`` batches of ``case.samples`` right-padded prompts and their routing."""
    out = []
    vocab = int(COMMON["vocab_size"])
    for w in range(case.windows):
        g = torch.Generator().manual_seed(case.seed * 1000 + w)
        lens = torch.randint(3, case.max_len + 1, (case.samples,), generator=g)
        lo = 3 + (17 * w) % (vocab - 24)
        ids = torch.randint(lo, lo + 20, (case.samples, case.max_len), generator=g)
        mask = (torch.arange(case.max_len) < lens[:, None]).long()
        ids = ids.masked_fill(mask == 0, COMMON["pad_token_id"])
        routed = hf.capture_routed(model, ids, mask)
        out.append(Batch(ids, mask, routed, rp.Window.from_routed_experts(*routed)))
    return out


def planning_cost(model: Any) -> rp.CostModel:
    """The model's cost model, expert work per token x3e5, expert bytes x1e-3 (module doc)."""
    base = rp.CostModel.from_model(hf.model_shape(model), rp.Hardware.h200())
    return dataclasses.replace(
        base,
        c_tok=base.c_tok * 3e5,
        expert_weight_bytes=base.expert_weight_bytes * 1e-3,
        expert_grad_bytes=base.expert_grad_bytes * 1e-3,
        expert_state_bytes=base.expert_state_bytes * 1e-3,
    )


def plan_windows(model: Any, batches: List[Batch], case: Case) -> List[rp.Plan]:
    """One validated plan per window, each from the placement the previous one left."""
    topo, cost = case.topology(), planning_cost(model)
    plans: List[rp.Plan] = []
    for w, b in enumerate(batches):
        prev = plans[-1].placement if plans else None
        plan = rp.plan_window(
            b.window,
            topo,
            cost,
            token_cap=case.token_cap,
            previous=prev,
            previous_window=batches[w - 1].window if w else None,
            seed=case.seed + w,
        )
        plan.validate(b.window, topo, token_cap=case.token_cap)
        plans.append(plan)
    return plans


def adam(model: Any, case: Case) -> torch.optim.Adam:
    """Adam with ``eps`` above the gradients' fp32 rounding noise: with the default 1e-8, a
    gradient near 0 (an expert few tokens reached) steps by about ``lr`` times its sign, so
    the last-bit differences between summing a gradient in one process and over ranks
    would become lr-sized weight differences; this keeps the update a smooth function of
    the gradient, so equal training shows as equal weights."""
    return torch.optim.Adam(model.parameters(), lr=case.lr, eps=case.eps)


def loss_sum(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the real tokens (fp32 scalar)."""
    labels = input_ids.masked_fill(mask == 0, -100)[:, 1:]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def label_count(mask: torch.Tensor) -> int:
    """Next-token targets in a right-padded int ``[B, S]`` mask (real tokens after the first)."""
    return int((mask[:, 1:] & mask[:, :-1]).sum())


def experts_of(model: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(gate_up_proj, down_proj) of every MoE block of an unsharded model, layer order."""
    from routepack.integrations.hf_shard import moe_blocks

    return [(b.experts.gate_up_proj.detach().clone(), b.experts.down_proj.detach().clone()) for b in moe_blocks(model)]


def train_single(case: Case) -> Dict[str, Any]:
    """The reference: the whole window in one forward pass per step, routing replayed."""
    model = build_model(case)
    batches = capture_windows(model, case)
    opt = adam(model, case)
    losses = []
    for b in batches:
        with hf.replay_routing(model, b.routed, attention_mask=b.mask):
            logits = model(input_ids=b.input_ids, attention_mask=b.mask, use_cache=False).logits
        loss = loss_sum(logits, b.input_ids, b.mask) / label_count(b.mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "experts": [(a.numpy(), b.numpy()) for a, b in experts_of(model)],
        "dense": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
    }


def _micro_inputs(b: Batch, samples: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """(input_ids, attention mask, real): the microbatch's rows trimmed to its longest sample;
    without samples one dummy token whose loss is multiplied by 0 (the rank still runs
    every MoE layer's exchanges, dispatching nothing)."""
    if samples.size == 0:
        return torch.full((1, 1), 3, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), False
    idx = torch.from_numpy(samples)
    mask = b.mask.index_select(0, idx)
    width = int(mask.sum(1).max())
    return b.input_ids.index_select(0, idx)[:, :width], mask[:, :width], True


def train_rank(rank: int, world: int, device: Any, cases: Tuple[Case, ...]) -> Dict[str, Any]:
    """Runs every case on this rank; returns per family its figures (see the test)."""
    out = {}
    for case in cases:
        out[case.family] = _train_case(rank, case)
    return out


def _train_case(rank: int, case: Case) -> Dict[str, Any]:
    topo = case.topology()
    model = build_model(case)
    batches = capture_windows(model, case)
    plans = plan_windows(model, batches, case)
    sh = hf.shard(model, plans[0], topo=topo)
    sh.recording = True
    opt = adam(model, case)
    owned = [p for g in opt.param_groups for p in g["params"]]
    used = [t for blk in sh.blocks for t in (blk.experts.ep.w1, blk.experts.ep.w2)]  # what forward computes with
    figs: Dict[str, Any] = {
        # the tensors the experts compute with are the optimizer's parameters themselves
        "experts_owned": all(any(t is p and t.data_ptr() == p.data_ptr() for p in owned) for t in used),
        "no_full_experts": not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters()),
        "losses": [],
        "routing_equal": True,
        "moved_rows": 0,
        "replica_rows": 0,
        "replica_tokens": 0,
        "migrated_bytes": 0,
    }
    for w, (b, plan) in enumerate(zip(batches, plans)):
        report = sh.begin_window(plan, b.window, opt)
        figs["moved_rows"] += int(plan.migration.size)
        figs["replica_rows"] += int(plan.replicas.size)
        if report is not None:
            figs["migrated_bytes"] += report.sent_bytes + report.received_bytes
        n_labels = label_count(b.mask)
        local = 0.0
        for mb in rank_microbatches(plan, b.routed.routed, rank, b.routed.cu_seqlens, dp=topo.dp):
            ids, mask, real = _micro_inputs(b, mb.samples)
            sh.start_micro(mb.micro, tokens=mask if real else torch.zeros_like(mask))
            if real:
                with hf.replay_routing(model, mb.routed, attention_mask=mask):
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                loss = loss_sum(logits, ids, mask) / n_labels
                seen = sh.take_routed()
                figs["routing_equal"] &= bool(np.array_equal(seen, mb.routed.numpy().astype(np.int64)))
            else:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                loss = logits.sum() * 0.0
                figs["routing_equal"] &= sh.take_routed().shape[0] == 0
            figs["replica_tokens"] += _replica_tokens(sh.layers)
            loss.backward()
            local += float(loss.detach())
        sh.finish_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        figs["losses"].append(float(total))
    sh.recording = False
    figs["experts"] = [(a.numpy(), b.numpy()) for a, b in sh.gather_experts()]
    figs["dense"] = {
        n: p.detach().numpy().copy() for n, p in model.named_parameters() if not n.endswith((".ep.w1", ".ep.w2"))
    }
    figs["phy2log"] = [mod.phy2log.tolist() for mod in sh.layers]
    figs["bad_mask"] = _bad_mask_on_one_rank(sh, model, rank)
    return figs


def _replica_tokens(layers: Any) -> int:
    """(token, expert) rows this rank computed on replica copies in the last forward."""
    rows = 0
    for mod in layers:
        route = mod.last_route
        rows += 0 if route is None else int((route.recv_unit >= mod.slots_per_rank).sum())
    return rows


def _bad_mask_on_one_rank(sh: Any, model: Any, rank: int) -> str:
    """Rank 1 marks tokens with a mask of the wrong size: every rank must raise (none hangs).
    No replica prefetch: nothing may stay posted once the forward has raised."""
    ids = torch.full((1, 1), 3, dtype=torch.long)
    sh.start_micro(0, tokens=torch.ones(1, 2 if rank == 1 else 1, dtype=torch.long), prefetch=False)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except rp.RoutepackError as e:
        return str(e)
    return "nothing raised"
