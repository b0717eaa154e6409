"""Routing replay for Hugging Face transformers MoE models: record the experts every MoE
layer chose during a forward pass (what SGLang / vLLM return as ``routed_experts``), plan
from it, and make a later forward pass route exactly as recorded (R3).

* `capture` / `capture_routed`: one forward pass of ``input_ids`` (rows = samples, padding
  left or right excluded through ``attention_mask``) → a `routepack.Window`, or the raw
  top-k ids ``[T, L, k]`` of the real tokens with ``cu_seqlens [S+1]`` and E.
* `record_routing`: the same recording around a forward pass you run yourself.
* `replay_routing`: a context manager under which every router returns the recorded ids,
  with the gate weights its own family's code computes for those experts, so gradients
  reach the router's weight through the recorded experts' probabilities (training under
  replay is the same function of the parameters).
* `moe_routers` (the routers, in layer order) and `model_shape` (a `routepack.ModelShape`
  read from the model) for planning.

Needs transformers >= 5.10 (its MoE routers return ``(router_logits, weights, ids)``;
DeepSeek-V3's and GLM-4.5's from 5.13, refused by name before) and PyTorch:
``pip install 'routepack[hf]'``. Nothing is downloaded: any model object works,
a checkpoint or a tiny random one built from a config.

Supported families (the router class is matched exactly; a model without one raises
`RoutepackError` naming its class). L counts MoE layers only, in model order; dense layers
and shared experts are not routed and not recorded.

| family (router class) | how the router chooses | weights, quirks |
|---|---|---|
| Qwen3-MoE (`Qwen3MoeTopKRouter`) | softmax over E (fp32), top-k | renormalised if `norm_topk_prob`, cast to the logits' dtype; `mlp_only_layers` / `decoder_sparse_step` layers are dense |
| Qwen2-MoE (`Qwen2MoeTopKRouter`) | as Qwen3-MoE | as Qwen3-MoE; plus a shared expert behind a sigmoid gate on every token |
| OLMoE (`OlmoeTopKRouter`) | as Qwen3-MoE | not renormalised by default; every layer MoE |
| Mixtral (`MixtralTopKRouter`) | softmax over E (fp32), top-k | always renormalised, left fp32; `router_jitter_noise` (training mode) scales the hidden states: replay does not fix that noise |
| DeepSeek-V3 (`DeepseekV3TopkRouter`) | sigmoid (fp32) + `e_score_correction_bias`; group-limited: `topk_group` of `n_group` groups by their top-2 sum, then top-k, ids unsorted | sigmoid scores without the bias, renormalised (+1e-20) if `norm_topk_prob`, x `routed_scaling_factor`; the first `first_k_dense_replace` layers dense; `n_shared_experts` shared experts |
| GLM-4.5 (`Glm4MoeTopkRouter`) | as DeepSeek-V3 | as DeepSeek-V3 |
| GPT-OSS (`GptOssTopKRouter`) | top-k of the logits (the router has a bias) | softmax over the k chosen logits only; the MoE block returns (hidden, scores) |

Replay keeps each token's recorded order of its k ids (DeepSeek-V3's are unsorted): the
renormalising sum then adds the same numbers in the same order, so a replay of unchanged
weights reproduces the recorded forward pass bit for bit. The logits a router returns stay
the live ones, so a load-balancing loss from ``output_router_logits=True`` (which redoes
top-k itself) sees the live choice, not the replayed one.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

_NEEDS = "routepack.integrations.hf needs transformers >= 5.10 and PyTorch: pip install 'routepack[hf]'"
try:
    import transformers  # first: without it, fail before the slower torch import
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(_NEEDS) from e

from routepack.integrations.hf.families import MIN_TRANSFORMERS  # noqa: E402

_v = re.match(r"(\d+)\.(\d+)", transformers.__version__)
#: (major, minor) of the transformers imported.
TRANSFORMERS = (int(_v.group(1)), int(_v.group(2))) if _v is not None else (0, 0)
if TRANSFORMERS < MIN_TRANSFORMERS:  # pragma: no cover - depends on the env
    raise ImportError(f"{_NEEDS} (found transformers {transformers.__version__})")

from routepack.errors import RoutepackError, RoutepackTypeError  # noqa: E402
from routepack.integrations.hf.families import FAMILIES, Family, family_of  # noqa: E402
from routepack.model import ModelShape  # noqa: E402
from routepack.window import Window  # noqa: E402


class Routed(NamedTuple):
    """What a forward pass routed, in the flat layout `Window.from_routed_experts` counts.

    * ``routed``: ``[T, L, k]`` logical expert ids of the real tokens (int16; int32 when
      E > 32767), samples (rows of ``input_ids``) in order, each sample's tokens in order;
      each token's k ids in the order its router returned them.
    * ``cu_seqlens``: int64 ``[S+1]``, token offsets of the samples in ``routed``.
    * ``num_experts``: E.
    """

    routed: np.ndarray
    cu_seqlens: np.ndarray
    num_experts: int


class Router(NamedTuple):
    """One MoE layer's router: its module path, the module, its family."""

    name: str
    module: Any
    family: Family


