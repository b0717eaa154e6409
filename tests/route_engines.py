"""Route tensors built as each engine builds them, for the converter's tests.

* verl: the two blocks of ``verl/experimental/agent_loop/agent_loop.py`` (verl 0.9.1,
  installed) that lay the routes out, run from the installed file's own source: the legacy
  trainer's block of ``_agent_loop_postprocess`` (``[1, P + R, L, k]`` from the first real
  prompt token) and ``AgentLoopOutput.as_dict`` (the v1 trainer's unpadded ``[n, L, k]``).
  The module imports hydra, ray and the rollout stack, so the two blocks are taken from its
  source (``ast``) and executed with the names they use, unchanged.
* slime: its own functions, copied verbatim (tests/slime_reference/route_excerpts.py).
* vLLM and SGLang are not installable here (CUDA builds); `VllmCapture` and `SglangCapture`
  follow their capture code step by step (paths cited on each), with the same buffer
  shapes, dtypes, zero initialisation and slot arithmetic.
"""

from __future__ import annotations

import ast
import base64
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "slime_reference"))

if "pybase64" not in sys.modules:
    try:
        import pybase64  # noqa: F401
    except ImportError:  # slime's decoder imports it; it is a faster base64 with the same output
        sys.modules["pybase64"] = types.SimpleNamespace(b64decode=base64.b64decode, b64encode=base64.b64encode)


def moe_topk(rng: np.random.Generator, tokens: int, experts: int, k: int) -> np.ndarray:
    """int32 [tokens, k]: k distinct experts per token (a router's top-k)."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int32)


class VllmCapture:
    """vLLM's capture, step by step.

    ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``: ``init_buffer`` makes a
    zero int32 device buffer ``[max_num_batched_tokens, num_hidden_layers, k]`` and a zero host
    buffer ``[max_num_kv_tokens, L, k]``; ``capture(layer_id, topk_ids)`` writes
    ``device[:tokens, layer_id, :]`` (called by ``FusedMoE`` layers only); ``save_captured_experts
    (indices)`` copies ``device[:len(indices)]`` to ``host[indices]``.
    ``vllm/v1/core/sched/scheduler.py``, ``_get_routed_experts``: ``num_tokens =
    request.num_tokens - 1``; ``slot_mapping = (arange(block_size) + block_ids * block_size)
    .flatten()[:num_tokens]``; ``host[slot_mapping].copy()``."""

    def __init__(self, num_layers: int, k: int, kv_blocks: int, block_size: int, max_batch: int):
        self.block_size = block_size
        self.device = np.zeros((max_batch, num_layers, k), dtype=np.int32)
        self.host = np.zeros((kv_blocks * block_size, num_layers, k), dtype=np.int32)

    def forward(self, slots: np.ndarray, routes: Dict[int, np.ndarray]) -> None:
        """One forward over tokens at KV ``slots``; ``routes[layer_id]`` the MoE layers' top-k."""
        for layer_id, topk in routes.items():
            self.device[: topk.shape[0], layer_id, :] = topk
        self.host[slots] = self.device[: len(slots)]

    def routed_experts(self, block_ids: List[int], num_tokens: int) -> np.ndarray:
        ids = np.array(block_ids, dtype=np.int32)
        offsets = np.arange(0, self.block_size)
        slot_mapping = (offsets.reshape((1, self.block_size)) + ids.reshape((len(ids), 1)) * self.block_size).flatten()[
            : num_tokens - 1
        ]
        return self.host[slot_mapping, :, :].copy()


