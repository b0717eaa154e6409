"""The transformers MoE families `routepack.integrations.hf` knows: each router class, the
gate-weight formula its ``forward`` applies to the experts it chose, and where its config
keeps the shapes `model_shape` reads.

Why a formula per family: replay (R3) must route the recorded experts, yet give them the
weights the family's own code would, so that training under replay is the same function
of the router's parameters. Each formula below is the family's ``forward`` (identical from the
family's ``since`` release through 5.25) with ``torch.topk``'s choice replaced by given ids; the
replay hook checks on every call that the formula, fed the router's own choice, returns
the router's own weights bit for bit, so a transformers release that changes a router
fails loudly instead of training a different function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch

#: The oldest transformers release `routepack.integrations.hf` runs with (tested: 5.10.4, what
#: ``pip install ".[verl,hf]"`` gets beside verl 0.9.1, and the newest).
MIN_TRANSFORMERS = (5, 10)
#: (router module, router_logits [N, E], expert ids [N, k] int64) -> gate weights [N, k].
WeightFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_then_topk(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over all experts in fp32, the chosen
    probabilities, renormalised when ``norm_topk_prob``, cast back to the logits' dtype."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    w = probs.gather(1, ids)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def mixtral(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax over all experts in fp32, chosen probabilities always renormalised,
    left in fp32 (no cast back)."""
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    w = probs.gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True)


def sigmoid_grouped(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM-4.5 (Glm4Moe): the chosen experts' sigmoid scores (the
    ``e_score_correction_bias`` steers only the choice, never the weights), renormalised
    with a 1e-20 guard when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    w = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def topk_then_softmax(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the k chosen logits only (the router has a bias)."""
    top = logits.gather(1, ids)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


@dataclass(frozen=True)
class Family:
    """One supported family.

    * ``name``: as its model card says it; ``module``/``router``: where transformers
      defines its router class and the class's name (matched exactly, subclasses excluded:
      they may override ``forward``).
    * ``weights``: the gate-weight formula (above).
    * ``expert_ffn``: the config field holding one routed expert's FFN width;
      ``shared``: config -> shared (always-on) experts per MoE layer; ``groups``: config ->
      expert groups of group-limited routing (1: none).
    * ``since``: the first transformers release whose router returns ``(router_logits,
      weights, ids)`` as routepack reads it (DeepSeek-V3's and GLM-4.5's returned the logits
      alone before 5.13; the others' routers are the same from 5.10, the oldest tested).
    """

    name: str
    module: str
    router: str
    weights: WeightFn
    expert_ffn: str
    shared: Callable[[Any], int]
    groups: Callable[[Any], int]
    since: Tuple[int, int] = MIN_TRANSFORMERS


def _none(config: Any) -> int:
    return 0


def _one(config: Any) -> int:
    return 1


def _n_shared(config: Any) -> int:
    return int(getattr(config, "n_shared_experts", 0) or 0)


def _qwen2_shared(config: Any) -> int:
    return 1 if getattr(config, "shared_expert_intermediate_size", 0) else 0


def _n_group(config: Any) -> int:
    return int(getattr(config, "n_group", 1) or 1)


_M = "transformers.models."

FAMILIES = (  # the table in `routepack.integrations.hf`'s docstring describes each
    Family(
        "Qwen3-MoE",
        _M + "qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeTopKRouter",
        softmax_then_topk,
        "moe_intermediate_size",
        _none,
        _one,
    ),
    Family(
        "Qwen2-MoE",
        _M + "qwen2_moe.modeling_qwen2_moe",
        "Qwen2MoeTopKRouter",
        softmax_then_topk,
        "moe_intermediate_size",
        _qwen2_shared,
        _one,
    ),
    Family(
        "OLMoE", _M + "olmoe.modeling_olmoe", "OlmoeTopKRouter", softmax_then_topk, "intermediate_size", _none, _one
    ),
    Family("Mixtral", _M + "mixtral.modeling_mixtral", "MixtralTopKRouter", mixtral, "intermediate_size", _none, _one),
    Family(
        "DeepSeek-V3",
        _M + "deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3TopkRouter",
        sigmoid_grouped,
        "moe_intermediate_size",
        _n_shared,
        _n_group,
        (5, 13),
    ),
    Family(
        "GLM-4.5",
        _M + "glm4_moe.modeling_glm4_moe",
        "Glm4MoeTopkRouter",
        sigmoid_grouped,
        "moe_intermediate_size",
        _n_shared,
        _n_group,
        (5, 13),
    ),
    Family(
        "GPT-OSS",
        _M + "gpt_oss.modeling_gpt_oss",
        "GptOssTopKRouter",
        topk_then_softmax,
        "intermediate_size",
        _none,
        _one,
    ),
)

#: (router module, router class name) -> its family.
BY_ROUTER: Dict[tuple, Family] = {(f.module, f.router): f for f in FAMILIES}


def family_of(module: Any) -> "Family | None":
    """The family whose router ``module`` is (exact class), else None."""
    cls = type(module)
    return BY_ROUTER.get((cls.__module__, cls.__qualname__))
