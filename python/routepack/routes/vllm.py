"""vLLM's routing replay: ``CompletionOutput.routed_experts``.

How vLLM builds it (``enable_return_routed_experts``):

* ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``: each forward, every
  ``FusedMoE`` layer writes its top-k ids into a zero-initialised device buffer ``[tokens,
  num_hidden_layers, k]`` at its own layer index, and the rows are saved into a host buffer
  by KV-cache slot; a dense layer never writes, so its rows stay zero;
* ``vllm/v1/core/sched/scheduler.py``, ``_get_routed_experts``: at the request's end it reads
  the slots of its first ``request.num_tokens - 1`` tokens (the last generated token was never
  fed through the model, so it has no route): ``[n - 1, L, k]``, ``n`` = prompt + output
  tokens, row t the route of token t; int32 in the capturer's buffer, int16 where a build
  keeps it so;
* ``vllm/outputs.py``: ``CompletionOutput.routed_experts`` holds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from routepack._checks import positive_int
from routepack.routes.ids import check_ids, host_array
from routepack.errors import RoutepackError


def vllm_routes(routed_experts: Any, num_tokens: int) -> np.ndarray:
    """A vLLM sample's routes, checked: ``[n - 1, L, k]`` (numpy or torch; int16 | int32 or
    any of the id types), ``num_tokens`` = n = prompt + output tokens. Returned as given (no
    copy); row t is token t's route, the last token has none."""
    n = positive_int(num_tokens, "num_tokens")
    routes = check_ids(host_array(routed_experts, "routed_experts"), "routed_experts", 3)
    if routes.shape[0] != n - 1:
        raise RoutepackError(
            f"routed_experts: {routes.shape[0]} rows for a sample of {n} tokens; vLLM records n - 1 = {n - 1} "
            "(no route for the last generated token)"
        )
    return routes


def vllm_output_routes(request_output: Any, index: int = 0) -> np.ndarray:
    """`vllm_routes` of completion ``index`` of a vLLM ``RequestOutput`` (its
    ``prompt_token_ids`` and ``outputs[index].token_ids`` give n; read by attribute, vLLM is
    not imported)."""
    outputs = getattr(request_output, "outputs", None)
    prompt = getattr(request_output, "prompt_token_ids", None)
    if outputs is None or prompt is None:
        raise RoutepackError(
            f"request_output: expected a vLLM RequestOutput (prompt_token_ids, outputs), got {type(request_output).__name__}"
        )
    if not 0 <= index < len(outputs):
        raise RoutepackError(f"index: {index} is outside the request's {len(outputs)} completions")
    out = outputs[index]
    routes = getattr(out, "routed_experts", None)
    if routes is None:
        raise RoutepackError(
            f"request_output.outputs[{index}].routed_experts: is None (start vLLM with enable_return_routed_experts=True)"
        )
    return vllm_routes(routes, len(prompt) + len(out.token_ids))


__all__ = ["vllm_output_routes", "vllm_routes"]
