"""Excerpts of slime's route handling, copied unchanged from THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515 (Apache-2.0), for the route converter's tests
(tests/test_routes_engines.py, tests/test_routes_ranks.py). Only the imports differ: the modules these
come from import slime's whole stack, so each name they use is imported or defined here, and
``mpu`` is a module-level name the tests set (Megatron's ``parallel_state`` queries answered
for the rank under test). ``Sample._apply_meta_info``'s routed-experts block is kept as the
method ``_apply_routed_experts`` of a minimal ``Sample`` (the rest of that method handles
logprobs and finish reasons).

* ``decode_int32_meta_array``: slime/utils/misc.py
* ``Sample._apply_meta_info`` (routed-experts block): slime/utils/types.py
* ``validate_rollout_routed_experts_for_replay``: slime/observability/rollout_data_utils.py
* ``slice_with_cp``, ``_pad_routed_experts``, ``prepare_routed_experts_for_routing_replay``:
  slime/backends/megatron_utils/cp_utils.py
"""
# ruff: noqa

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

mpu: Any = None  # set by the tests: get_context_parallel_rank / _world_size, get_tensor_model_parallel_*


# ---- slime/utils/misc.py
def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> torch.Tensor | None:
    if isinstance(keys, str):
        keys = (keys,)
    for key in keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None

    if value is None:
        return None
    if isinstance(value, str):
        import pybase64

        value = pybase64.b64decode(value.encode("ascii"))
    if isinstance(value, bytes | bytearray | memoryview):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    if torch.is_tensor(value):
        return value.detach().to(device="cpu", dtype=torch.int32).reshape(-1)
    if hasattr(value, "flags") and not value.flags.writeable:
        value = value.copy()
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)



# ---- slime/utils/types.py (Sample._apply_meta_info, the routed-experts block)
class Sample:
    def __init__(self, tokens, rollout_routed_experts=None):
        self.tokens = tokens
        self.rollout_routed_experts = rollout_routed_experts

    def _apply_routed_experts(self, meta_info, args=None):
        routed_experts = decode_int32_meta_array(meta_info, "routed_experts")
        if routed_experts is not None:
            if args is None:
                raise ValueError("args is required to decode routed experts metadata.")
            routed_experts_start_len = int(meta_info.get("routed_experts_start_len", 0) or 0)
            if routed_experts_start_len < 0:
                raise ValueError(
                    f"SGLang routed_experts_start_len must be non-negative, got {routed_experts_start_len}."
                )
            expected_rows = max(0, len(self.tokens) - 1 - routed_experts_start_len)
            expected_numel = expected_rows * args.num_layers * args.moe_router_topk
            if routed_experts.numel() != expected_numel:
                raise ValueError(
                    "SGLang routed_experts element count does not match sample tokens: "
                    f"got={routed_experts.numel()}, expected={expected_numel} "
                    f"(tokens={len(self.tokens)}, routed_experts_start_len={routed_experts_start_len}, "
                    f"num_layers={args.num_layers}, "
                    f"moe_router_topk={args.moe_router_topk})."
                )
            routed_experts = routed_experts.reshape(
                expected_rows,
                args.num_layers,
                args.moe_router_topk,
            )
            if routed_experts_start_len == 0:
                self.rollout_routed_experts = routed_experts
            else:
                existing = self.rollout_routed_experts
                if existing is None:
                    raise ValueError(
                        "Cannot append partial routed experts without existing routed experts "
                        f"(routed_experts_start_len={routed_experts_start_len})."
                    )
                if not torch.is_tensor(existing):
                    existing = torch.as_tensor(existing, dtype=routed_experts.dtype)
                if existing.shape[0] < routed_experts_start_len:
                    raise ValueError(
                        "Existing routed experts shorter than routed_experts_start_len: "
                        f"existing_rows={existing.shape[0]}, routed_experts_start_len={routed_experts_start_len}."
                    )
                self.rollout_routed_experts = torch.cat(
                    [existing[:routed_experts_start_len], routed_experts],
                    dim=0,
                )


