"""Routing replay as the rollout engines record it, converted for planning and replay.

One home for every route layout routepack reads (numpy only; torch tensors are read without
importing torch):

* `layers`: which rows of a route tensor are MoE layers (`MoELayers`, read from a Megatron or
  transformers config), and the Megatron layer number of each plan layer
  (`moe_layer_numbers`);
* one module per engine layout, each citing the engine code it follows: `vllm`
  (``CompletionOutput.routed_experts``), `sglang` (``meta_info["routed_experts"]``), `slime`
  (``Sample.rollout_routed_experts``), `verl` (``batch["routed_experts"]``);
* `summary`: compact per-sample expert counts (`summarize` on the rollout side, `merge` on
  the driver, `routepack.Window.from_summary`);
* `ranks`: the routes each training rank replays, split over PP / VPP (`chunk_rows`,
  `megatron_chunk`) and CP / TP (`verl_take`, `slime_take`, `gather`) as each trainer splits
  them.
"""

from routepack.routes.layers import MTP_KEYS, MoELayers, check_moe_layers, moe_layer_numbers
from routepack.routes.ranks import chunk_rows, gather, megatron_chunk, replay_list, slime_take, verl_take
from routepack.routes.sglang import WIRE_DTYPES, sglang_routes
from routepack.routes.slime import LAST_TOKEN, slime_pad_row, slime_samples, slime_summary
from routepack.routes.summary import SUMMARY_DTYPES, RouteSummary, merge, summarize
from routepack.routes.verl import MODES, verl_summary
from routepack.routes.vllm import vllm_output_routes, vllm_routes

__all__ = [
    "LAST_TOKEN",
    "MODES",
    "MTP_KEYS",
    "SUMMARY_DTYPES",
    "WIRE_DTYPES",
    "MoELayers",
    "RouteSummary",
    "check_moe_layers",
    "chunk_rows",
    "gather",
    "megatron_chunk",
    "merge",
    "moe_layer_numbers",
    "replay_list",
    "sglang_routes",
    "slime_pad_row",
    "slime_samples",
    "slime_summary",
    "slime_take",
    "summarize",
    "verl_summary",
    "verl_take",
    "vllm_output_routes",
    "vllm_routes",
]
