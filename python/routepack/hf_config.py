"""A `ModelShape` from a Hugging Face ``config.json``: what `routepack bench --model` reads.

The MoE layers are the ones a router runs in (the window's L): of ``num_hidden_layers``, the
first ``first_k_dense_replace`` are dense (DeepSeek-V3, Kimi-K2), Qwen's ``mlp_only_layers`` are
dense and ``decoder_sparse_step`` s makes layer i MoE where ``(i + 1) % s == 0``; DeepSeek's
``num_nextn_predict_layers`` MTP modules each hold one MoE layer more. Routed experts from
``n_routed_experts`` / ``num_experts`` / ``num_local_experts``; top-k ``num_experts_per_tok``;
the expert FFN ``moe_intermediate_size`` (else ``intermediate_size``); shared experts
``n_shared_experts`` (or one where ``shared_expert_intermediate_size`` is set); expert groups
``n_group``; a layer's attention ``"linear"`` where ``layer_types`` says so (Qwen3-Next's
``linear_attention``), else ``"full"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping

from routepack.errors import RoutepackError
from routepack.model import ModelShape
from routepack.routes.layers import MoELayers


def _first(cfg: Mapping[str, Any], names: tuple, what: str, path: str) -> int:
    for n in names:
        if cfg.get(n) is not None:
            return int(cfg[n])
    raise RoutepackError(f"{path}: no {what} ({' / '.join(names)}): is it a MoE model's config.json?")


def moe_layers(cfg: Mapping[str, Any], path: str) -> List[int]:
    """The indices (of ``num_hidden_layers``, then the MTP modules') of the layers a router runs
    in: `routepack.routes.MoELayers`'s reading of the config (errors name ``path``)."""
    try:
        layers = MoELayers.from_config(cfg)
    except RoutepackError as e:
        raise RoutepackError(f"{path}: {e}") from None
    return list(layers.rows) + [layers.num_layers + j for j in range(layers.mtp)]


def model_from_config(cfg: Mapping[str, Any], path: str = "config") -> ModelShape:
    """``cfg`` (a parsed ``config.json``, or its ``text_config``) → `ModelShape` (errors name ``path``)."""
    if not isinstance(cfg, Mapping):
        raise RoutepackError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    layers = moe_layers(cfg, path)
    if not layers:
        raise RoutepackError(f"{path}: no MoE layer (every layer is dense)")
    experts = _first(cfg, ("n_routed_experts", "num_experts", "num_local_experts"), "routed expert count", path)
    top_k = _first(cfg, ("num_experts_per_tok", "moe_topk", "top_k"), "experts per token", path)
    hidden = _first(cfg, ("hidden_size",), "hidden size", path)
    ffn = _first(cfg, ("moe_intermediate_size", "intermediate_size"), "expert FFN size", path)
    shared = cfg.get("n_shared_experts")
    if shared is None:
        shared = 1 if cfg.get("shared_expert_intermediate_size") else 0
    kinds = cfg.get("layer_types") or []
    total = int(cfg["num_hidden_layers"])
    attention = ["linear" if i < total and i < len(kinds) and "linear" in str(kinds[i]) else "full" for i in layers]
    try:
        return ModelShape(
            num_layers=len(layers),
            num_experts=experts,
            top_k=top_k,
            hidden=hidden,
            expert_ffn=ffn,
            attention=attention,
            shared_experts=int(shared),
            expert_groups=int(cfg.get("n_group") or 1),
        )
    except RoutepackError as e:
        raise RoutepackError(f"{path}: {e}") from None


def load_model(path: str) -> ModelShape:
    """`model_from_config` of the JSON file at ``path``: a Hugging Face ``config.json``, or a
    `ModelShape`'s own fields (``num_layers``, ``num_experts``, ...)."""
    try:
        data: Dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RoutepackError(f"--model {path}: cannot read a JSON file ({e})") from None
    if isinstance(data, dict) and "num_layers" in data and "num_hidden_layers" not in data:
        try:
            return ModelShape(**data)
        except (TypeError, RoutepackError) as e:
            raise RoutepackError(f"--model {path}: {e}") from None
    return model_from_config(data, f"--model {path}")


__all__ = ["load_model", "model_from_config", "moe_layers"]