# ---- slime/observability/rollout_data_utils.py
def validate_rollout_routed_experts_for_replay(
    routed_experts: list[torch.Tensor],
    args,
) -> None:
    """Reject incomplete PP routing captures before R3 consumes them."""
    if not routed_experts:
        raise ValueError("R3 is enabled but no rollout routed-experts tensors were returned.")

    num_layers = int(args.num_layers)
    topk = int(args.moe_router_topk)
    moe_layer_freq = getattr(args, "moe_layer_freq", None)
    if isinstance(moe_layer_freq, (list, tuple)):
        moe_layers = [layer_id for layer_id, freq in enumerate(moe_layer_freq[:num_layers]) if int(freq) != 0]
    else:
        moe_layers = list(range(num_layers))

    for sample_idx, experts in enumerate(routed_experts):
        experts = torch.as_tensor(experts)
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (num_layers, topk):
            raise ValueError(
                "Invalid rollout routed-experts shape for R3: "
                f"sample={sample_idx}, got={tuple(experts.shape)}, "
                f"expected=(*, {num_layers}, {topk})."
            )
        if experts.shape[0] == 0:
            raise ValueError(f"R3 sample {sample_idx} has no routed-experts rows.")
        if topk > 1:
            missing_layers = [layer_id for layer_id in moe_layers if not torch.count_nonzero(experts[:, layer_id, :])]
            if missing_layers:
                raise ValueError(
                    "R3 routed-experts capture is all zero for MoE layers "
                    f"{missing_layers} in sample {sample_idx}. This usually means "
                    "SGLang pipeline stages did not aggregate their disjoint routing "
                    "captures; refusing to replay expert 0 everywhere."
                )


# ---- slime/backends/megatron_utils/cp_utils.py
def slice_with_cp(
    tokens: torch.Tensor,
    pad_value: tuple[int, float, Callable],
) -> torch.Tensor:
    cp_rank = mpu.get_context_parallel_rank()
    cp_size = mpu.get_context_parallel_world_size()

    def pad_tokens(tokens, pad):
        if isinstance(pad_value, Callable):
            pad_func = pad_value
            tokens = pad_func(tokens, pad)
        else:
            # pad on the first dimension
            pad_tuple = (0, 0) * (tokens.dim() - 1) + (0, pad)
            tokens = F.pad(tokens, pad_tuple, value=pad_value)
        return tokens

    if cp_size == 1:
        return tokens

    token_len = len(tokens)
    chunk_size = (token_len + 2 * cp_size - 1) // (2 * cp_size)

    # pad
    pad = 2 * cp_size * chunk_size - token_len
    tokens = pad_tokens(tokens, pad)

    # get 2 chunk for thd cp
    start_1, end_1 = chunk_size * cp_rank, chunk_size * (cp_rank + 1)
    start_2, end_2 = chunk_size * (2 * cp_size - cp_rank - 1), chunk_size * (2 * cp_size - cp_rank)
    return torch.cat([tokens[start_1:end_1], tokens[start_2:end_2]])


def _pad_routed_experts(experts: torch.Tensor, pad: int, num_experts: int) -> torch.Tensor:
    if pad == 0:
        return experts
    _, num_layers, topk = experts.shape
    pad_experts = (
        torch.arange(
            pad * num_layers * topk,
            device=experts.device,
            dtype=experts.dtype,
        ).reshape((pad, num_layers, topk))
        % num_experts
    )
    return torch.cat([experts, pad_experts], dim=0)


def prepare_routed_experts_for_routing_replay(
    rollout_routed_experts: Sequence[torch.Tensor],
    tokens: Sequence[torch.Tensor],
    *,
    num_experts: int,
    data_pad_size_multiplier: int,
    sequence_parallel: bool,
    allgather_cp: bool,
) -> torch.Tensor:
    """Align rollout routed-experts metadata with the training token layout."""
    assert len(rollout_routed_experts) == len(tokens)
    for experts, token_ids in zip(rollout_routed_experts, tokens, strict=False):
        assert experts.shape[0] == token_ids.shape[0] - 1, f"{experts.shape}, {token_ids.shape}"

    padded_experts = [_pad_routed_experts(experts, 1, num_experts) for experts in rollout_routed_experts]
    pad_size = mpu.get_tensor_model_parallel_world_size() * data_pad_size_multiplier

    if allgather_cp:
        routed_experts = torch.cat(padded_experts, dim=0)
        cp_size = mpu.get_context_parallel_world_size()
        cp_rank = mpu.get_context_parallel_rank()
        global_pad_size = cp_size * pad_size
        pad = (global_pad_size - routed_experts.size(0) % global_pad_size) % global_pad_size
        routed_experts = _pad_routed_experts(routed_experts, pad, num_experts)
        routed_experts = routed_experts.chunk(cp_size, dim=0)[cp_rank]
    else:
        routed_experts = [
            slice_with_cp(experts, lambda x, pad: _pad_routed_experts(x, pad, num_experts))
            for experts in padded_experts
        ]
        routed_experts = torch.cat(routed_experts, dim=0)
        pad = (pad_size - routed_experts.size(0) % pad_size) % pad_size
        routed_experts = _pad_routed_experts(routed_experts, pad, num_experts)

    if sequence_parallel:
        tp_rank = mpu.get_tensor_model_parallel_rank()
        tp_size = mpu.get_tensor_model_parallel_world_size()
        seqlen = routed_experts.size(0)
        assert seqlen % tp_size == 0
        start = seqlen // tp_size * tp_rank
        end = seqlen // tp_size * (tp_rank + 1)
        routed_experts = routed_experts[start:end]

    return routed_experts
