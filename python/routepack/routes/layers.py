"""Which layers of a model route tokens, and how plans key them: `MoELayers`.

Route tensors carry one row per decoder layer (verl, vLLM, SGLang and slime record
``L = num_hidden_layers`` rows; a dense layer's row is zero filler), while a plan holds one
layer per MoE layer. `MoELayers` reads a model's layer pattern from its config and says which
rows to count (``moe_layers``, what `Window.from_routed_experts` takes) and which Megatron
layer each plan layer is.

Plan keys: plan layer ``i`` is the ``i``-th MoE layer of the decoder in layer order
(``rows[i]``, 0-based; Megatron's ``TransformerLayer.layer_number`` ``rows[i] + 1``).
Multi-token-prediction (MTP) layers come after the decoder: MTP layer ``j`` is transformer
layer ``num_layers + j`` (Megatron builds its inner ``TransformerLayer`` with ``layer_number``
``num_layers + j + 1``: ``megatron/core/transformer/multi_token_prediction.py``,
``MultiTokenPredictionLayer.__init__``) and routes when the decoder's last layer does (its
spec is the last decoder layer's: ``megatron/core/models/gpt/gpt_layer_specs.py``,
``get_gpt_mtp_block_spec``). No rollout engine records MTP rows, and verl's replay carries
none (``verl/utils/megatron/router_replay_utils.py``, ``iter_model_routers``: MTP layers
route live), so a plan keys MTP layers only where the route tensor has rows for them
(``num_layers + mtp`` rows: plan layers ``len(rows) + j``); otherwise `MoELayers.unplanned`
names them with the reason.

The patterns read, each from the framework's own rule:

* Megatron-Core (``TransformerConfig``, Megatron-LM / slime ``args``): ``num_layers``,
  ``moe_layer_freq`` an int (layer ``i`` is MoE when ``i % freq == 0``) or a 0/1 list
  (``gpt_layer_specs.py``, ``get_gpt_decoder_block_spec``), ``mtp_num_layers``;
* transformers configs (``num_hidden_layers``; ``text_config`` of a multimodal one):
  ``mlp_layer_types`` (``"sparse"`` / ``"dense"``), ``moe_layers`` (Llama-4),
  ``first_k_dense_replace`` (DeepSeek-V2/V3, Kimi-K2, GLM-4.5, Moonlight: MoE from layer k,
  every ``moe_layer_freq``-th when the config has one), ``mlp_only_layers`` and
  ``decoder_sparse_step`` (Qwen2/3-MoE, Qwen3-Next: MoE when not listed and ``(i + 1) % step
  == 0``), ``moe_layer_start_index`` / ``moe_layer_end_index`` / ``moe_layer_interval``
  (ERNIE-4.5); otherwise every layer; MTP from ``num_nextn_predict_layers`` or
  ``mtp_num_hidden_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from routepack._checks import as_int_array, positive_int
from routepack.errors import RoutepackError, RoutepackTypeError

#: Config attributes naming the MTP layers: Megatron's, then transformers'.
MTP_KEYS = ("mtp_num_layers", "num_nextn_predict_layers", "mtp_num_hidden_layers")


def check_moe_layers(moe_layers: Any, num_layers: int, name: str = "moe_layers") -> Optional[np.ndarray]:
    """``moe_layers`` as int64 ``[L']``, rows of a ``num_layers``-row layer axis, strictly
    increasing and at least one; None stays None (every row is an MoE layer)."""
    if moe_layers is None:
        return None
    if isinstance(moe_layers, MoELayers):
        raise RoutepackTypeError(
            f"{name}: got a MoELayers; pass its moe_layers(num_rows) (the rows of this route tensor to count)"
        )
    rows = as_int_array(moe_layers, name, 1, np.int64)
    if rows.size == 0:
        raise RoutepackError(f"{name}: lists no layer; a window needs at least one MoE layer")
    bad = np.flatnonzero((rows < 0) | (rows >= num_layers))
    if bad.size:
        raise RoutepackError(
            f"{name}: lists layer {rows[bad[0]]}, but the routes have L = {num_layers} layers (rows 0..{num_layers - 1})"
        )
    step = np.flatnonzero(np.diff(rows) <= 0)
    if step.size:
        i = int(step[0])
        raise RoutepackError(
            f"{name}: must be strictly increasing: {name}[{i}] = {rows[i]}, {name}[{i + 1}] = {rows[i + 1]}"
        )
    return rows


def dense_hint(error: RoutepackError, moe_layers: Any) -> RoutepackError:
    """A counting error naming a layer that lists expert 0 twice, restated with the likely
    cause when no ``moe_layers`` was given: the zero filler engines record for a dense layer."""
    text = str(error)
    if moe_layers is not None or "lists expert 0 twice" not in text:
        return error
    return type(error)(
        f"{text}; a row of zeros is the filler verl, vLLM, SGLang and slime record for a dense layer: pass "
        "moe_layers (routepack.routes.MoELayers.from_config(model_config).moe_layers(L))"
    )


@dataclass(frozen=True)
class MoELayers:
    """A model's MoE layers.

    Attributes:
        num_layers: decoder layers (the rows an engine's route tensor has).
        rows:       0-based decoder layer of each MoE layer, increasing: plan layer ``i`` is
                    decoder layer ``rows[i]``, Megatron ``layer_number`` ``rows[i] + 1``.
        mtp:        MTP layers whose MLP is MoE (the decoder's last layer is); MTP layer
                    ``j`` is transformer layer ``num_layers + j``.
        num_mtp:    MTP layers of the model (``mtp_num_layers``), MoE or not.
        source:     which config fields the pattern came from (for messages).
    """

    num_layers: int
    rows: Tuple[int, ...]
    mtp: int = 0
    num_mtp: int = 0
    source: str = "given"

    def __post_init__(self) -> None:
        positive_int(self.num_layers, "num_layers")
        checked = check_moe_layers(list(self.rows), self.num_layers, "rows")
        object.__setattr__(self, "rows", tuple(int(r) for r in checked))  # type: ignore[union-attr]
        if not 0 <= self.mtp <= self.num_mtp:
            raise RoutepackError(f"mtp: {self.mtp} MoE MTP layers, but the model has num_mtp = {self.num_mtp}")

    @classmethod
    def from_config(cls, config: Any) -> "MoELayers":
        """The pattern of a Megatron ``TransformerConfig`` / ``args`` namespace or a
        transformers config (or a dict of either's fields); see the module docstring."""
        return _from_config(config)

    @classmethod
    def from_pattern(cls, pattern: Sequence[Any], num_mtp: int = 0) -> "MoELayers":
        """From a 0/1 (or bool) list, one entry per decoder layer (Megatron's list
        ``moe_layer_freq``)."""
        flags = _flags(pattern, "pattern")
        return cls(len(flags), tuple(i for i, f in enumerate(flags) if f), _mtp_moe(flags, num_mtp), num_mtp, "pattern")

    @property
    def numbers(self) -> List[int]:
        """Megatron ``layer_number`` (1-based, global) of each decoder plan layer."""
        return [r + 1 for r in self.rows]

    @property
    def mtp_numbers(self) -> List[int]:
        """Megatron ``layer_number`` of each MoE MTP layer's inner ``TransformerLayer``."""
        return [self.num_layers + j + 1 for j in range(self.mtp)]

    def is_moe(self, layer_number: int) -> bool:
        """Whether Megatron layer ``layer_number`` (1-based; MTP layers after the decoder) routes."""
        return layer_number in self._index()

    def plan_layer(self, layer_number: int, mtp_planned: bool = False) -> int:
        """The plan layer of Megatron layer ``layer_number`` (1-based). A dense layer, a
        number outside the model, or an MTP layer when the plan has no MTP layers
        (``mtp_planned`` False, the routes had no MTP rows) is refused, naming it."""
        index = self._index()
        if layer_number not in index:
            if 1 <= layer_number <= self.num_layers + self.num_mtp:
                raise RoutepackError(
                    f"layer_number: layer {layer_number} is dense ({self.source}); it has no plan layer"
                )
            raise RoutepackError(
                f"layer_number: {layer_number} is outside the model's layers 1..{self.num_layers + self.num_mtp} "
                f"({self.num_layers} decoder, {self.num_mtp} MTP)"
            )
        if layer_number > self.num_layers and not mtp_planned:
            raise RoutepackError(
                f"layer_number: layer {layer_number} is an MTP layer, {self.unplanned()[layer_number]}"
            )
        return index[layer_number]

    def moe_layers(self, num_rows: int) -> Optional[List[int]]:
        """The ``moe_layers`` to count in a route tensor of ``num_rows`` rows on its layer axis:

        * ``num_layers`` rows (what engines record): the MoE rows, or None when every layer
          routes;
        * ``len(rows)`` rows (routes recorded by the trainer's MoE layers alone, as verl's R2
          pass keeps them for a model with dense layers): None, every row;
        * ``num_layers + num_mtp`` rows (MTP rows after the decoder's): the MoE rows and the
          MoE MTP rows, which become plan layers ``len(rows) + j``.

        Any other count is refused, naming the three it could be."""
        num_rows = positive_int(num_rows, "num_rows")
        every = len(self.rows) == self.num_layers
        if num_rows == self.num_layers:
            return None if every else list(self.rows)
        if num_rows == len(self.rows):
            return None
        if self.num_mtp and num_rows == self.num_layers + self.num_mtp:
            return list(self.rows) + [self.num_layers + j for j in range(self.mtp)]
        mtp = f", or {self.num_layers + self.num_mtp} (with the {self.num_mtp} MTP layers)" if self.num_mtp else ""
        raise RoutepackError(
            f"routed: {num_rows} rows on the layer axis, but the model ({self.source}) has {self.num_layers} layers, "
            f"{len(self.rows)} of them MoE: a route tensor has {self.num_layers} rows (one per layer, dense ones zero) "
            f"or {len(self.rows)} (MoE layers only){mtp}"
        )

    def unplanned(self, num_rows: Optional[int] = None) -> Dict[int, str]:
        """MoE layers a plan over a route tensor of ``num_rows`` rows does not cover (None: one
        with no MTP rows, what every engine records), by Megatron ``layer_number``, each with
        the reason; a runner builds them stock (live routing) or refuses them."""
        if num_rows is not None and self.num_mtp and num_rows == self.num_layers + self.num_mtp:
            return {}
        why = (
            "which routes live: rollout engines record routes for the decoder's layers only (L = num_hidden_layers; "
            "vLLM and SGLang capture no MTP rows) and verl replays none (router_replay_utils.iter_model_routers), so "
            "no route tensor says its load"
        )
        return {n: why for n in self.mtp_numbers}

    def _index(self) -> Dict[int, int]:
        out = {n: i for i, n in enumerate(self.numbers)}
        out.update({n: len(self.rows) + j for j, n in enumerate(self.mtp_numbers)})
        return out


def moe_layer_numbers(config: Any, mtp: bool = False) -> List[int]:
    """Megatron ``layer_number`` (1-based, global) of plan layer 0, 1, ...: the model's MoE
    layers in order (`MoELayers.from_config`); with ``mtp`` the MoE MTP layers follow (plans
    from route tensors that carry MTP rows)."""
    layers = MoELayers.from_config(config)
    return layers.numbers + (layers.mtp_numbers if mtp else [])


# ------------------------------------------------------------------ config readers
def _get(config: Any, key: str) -> Any:
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


def _flags(pattern: Any, name: str) -> List[bool]:
    if isinstance(pattern, (str, bytes)) or not hasattr(pattern, "__len__"):
        raise RoutepackTypeError(f"{name}: expected a 0/1 list, one entry per layer, got {pattern!r}")
    flags = []
    for i, f in enumerate(pattern):
        if isinstance(f, (bool, np.bool_)) or f in (0, 1):
            flags.append(bool(f))
        else:
            raise RoutepackError(f"{name}[{i}]: expected 0 or 1, got {f!r}")
    if not flags:
        raise RoutepackError(f"{name}: is empty; expected one entry per layer")
    if not any(flags):
        raise RoutepackError(f"{name}: marks no layer as MoE; routepack plans MoE layers")
    return flags


def _mtp_moe(flags: List[bool], num_mtp: int) -> int:
    """MTP layers take the decoder's last layer's spec: MoE when it is."""
    return num_mtp if flags[-1] else 0


def _count(config: Any, key: str, minimum: int = 0) -> Optional[int]:
    v = _get(config, key)
    if v is None:
        return None
    return positive_int(v, f"config.{key}", minimum=minimum)


def _from_config(config: Any) -> MoELayers:
    if config is None:
        raise RoutepackError(
            "config: expected a model config (Megatron TransformerConfig/args or transformers), got None"
        )
    if _get(config, "num_hidden_layers") is None and _get(config, "num_layers") is None:
        text = _get(config, "text_config")
        if text is not None:
            return _from_config(text)
    num_mtp = next((n for n in (_count(config, k) for k in MTP_KEYS) if n is not None), 0)
    megatron = _get(config, "num_layers")
    if megatron is not None and _get(config, "num_hidden_layers") is None:
        return _megatron(config, positive_int(megatron, "config.num_layers"), num_mtp)
    n = _get(config, "num_hidden_layers")
    if n is None:
        raise RoutepackError(
            f"config: {type(config).__name__} has neither num_layers (Megatron) nor num_hidden_layers (transformers)"
        )
    return _transformers(config, positive_int(n, "config.num_hidden_layers"), num_mtp)


def _megatron(config: Any, n: int, num_mtp: int) -> MoELayers:
    freq = _get(config, "moe_layer_freq")
    if freq is None:
        freq = 1  # TransformerConfig's default
    if isinstance(freq, (int, np.integer)) and not isinstance(freq, bool):
        f = positive_int(freq, "config.moe_layer_freq")
        flags = [i % f == 0 for i in range(n)]
        source = f"num_layers={n}, moe_layer_freq={f}"
    else:
        flags = _flags(freq, "config.moe_layer_freq")
        if len(flags) != n:
            raise RoutepackError(f"config.moe_layer_freq: has {len(flags)} entries for num_layers = {n} layers")
        source = f"num_layers={n}, moe_layer_freq list"
    return MoELayers(n, tuple(i for i, f in enumerate(flags) if f), _mtp_moe(flags, num_mtp), num_mtp, source)


def _transformers(config: Any, n: int, num_mtp: int) -> MoELayers:
    flags, source = _hf_flags(config, n)
    if not any(flags):
        raise RoutepackError(f"config: {source} leaves no MoE layer among the {n} layers")
    return MoELayers(n, tuple(i for i, f in enumerate(flags) if f), _mtp_moe(flags, num_mtp), num_mtp, source)


def _hf_flags(config: Any, n: int) -> Tuple[List[bool], str]:
    types = _get(config, "mlp_layer_types")
    if types is not None:
        if len(types) != n or any(t not in ("sparse", "dense") for t in types):
            raise RoutepackError(
                f"config.mlp_layer_types: expected {n} entries of 'sparse'/'dense', got {list(types)!r}"
            )
        return [t == "sparse" for t in types], "mlp_layer_types"
    listed = _get(config, "moe_layers")
    if listed is not None and not isinstance(listed, (int, np.integer)):
        ids = set(int(i) for i in listed)
        return [i in ids for i in range(n)], "moe_layers"
    k = _get(config, "first_k_dense_replace")
    if k is not None:
        k = positive_int(k, "config.first_k_dense_replace", minimum=0)
        f = _count(config, "moe_layer_freq", minimum=1) or 1
        return [i >= k and i % f == 0 for i in range(n)], f"first_k_dense_replace={k}" + (
            f", moe_layer_freq={f}" if f > 1 else ""
        )
    step = _get(config, "decoder_sparse_step")
    only = _get(config, "mlp_only_layers")
    if step is not None or only is not None:
        s = positive_int(step if step is not None else 1, "config.decoder_sparse_step")
        dense = set(int(i) for i in (only or []))
        return [i not in dense and (i + 1) % s == 0 for i in range(n)], f"decoder_sparse_step={s}, mlp_only_layers"
    start = _get(config, "moe_layer_start_index")
    if start is not None:
        end = _get(config, "moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else int(end)
        every = _count(config, "moe_layer_interval", minimum=1) or 1
        return [(i + 1) % every == 0 and int(start) <= i <= end for i in range(n)], "moe_layer_start/end_index"
    return [True] * n, "every layer"


__all__ = ["MTP_KEYS", "MoELayers", "check_moe_layers", "dense_hint", "moe_layer_numbers"]