def moe_routers(model: Any) -> List[Router]:
    """The model's MoE routers in layer order (the order of ``model.named_modules()``).

    Raises `RoutepackTypeError` unless ``model`` is a ``torch.nn.Module``, `RoutepackError`
    naming the model's class when it has no router of a supported family, or when its
    routers disagree on E or k (one ``[T, L, k]`` recording needs one of each)."""
    if not isinstance(model, torch.nn.Module):
        raise RoutepackTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    found = [Router(n, m, f) for n, m in model.named_modules() for f in [family_of(m)] if f is not None]
    if not found:
        names = ", ".join(f"{f.name} ({f.router})" for f in FAMILIES)
        raise RoutepackError(f"model: {type(model).__name__} has no MoE router routepack supports (supported: {names})")
    fam = found[0].family
    if TRANSFORMERS < fam.since:  # its router returns the logits alone: nothing to record or replay
        since = ".".join(map(str, fam.since))
        raise RoutepackError(
            f"model: {fam.name}'s router ({fam.router}) returns (router_logits, weights, ids) from transformers "
            f"{since} on; this is transformers {transformers.__version__} (pip install 'transformers>={since}')"
        )
    first = found[0]
    for r in found[1:]:
        if (r.module.num_experts, r.module.top_k) != (first.module.num_experts, first.module.top_k):
            raise RoutepackError(
                f"model: router {r.name} has E={r.module.num_experts}, k={r.module.top_k} but {first.name} has "
                f"E={first.module.num_experts}, k={first.module.top_k}"
            )
    return found


def model_shape(model: Any) -> ModelShape:
    """The `routepack.ModelShape` of a supported model, read from its config and routers:
    L = its MoE layers, E, k, hidden, the routed experts' FFN width, shared experts per
    layer and the expert groups of group-limited routing (DeepSeek-V3's ``n_group``). Every
    MoE layer's attention is counted as "full" (these families have no linear attention)."""
    routers = moe_routers(model)
    fam, router, config = routers[0].family, routers[0].module, model.config
    return ModelShape(
        num_layers=len(routers),
        num_experts=int(router.num_experts),
        top_k=int(router.top_k),
        hidden=int(config.hidden_size),
        expert_ffn=int(getattr(config, fam.expert_ffn)),
        attention=("full",) * len(routers),
        shared_experts=fam.shared(config),
        expert_groups=fam.groups(config),
    )


def _router_output(r: Router, output: Any) -> Tuple[Any, Any, Any]:
    """(logits [N, E], weights [N, k], ids [N, k]) of one router call; raises if the
    router's ``forward`` does not return that (a transformers release that changed it)."""
    if not (
        isinstance(output, tuple)
        and len(output) == 3
        and all(isinstance(t, torch.Tensor) for t in output)
        and output[2].dim() == 2
    ):
        raise RoutepackError(
            f"model: router {r.name} ({r.family.router}) did not return (router_logits, weights, ids) "
            f"under transformers {transformers.__version__}; routepack supports this family from "
            f"{'.'.join(map(str, r.family.since))}"
        )
    return output[0], output[1], output[2]


