"""SGLang's routing replay: ``meta_info["routed_experts"]`` of a ``return_routed_experts``
request.

How SGLang builds it (``--enable-return-routed-experts``):

* ``python/sglang/srt/layers/moe/routed_experts_capturer.py``: the MoE layers write their
  top-k ids into a device buffer ``[tokens, num_hidden_layers, k (+ fused shared experts)]``
  at their own layer id, copied into a zero-initialised int32 host buffer by KV-cache slot;
  only MoE layers write, so a dense layer's rows are zero. ``get_routed_experts`` reads the
  slots of a request's first ``seqlen - 1`` tokens (the last generated token has no route):
  ``[n - 1, L, k]``, or from ``routed_experts_start_len`` on (``[start, n - 1)``, the part a
  continued request appends to what an earlier response returned);
* the detokenizer sends the int32 array flattened and base64-encoded
  (``extract_routed_experts_from_meta_info`` decodes it with ``np.frombuffer``: a read-only
  array); builds with a wire dtype name it in ``meta_info["routed_experts_dtype"]`` (int32,
  uint16, uint8); with ``skip_tokenizer_init`` the value is a tensor.

slime decodes it the same way (``slime/utils/types.py``, ``Sample``'s meta-info update:
``expected_rows = len(tokens) - 1 - routed_experts_start_len``, the element count checked,
``existing[:start_len]`` joined with the new rows).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Dict, Mapping

import numpy as np

from routepack._checks import allocating, positive_int
from routepack.routes.ids import ROUTED_DTYPES, check_ids, host_array
from routepack.errors import RoutepackError, RoutepackTypeError

#: The wire dtypes SGLang names in ``routed_experts_dtype`` (int32 when absent).
WIRE_DTYPES: Dict[str, np.dtype] = {
    "int32": np.dtype(np.int32),
    "uint16": np.dtype(np.uint16),
    "uint8": np.dtype(np.uint8),
}


def sglang_routes(
    meta_info: Mapping[str, Any],
    num_tokens: int,
    num_layers: int,
    top_k: int,
    previous: Any = None,
) -> np.ndarray:
    """A sample's routes ``[n - 1, L, k]`` from an SGLang response's ``meta_info``.

    Args:
        meta_info:  the response's ``meta_info`` (``routed_experts``: base64 str, bytes, a
                    tensor or array; optional ``routed_experts_start_len`` and
                    ``routed_experts_dtype``).
        num_tokens: n, the sample's tokens (prompt + output, all of them so far).
        num_layers: L, the model's ``num_hidden_layers`` (rows per token, dense ones zero).
        top_k:      k, ``num_experts_per_tok``.
        previous:   the sample's routes so far (``[>= start, L, k]``), needed when
                    ``routed_experts_start_len`` > 0.

    Returns the ids in their wire dtype (int32, uint8; uint16 widened to int32), row t the
    route of token t. Refused, naming the key: an element count other than ``(n - 1 - start)
    · L · k``, a start past ``n - 1``, a start > 0 without ``previous`` rows up to it.
    """
    if not isinstance(meta_info, Mapping):
        raise RoutepackTypeError(f"meta_info: expected a dict, got {type(meta_info).__name__}")
    n = positive_int(num_tokens, "num_tokens")
    layers, k = positive_int(num_layers, "num_layers"), positive_int(top_k, "top_k")
    if meta_info.get("routed_experts") is None:
        raise RoutepackError(
            "meta_info['routed_experts']: missing (send the request with return_routed_experts=True to a server started "
            "with --enable-return-routed-experts)"
        )
    start = positive_int(
        int(meta_info.get("routed_experts_start_len", 0) or 0), "meta_info['routed_experts_start_len']", 0
    )
    if start > n - 1:
        raise RoutepackError(
            f"meta_info['routed_experts_start_len']: {start} is past the {n - 1} routed tokens of a {n}-token sample"
        )
    flat = _decode(meta_info)
    rows = n - 1 - start
    if flat.size != rows * layers * k:
        raise RoutepackError(
            f"meta_info['routed_experts']: {flat.size} ids, expected (n - 1 - start) * L * k = ({n} - 1 - {start}) * "
            f"{layers} * {k} = {rows * layers * k}"
        )
    new = flat.reshape(rows, layers, k)
    if start == 0:
        return new
    if previous is None:
        raise RoutepackError(
            f"previous: routed_experts_start_len = {start}, so this response holds tokens {start}..{n - 2} only; pass the "
            "sample's earlier routes"
        )
    before = check_ids(host_array(previous, "previous"), "previous", 3)
    if before.shape[0] < start or before.shape[1:] != (layers, k):
        raise RoutepackError(
            f"previous: shape {before.shape}, expected at least {start} rows (routed_experts_start_len) of [{layers}, {k}]"
        )
    with allocating("previous", "the joined routes", n * layers * k * max(before.itemsize, new.itemsize)):
        return np.concatenate([before[:start], new.astype(np.result_type(before, new), copy=False)])


def _decode(meta_info: Mapping[str, Any]) -> np.ndarray:
    """The flat ids of ``meta_info['routed_experts']`` in one of `ROUTED_DTYPES`."""
    value = meta_info["routed_experts"]
    name = meta_info.get("routed_experts_dtype")
    wire = WIRE_DTYPES.get("int32" if name is None else str(name).strip().lower())
    if wire is None:
        raise RoutepackError(f"meta_info['routed_experts_dtype']: {name!r} is not one of {sorted(WIRE_DTYPES)}")
    if isinstance(value, str):
        try:
            value = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise RoutepackError(f"meta_info['routed_experts']: not base64 ({e})") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % wire.itemsize:
            raise RoutepackError(
                f"meta_info['routed_experts']: {len(value)} bytes is not a whole number of {wire.name} ids"
            )
        flat = np.frombuffer(value, dtype=wire)
    else:
        flat = host_array(value, "meta_info['routed_experts']").reshape(-1)
        if flat.dtype.type not in ROUTED_DTYPES and flat.dtype != np.uint16:
            raise RoutepackTypeError(f"meta_info['routed_experts']: dtype {flat.dtype} is not an id type")
    if flat.dtype == np.uint16:
        with allocating("meta_info['routed_experts']", "an int32 copy", flat.size * 4):
            flat = flat.astype(np.int32)
    return flat


__all__ = ["WIRE_DTYPES", "sglang_routes"]