class SglangCapture:
    """SGLang's capture, step by step (``python/sglang/srt/layers/moe/routed_experts_capturer.py``):
    a zero int32 host buffer ``[num_tokens, num_hidden_layers, k]``; each forward the MoE layers'
    ``capture(layer_id, topk_ids)`` fills ``device[:batch, layer_id, :]`` and ``on_forward_end``
    copies ``device[:n, :, :k]`` to ``host[out_cache_loc]``; ``get_routed_experts`` returns
    ``host[req_to_token[req][: seqlen - 1]]``; the detokenizer sends it base64-encoded
    (``pybase64.b64encode(array.numpy().tobytes())``), from ``routed_experts_start_len`` on when
    the request asks."""

    def __init__(self, num_layers: int, k: int, pool: int, max_batch: int, shared: int = 0):
        self.k = k
        self.device = np.zeros((max_batch, num_layers, k + shared), dtype=np.int32)
        self.host = np.zeros((pool, num_layers, k), dtype=np.int32)

    def forward(self, out_cache_loc: np.ndarray, routes: Dict[int, np.ndarray]) -> None:
        for layer_id, topk in routes.items():
            self.device[: topk.shape[0], layer_id, : topk.shape[1]] = topk
        self.host[out_cache_loc] = self.device[: len(out_cache_loc), :, : self.k]

    def meta_info(self, req_to_token: np.ndarray, seqlen: int, start_len: int = 0, dtype: str = "") -> Dict[str, Any]:
        routes = self.host[req_to_token[: seqlen - 1]][start_len:]
        out: Dict[str, Any] = {}
        if dtype:
            routes = routes.astype(dtype)
            out["routed_experts_dtype"] = dtype
        out["routed_experts"] = base64.b64encode(np.ascontiguousarray(routes).tobytes()).decode("utf-8")
        if start_len:
            out["routed_experts_start_len"] = start_len
        return out


# ------------------------------------------------------------------ verl, from its own source
def _agent_loop_source() -> ast.Module:
    import verl

    return ast.parse((Path(verl.__file__).parent / "experimental" / "agent_loop" / "agent_loop.py").read_text())


def verl_as_dict(
    prompt_ids: List[int], response_ids: List[int], routed_experts: Optional[np.ndarray]
) -> Dict[str, Any]:
    """``AgentLoopOutput(...).as_dict()`` (the v1 trainer's per-sample fields), with the class
    taken unchanged from verl's installed source."""
    import torch
    from pydantic import BaseModel, ConfigDict

    tree = _agent_loop_source()
    # a module of its own, so pydantic resolves the classes' annotations in it
    module = sys.modules.setdefault("_verl_agent_loop_excerpt", types.ModuleType("_verl_agent_loop_excerpt"))
    ns = module.__dict__
    ns.update(BaseModel=BaseModel, ConfigDict=ConfigDict, Optional=Optional, Any=Any, torch=torch, np=np)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("AgentLoopMetrics", "AgentLoopOutput"):
            exec(compile(ast.Module([node], []), "agent_loop.py", "exec"), ns)
    out = ns["AgentLoopOutput"](
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=[1] * len(response_ids),
        routed_experts=routed_experts,
        metrics=ns["AgentLoopMetrics"](),
    )
    return out.as_dict()


def verl_legacy_row(prompt_ids: List[int], prompt_length: int, response_length: int, engine_routes: np.ndarray) -> Any:
    """The routes block of ``_agent_loop_postprocess`` (the legacy trainer's padded row
    ``[1, P + R, L, k]``), executed from verl's installed source with the names it reads:
    ``output.routed_experts``, ``input_ids`` (``[1, P + R]``) and ``prompt_output["input_ids"]``
    (``[1, P]``, left-padded)."""
    import torch

    tree = _agent_loop_source()
    method = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.AsyncFunctionDef) and f.name == "_agent_loop_postprocess"
    )
    block = [
        s for s in method.body if isinstance(s, ast.If) and "output.routed_experts is not None" in ast.unparse(s.test)
    ]
    assert len(block) == 1, "verl's _agent_loop_postprocess changed: no single routed_experts block"
    ns: Dict[str, Any] = dict(
        torch=torch,
        np=np,
        output=types.SimpleNamespace(routed_experts=engine_routes, prompt_ids=prompt_ids),
        input_ids=torch.zeros((1, prompt_length + response_length), dtype=torch.long),
        prompt_output={"input_ids": torch.zeros((1, prompt_length), dtype=torch.long)},
        routed_experts=None,
    )
    exec(compile(ast.Module(block, []), "agent_loop.py", "exec"), ns)
    return ns["routed_experts"]