def _real_tokens(attention_mask: Any, name: str = "attention_mask") -> np.ndarray:
    """bool ``[B, S]``: True at real tokens. Every row (sample) needs one."""
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask.detach().cpu().numpy()
    mask = np.asarray(attention_mask)
    if mask.ndim != 2:
        raise RoutepackError(f"{name}: expected [B, S] (one row per sample), got shape {mask.shape}")
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise RoutepackTypeError(f"{name}: expected bool or integer, got dtype {mask.dtype}")
    if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
        raise RoutepackError(f"{name}: entries must be 0 or 1, got values {np.unique(mask)[:8].tolist()}")
    keep = mask.astype(bool)
    empty = np.flatnonzero(~keep.any(axis=1))
    if empty.size:
        raise RoutepackError(f"{name}: sample (row) {empty[0]} has no real tokens")
    return keep


def _ids_dtype(num_experts: int) -> type:
    return np.int16 if num_experts <= np.iinfo(np.int16).max + 1 else np.int32


class RoutingRecorder:
    """Records the ids each router returns while active (a context manager; see
    `record_routing`). One forward pass per recording: `routed` raises if a router ran
    more or less than once (e.g. a gradient-checkpointing recompute inside the block)."""

    def __init__(self, model: Any) -> None:
        self.routers = moe_routers(model)
        self._calls: List[List[Any]] = [[] for _ in self.routers]
        self._handles: List[Any] = []

    def __enter__(self) -> "RoutingRecorder":
        for calls in self._calls:
            calls.clear()
        for r, calls in zip(self.routers, self._calls):
            self._handles.append(r.module.register_forward_hook(self._hook(r, calls)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _hook(r: Router, calls: List[Any]) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            calls.append(_router_output(r, output)[2].detach())

        return hook

    def routed(self, attention_mask: Any) -> Routed:
        """The recording as `Routed`. ``attention_mask``: ``[B, S]`` of the forward pass, 1
        at real tokens (``torch.ones_like(input_ids)`` without padding); samples are its rows."""
        keep = _real_tokens(attention_mask)
        n = keep.size
        for r, calls in zip(self.routers, self._calls):
            if len(calls) != 1:
                raise RoutepackError(
                    f"model: router {r.name} ran {len(calls)} times while recording; record exactly one forward pass"
                )
            if calls[0].shape[0] != n:
                raise RoutepackError(
                    f"attention_mask: is {keep.shape[0]}x{keep.shape[1]} = {n} tokens but router "
                    f"{r.name} routed {calls[0].shape[0]}"
                )
        ids = torch.stack([c[0] for c in self._calls], dim=1)  # [N, L, k], rows b*S + s
        e = int(self.routers[0].module.num_experts)
        real = torch.from_numpy(np.flatnonzero(keep.reshape(-1))).to(ids.device)
        routed: np.ndarray = ids.index_select(0, real).cpu().numpy().astype(_ids_dtype(e))
        cu = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int64)
        return Routed(routed, cu, e)


def record_routing(model: Any) -> RoutingRecorder:
    """Records the routing of one forward pass you run yourself::

    with record_routing(model) as rec:
        out = model(input_ids=ids, attention_mask=mask)
    routed, cu_seqlens, num_experts = rec.routed(mask)
    """
    return RoutingRecorder(model)


def _vocabulary(model: Any) -> Optional[int]:
    """The number of token ids the model embeds (its input embedding's rows, else
    ``config.vocab_size``), or None where it does not say."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(emb, torch.nn.Embedding):
        return int(emb.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def _check_input_ids(model: Any, input_ids: Any) -> None:
    """``input_ids`` as the forward pass needs them, else an error naming ``input_ids``: a
    2-D integer tensor with at least one row (sample) and one column, every id (padding
    included: the embedding looks every one up) inside the model's vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise RoutepackError(f"input_ids: expected a [B, S] torch tensor (one row per sample), got {shape}")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise RoutepackTypeError(f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise RoutepackError(f"input_ids: has no samples (shape {tuple(input_ids.shape)}); one row per sample")
    if input_ids.shape[1] == 0:
        raise RoutepackError(f"input_ids: its rows have no tokens (shape {tuple(input_ids.shape)})")
    vocab = _vocabulary(model)
    if vocab is not None:
        bad = ((input_ids < 0) | (input_ids >= vocab)).nonzero()
        if bad.shape[0]:
            b, t = (int(i) for i in bad[0])
            raise RoutepackError(
                f"input_ids: token id {int(input_ids[b, t])} at [{b}, {t}] is outside the model's vocabulary "
                f"[0, {vocab})"
            )


def _input_mask(input_ids: Any, attention_mask: Any) -> Any:
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.as_tensor(np.asarray(attention_mask), device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise RoutepackError(
            f"attention_mask: shape {tuple(attention_mask.shape)} differs from input_ids' {tuple(input_ids.shape)}"
        )
    return attention_mask


def capture_routed(model: Any, input_ids: Any, attention_mask: Any = None, **forward_kwargs: Any) -> Routed:
    """Runs ``model(input_ids=..., attention_mask=...)`` once without gradients and returns
    what every MoE layer routed for the real tokens (`Routed`: ``[T, L, k]`` ids,
    ``cu_seqlens [S+1]``, E). Rows of ``input_ids`` are the samples; ``attention_mask``
    ``[B, S]`` (1 real, 0 padding; left or right padding alike), default all real.
    ``forward_kwargs`` go to the forward call (``use_cache`` defaults to False). The model's
    train/eval mode is left as it is (``model.eval()`` for a dropout-free pass)."""
    moe_routers(model)  # a model routepack cannot record is named before its inputs
    _check_input_ids(model, input_ids)
    mask = _input_mask(input_ids, attention_mask)
    _real_tokens(mask)  # refuse a bad mask before running the model
    forward_kwargs.setdefault("use_cache", False)
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=input_ids, attention_mask=mask, **forward_kwargs)
    return rec.routed(mask)


def capture(model: Any, input_ids: Any, attention_mask: Any = None, **forward_kwargs: Any) -> Window:
    """`capture_routed`, counted into a `routepack.Window` (``Window.from_routed_experts``)."""
    routed, cu, e = capture_routed(model, input_ids, attention_mask, **forward_kwargs)
    return Window.from_routed_experts(routed, cu, e)


class replay_routing:  # noqa: N801 - a context manager used like a function
    """Under this context every router of ``model`` routes the recorded ids (R3)::

        rec = capture_routed(model, ids, mask)            # rollout
        with replay_routing(model, rec, attention_mask=mask):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()

    Args:
        model: a supported transformers model (`moe_routers`).
        routed: ``[T, L, k]`` ids (numpy or torch, any integer dtype) of the real tokens in
            `Routed`'s layout, or a `Routed` (its ``cu_seqlens`` then checks the layout).
        attention_mask: ``[B, S]`` of the forward passes to come, 1 at real tokens: the
            recorded ids go to those positions in row order, padding keeps the router's own
            choice. Without it every token is real and the router sees exactly T tokens
            (e.g. samples packed into one row).
        cu_seqlens: int ``[S+1]`` of ``routed``; checked against ``attention_mask``'s rows.

    Each router still computes its logits; the ids it returns are the recorded ones (its
    own choice at padding) and the weights are its family's formula applied to them, so the
    router's weight gets gradients through the recorded experts' probabilities. Every call
    checks that the formula reproduces the router's own weights for its own choice (bit for
    bit; else `RoutepackError`), and that the router sees the expected number of tokens.
    Stateless per layer: gradient checkpointing recomputes replay the same way. Nested
    inside it, `record_routing` records the replayed ids.
    """

    def __init__(self, model: Any, routed: Any, attention_mask: Any = None, cu_seqlens: Any = None) -> None:
        self.routers = moe_routers(model)
        e, k = int(self.routers[0].module.num_experts), int(self.routers[0].module.top_k)
        if isinstance(routed, Routed):
            if cu_seqlens is None:
                cu_seqlens = routed.cu_seqlens
            if routed.num_experts != e:
                raise RoutepackError(f"routed: recorded with num_experts={routed.num_experts}, the model has {e}")
            routed = routed.routed
        if isinstance(routed, torch.Tensor):
            routed = routed.detach().cpu().numpy()
        try:
            arr = np.asarray(routed)
        except ValueError as err:  # ragged nesting
            raise RoutepackTypeError(
                f"routed: expected a [T, L, k] integer array, got {type(routed).__name__}"
            ) from err
        if arr.dtype.kind not in "iu":
            raise RoutepackTypeError(f"routed: expected integer expert ids, got dtype {arr.dtype}")
        layers = len(self.routers)
        if arr.ndim != 3 or arr.shape[1:] != (layers, k) or arr.shape[0] == 0:
            raise RoutepackError(f"routed: expected [T >= 1, L={layers}, k={k}] for this model, got {arr.shape}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= e:
            raise RoutepackError(f"routed: expert id {lo if lo < 0 else hi} outside [0, {e})")
        t = arr.shape[0]
        # [L, T, k] int64 (native order: torch reads no other): one layer's ids contiguous
        self._ids = torch.from_numpy(np.ascontiguousarray(arr.astype(np.int64).transpose(1, 0, 2)))
        self._pos: Optional[torch.Tensor] = None
        self._tokens = t
        lens = None
        if attention_mask is not None:
            keep = _real_tokens(attention_mask)
            if int(keep.sum()) != t:
                raise RoutepackError(f"attention_mask: has {int(keep.sum())} real tokens, routed has T={t}")
            self._pos = torch.from_numpy(np.flatnonzero(keep.reshape(-1)))
            self._tokens = keep.size
            lens = keep.sum(axis=1)
        if cu_seqlens is not None:
            cu = np.asarray(cu_seqlens, dtype=np.int64)
            if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 1):
                raise RoutepackError(f"cu_seqlens: expected strictly increasing [S+1] from 0 to T={t}, got {cu[:8]}")
            if lens is not None and (cu.size - 1 != lens.size or np.any(np.diff(cu) != lens)):
                raise RoutepackError(
                    f"cu_seqlens: sample lengths {np.diff(cu)[:8]} differ from attention_mask's "
                    f"real tokens per row {lens[:8]}"
                )
        self._on: Dict[Any, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self._handles: List[Any] = []

    def _on_device(self, device: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if device not in self._on:
            pos = None if self._pos is None else self._pos.to(device)
            self._on[device] = (self._ids.to(device), pos)
        return self._on[device]

    def _hook(self, layer: int, r: Router) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Tuple[Any, Any, Any]:
            logits, live_w, live_ids = _router_output(r, output)
            with torch.no_grad():
                own = r.family.weights(module, logits, live_ids)
            same = (
                own.dtype == live_w.dtype
                and own.shape == live_w.shape
                and bool(((own == live_w) | (own.isnan() & live_w.isnan())).all())
            )
            if not same:
                raise RoutepackError(
                    f"model: router {r.name} ({r.family.router}) computes its weights differently from "
                    f"routepack's {r.family.name} formula under transformers {transformers.__version__}; "
                    "replay would train a different function"
                )
            if live_ids.shape[0] != self._tokens:
                raise RoutepackError(
                    f"model: router {r.name} sees {live_ids.shape[0]} tokens, the replay expects "
                    f"{self._tokens} (the attention_mask / routed it was given)"
                )
            all_ids, pos = self._on_device(live_ids.device)
            if pos is None:
                ids = all_ids[layer]
            else:
                ids = live_ids.clone()
                ids[pos] = all_ids[layer]
            return logits, r.family.weights(module, logits, ids), ids

        return hook

    def __enter__(self) -> "replay_routing":
        for layer, r in enumerate(self.routers):
            self._handles.append(r.module.register_forward_hook(self._hook(layer, r)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# expert-parallel training under a plan (its own module: `routepack.integrations.hf.sharding`)
from routepack.integrations.hf.sharding import EPExperts, ShardedMoE, shard  # noqa: E402

__all__ = [
    "EPExperts",
    "Routed",
    "Router",
    "RoutingRecorder",
    "ShardedMoE",
    "capture",
    "capture_routed",
    "model_shape",
    "moe_routers",
    "record_routing",
    "replay_routing",
    "shard",
]
