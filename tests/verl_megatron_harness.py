"""verl's Megatron engine on CPU with gloo, for the hand-off tests: verl 0.9.1's own
``MegatronEngineWithLMHead`` (its ``_build_megatron_module``, ``_build_optimizer``,
``train_batch`` / ``forward_backward_batch`` / ``forward_step`` / ``optimizer_step``,
``get_per_tensor_param``; ``gptmodel_forward_model_engine`` in the bshd format, verl's R3
``RouterReplay`` patch and replay data, ``prepare_micro_batches``, ``make_batch_generator``)
driven by verl's ``TrainingWorker.train_mini_batch`` / ``train_batch`` and the driver's
``_balance_batch`` / ``_update_actor`` (tests/verl_harness.py), on Megatron-Core's GPTModel.

Stood in for (each with its reason):

* the bridge (mbridge's ``AutoBridge``, not installed here, builds a Transformer Engine spec):
  `StandInBridge` has mbridge's attributes the engine and routepack use:
  ``config`` (the TransformerConfig), ``_get_transformer_layer_spec`` (Megatron's local
  spec: no Transformer Engine on CPU), ``get_model`` (GPTModel + Megatron's DDP, as
  mbridge's), ``load_weights`` (reads each parameter through
  ``_weight_name_mapping_mcore_local_to_global``, as mbridge's, from a dict of the stock
  model's logical tensors instead of safetensors), ``_weight_to_hf_format`` (identity:
  mcore names), ``export_weights`` (the stock model's own parameters, for the stock engine);
* the attention mask: verl's bshd path passes Transformer Engine's ``[b, s]`` padding mask;
  `local_attention_mask` turns it into the local attention's causal ``[b, 1, s, s]`` one;
* ``load_megatron_model_to_gpu`` (called by ``get_per_tensor_param``): a no-op, the model
  stays resident on the CPU (verl's onload handles CUDA grad buffers);
* ``verl.models.mcore.mbridge`` (it imports mbridge): a module with its three names;
* the engine's ``__init__`` / ``_build_tf_config`` / checkpoint manager (they build the bridge
  from an HF checkpoint): `make_engine` sets the attributes they set;
* ``model_config`` (an ``HFModelConfig`` needs an HF checkpoint): architectures, tokenizer's
  pad id, MTP off;
* the loss: the mean negative log-prob of the response tokens (verl's ``ppo_loss`` needs the
  advantages of a rollout);
* Megatron's CUDA-only calls: tests/megatron_cpu.py.
"""

from __future__ import annotations

import inspect
import re
import sys
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import torch

import megatron_selfcheck as ms


def local_attention_mask(module: Any, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """verl's bshd path hands the model a ``[b, s]`` padding mask (True: a real token), the form
    Transformer Engine's attention takes; Megatron's local attention (CPU) takes ``[b, 1, s, s]``
    with True where a score is masked: the causal mask or a padded key."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        s = mask.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=mask.device), diagonal=1)
        kwargs["attention_mask"] = causal[None, None] | ~mask[:, None, None, :].bool()
    return args, kwargs


class StandInBridge:
    """mbridge's ``AutoBridge`` as the engine and routepack use it (module docstring)."""

    def __init__(self, case: Any) -> None:
        self.case, self.config = case, ms.config(case)
        self.exported: List[str] = []

    def _get_transformer_layer_spec(self, vp_stage: Any = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=self.case.experts)

    def get_model(self, post_model_creation_callbacks=(), wrap_with_ddp=True, fp16=False, bf16=False, ddp_config=None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_model import GPTModel

        model = GPTModel(
            config=self.config,
            transformer_layer_spec=self._get_transformer_layer_spec(),
            vocab_size=self.case.vocab,
            max_sequence_length=512,
            position_embedding_type="rope",
        )
        model.register_forward_pre_hook(local_attention_mask, with_kwargs=True)
        cfg = DistributedDataParallelConfig(**{"overlap_grad_reduce": False, **(ddp_config or {})})
        return [DistributedDataParallel(config=self.config, ddp_config=cfg, module=model)]

    def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> Dict[str, str]:
        """mbridge's map: EP-local expert i of EP rank r is expert ``r * E / ep + i``."""
        from megatron.core import parallel_state as mpu

        offset = mpu.get_expert_model_parallel_rank() * self.case.experts // self.case.ep if consider_ep else 0
        out = {}
        for k in model.module.state_dict():
            if "_extra_state" in k:
                continue
            m = re.match(r"^(.*\.local_experts\.)(\d+)(\..*)$", k)
            out[k] = f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else k
        return out

    @torch.no_grad()
    def load_weights(self, models: List[Any], path: Any) -> None:
        """Each parameter from its global name (mbridge reads that name's HF tensors): the
        value `megatron_selfcheck` (tests/megatron_selfcheck.py) derives from a name and a seed."""
        for model in models:
            names = self._weight_name_mapping_mcore_local_to_global(model)
            state = model.module.state_dict()
            for local, name in names.items():
                if torch.is_floating_point(state[local]) and "expert_bias" not in local:
                    state[local].copy_(ms._value(name, tuple(state[local].shape), self.case.seed))

    def _weight_to_hf_format(self, name: str, tensor: torch.Tensor) -> tuple:
        self.exported.append(name)
        return [name], [tensor]

    def export_weights(self, models: List[Any]) -> Any:
        for name, p in models[0].module.named_parameters():
            yield from zip(*self._weight_to_hf_format(name, p))


def standin_mbridge_module() -> None:
    """``verl.models.mcore.mbridge`` (imported by verl's ``make_megatron_module``) re-exports
    mbridge, which is not installed: the module with mbridge's three names (no callback of
    theirs runs for an actor model)."""
    import types

    if "verl.models.mcore.mbridge" in sys.modules:
        return
    mod = types.ModuleType("verl.models.mcore.mbridge")
    mod.AutoBridge = StandInBridge
    mod.freeze_moe_router = mod.make_value_model = lambda *a, **k: None
    sys.modules["verl.models.mcore.mbridge"] = mod


def make_engine(case: Any, plan: bool, layout: Dict[str, int], lr: float) -> Any:
    """verl's ``MegatronEngineWithLMHead`` with what its ``__init__`` / ``initialize`` set, its
    model and optimizer built by its own ``_build_megatron_module`` / ``_build_optimizer``."""
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine_config = McoreEngineConfig(
        strategy="megatron",
        expert_model_parallel_size=case.ep,
        use_distributed_optimizer=case.distributed_optimizer,
        vanilla_mbridge=True,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=case.token_cap,
        override_mcore_model_config={"routepack": dict(layout)} if plan else {},
        override_ddp_config={"overlap_grad_reduce": False},
        router_replay={"mode": "R3"},
    )
    engine_config.use_remove_padding = False  # bshd: Megatron's local attention takes no packed sequences
    engine_config.use_fused_kernels = False
    optim = McoreOptimizerConfig(lr=lr, clip_grad=1.0, weight_decay=0.01, total_training_steps=10)
    standin_mbridge_module()
    from verl.workers.engine.megatron import transformer_impl as ti

    ti.load_megatron_model_to_gpu = lambda *a, **k: None  # resident on CPU (verl's onload touches CUDA buffers)
    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.engine_config, engine.optimizer_config = engine_config, optim
    engine.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False),
        local_path="(stand-in)",
        get=lambda key, default=None: default,
    )
    engine.mode, engine._is_offload_param, engine._is_offload_optimizer = None, False, False
    engine.enable_routing_replay, engine.mini_layer_topk_idx_list = True, []
    apply_router_replay_patch()
    engine.is_value_model, engine.share_embeddings_and_output_weights = False, False
    engine.param_dtype = engine.dtype = torch.float32
    engine.provider, engine.vanilla_bridge, engine.peft_cls, engine._qat_enabled = None, True, None, False
    engine.bridge = StandInBridge(case)
    engine.tf_config = engine.bridge.config
    engine.weight_converter, engine._hf_export_tasks = None, None
    engine.module = engine._build_megatron_module()
    engine.optimizer = engine._build_optimizer()
    engine.lr_scheduler = engine._build_lr_scheduler()
    engine.checkpoint_config = SimpleNamespace(save_contents=["model", "extra"])
    return engine


def training_worker(engine: Any, loss_fn: Any, cap: int) -> Any:
    """verl's ``TrainingWorker`` methods bound to a stand-in instance holding ``engine``."""
    from verl.workers.engine_workers import TrainingWorker

    w = SimpleNamespace(
        engine=engine,
        profiler=SimpleNamespace(step=lambda: None),
        loss_fn=loss_fn,
        engine_config=SimpleNamespace(
            forward_only=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=cap,
            infer_max_token_len_per_gpu=cap,
            micro_batch_size_per_gpu=None,
            infer_micro_batch_size_per_gpu=None,
            use_fused_kernels=False,
        ),
        model_config={"use_remove_padding": False},
        flops_counter=SimpleNamespace(estimate_flops=lambda *a, **k: (1.0, 1.0)),
        device_name="cpu",
    )
    for name in ("train_mini_batch", "train_batch", "_postprocess_output"):
        setattr(w, name, inspect.unwrap(getattr(TrainingWorker, name)).__get__(w))
    return w


def response_nll(model_output: Dict[str, Any], data: Any, dp_group: Any = None) -> tuple:
    """Stand-in loss: mean negative log-prob of the response tokens over the global batch
    (``batch_num_tokens``), as verl's losses normalise."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    mask = data["response_mask"].to(log_prob.dtype)
    if mask.is_nested:
        mask = mask.to_padded_tensor(0.0)
    total = float(data["batch_num_tokens"])
    loss = -(log_prob * mask[:, : log_prob.shape[1]]).sum() / total * float(data["dp_size"])
    return loss, {"loss": loss.detach().item()}


class LocalGroup:
    """verl's worker group as one rank of a multi-process run sees it: verl's own chunking, the
    rank's chunk run by its worker (the other ranks run theirs in their processes)."""

    def __init__(self, rank: int, dp: int, worker: Any) -> None:
        self.rank, self.dp, self.worker, self._dispatch_info = rank, dp, worker, {}

    def _query_dispatch_info(self, role: str) -> List[int]:
        return list(range(self.dp))

    def update_actor(self, td: Any) -> Any:
        from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

        (chunks,), _ = _split_args_kwargs_data_proto(self.dp, td)
        out = self.worker.train_mini_batch(chunks[self.rank].clone())
        from verl.utils import tensordict_utils as tu

        return out if out is not None else tu.get_tensordict({}, non_tensor_dict={"metrics": {}})


def batches(case: Any, step: int, size: int, prompt: int, response: int) -> Any:
    """A verl batch (tests/verl_batches.py's layout) with token ids in the model's vocab."""
    import verl_batches
    import verl_harness

    rng = np.random.default_rng([case.seed, 11, step])
    vb = verl_batches.verl_batch(rng, size, prompt, response, case.layers, case.top_k, case.experts)
    vb.response_mask[:, 0] = 1
    vb.attention_mask[:, prompt] = 1
    proto = verl_harness.data_proto(vb, prompt)
    ids = torch.from_numpy(rng.integers(1, case.vocab, size=proto.batch["input_ids"].shape))
    proto.batch["input_ids"] = ids
    proto.batch["prompts"], proto.batch["responses"] = ids[:, :prompt], ids[:, prompt:]
    return proto
