"""slime's Megatron train actor on CPU with gloo, for the hand-off tests
(tests/test_integrations_slime_megatron.py, examples/slime_train.py): the driver's
``_split_train_data_by_dp`` (tests/slime_split_standin.py, with docs/trainers.md's change:
``plan_dp_schedule`` and ``step_plans``) and the actor's model building, ``train`` /
``train_one_step``, reference-model switches and weight reads, written from slime's source at
624b824 (``slime/backends/megatron_utils/model.py``, ``model_provider.py``, ``actor.py``) with
the user change of docs/trainers.md applied, on Megatron-Core's own ``GPTModel``,
``DistributedDataParallel``, ``get_megatron_optimizer`` and ``forward_backward_func``.

slime's own code, verbatim (tests/slime_reference/megatron_actor_excerpts.py):
``named_params_and_buffers`` (what the weight update to SGLang, the weight backups and the HF
checkpoint load/save read), ``DataIterator``, ``TensorBackuper``, ``_pad_routed_experts``.
The user's line in ``named_params_and_buffers`` (``model = rs.stock_layout(model)``) is
`named_params_and_buffers` here.

Stood in for (each with its reason):

* ``megatron.training.get_model`` (Megatron-LM's training package is not installed; slime
  calls it): the model provider's ``GPTModel`` wrapped in Megatron-Core's DDP directly
  (``megatron_selfcheck.wrap``: Adam, ``clip_grad=1``);
* the HF checkpoint load: the stock model's weights (`megatron_selfcheck.init_weights`)
  written through slime's ``named_params_and_buffers`` the way slime's
  ``load_model_hf_weights`` writes them (``parameter.copy_``);
* ``get_batch``'s packed THD sequences (``PackedSeqParams``): Megatron's local attention on CPU
  takes no packed sequences, so a microbatch is one sequence with a block-diagonal causal mask
  (each sample, and the padding, attends within itself); the padding to
  ``data_pad_size_multiplier`` tokens is slime's;
* slime's routing replay (a patch of slime's Megatron fork): Megatron-Core's own
  ``RouterReplay`` replays the same routes, built as slime's
  ``prepare_routed_experts_for_routing_replay`` builds them (each sample's last-token row and
  the microbatch padding by ``_pad_routed_experts``);
* the loss: the summed next-token loss of the samples' tokens, reported per token (slime's
  policy loss needs advantages); the LR scheduler (none);
* ``pin_memory=True`` in ``TensorBackuper`` (no CUDA): dropped;
* Megatron's CUDA-only calls: tests/megatron_cpu.py.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "slime_reference"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_actor_excerpts as slime_src  # noqa: E402  (slime's own code, verbatim)

import megatron_selfcheck as ms  # noqa: E402
from routepack.integrations import slime as rs  # noqa: E402

PAD_MULTIPLIER = 4  # slime's --data-pad-size-multiplier (its default, 128, would mostly pad these tiny samples)


class _NoPinTorch:
    """``torch`` as the vendored ``TensorBackuper`` sees it: ``pin_memory`` dropped (no CUDA)."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name == "empty_like":
            return lambda *a, pin_memory=False, **k: attr(*a, **k)
        return attr


slime_src.torch = _NoPinTorch()


def named_params_and_buffers(args: Any, model: Any, convert_to_global_name: bool = True) -> Any:
    """slime's ``named_params_and_buffers`` with the user's line: ``model = rs.stock_layout(model)``."""
    model = rs.stock_layout(model)  # + (user change)
    return slime_src.named_params_and_buffers(args, model, convert_to_global_name)


def slime_args(case: Any, spec: bool, cap: int, global_batch_size: int) -> SimpleNamespace:
    """The slime/Megatron arguments the driver, the model provider and routepack read."""
    return SimpleNamespace(
        spec=("routepack.integrations.slime", "layer_spec") if spec else None,  # --spec (user change)
        routepack_slots_per_rank=case.slots_per_rank,  # --custom-config-path YAML (user change)
        routepack_replica_slots=case.replica_slots,
        num_experts=case.experts,
        num_layers=case.layers,
        expert_model_parallel_size=case.ep,
        num_gpus_per_node=case.gpus_per_node,
        transformer_impl="local",
        moe_token_dispatcher_type="alltoall",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_tensor_parallel_size=1,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=cap,
        micro_batch_size=1,
        global_batch_size=global_batch_size,
        data_pad_size_multiplier=PAD_MULTIPLIER,
        overlap_grad_reduce=False,
        save=None,
    )


def model_provider(args: Any, case: Any) -> Any:
    """slime's ``model_provider`` (``model_provider.py``): the ``--spec`` function called as
    ``spec(args, config, vp_stage)``, else its MoE default, ``get_gpt_decoder_block_spec``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    config = ms.config(case)
    if args.spec is not None:
        spec = import_module(args.spec)
        if callable(spec):
            spec = spec(args, config, None)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=case.vocab, max_sequence_length=512)


def setup_model_and_optimizer(args: Any, case: Any, init: bool) -> tuple:
    """slime's ``setup_model_and_optimizer`` with ``get_model`` stood in (module docstring);
    ``init``: the seeded logical weights (the stock model; the plan model loads them)."""
    model = model_provider(args, case)
    if init:
        ms.init_weights(model, case)
    ddp, opt = ms.wrap(model, case)
    return [ddp], opt


@torch.no_grad()
def load_weights(args: Any, model: List[Any], weights: Dict[str, torch.Tensor]) -> None:
    """As slime's ``load_model_hf_weights`` writes a checkpoint into the model: every tensor
    ``named_params_and_buffers`` yields, ``parameter.copy_(tensor)``."""
    for name, parameter in named_params_and_buffers(args, model):
        parameter.copy_(weights[name].to(device=parameter.device, dtype=parameter.dtype))


def _routes(args: Any, routed: List[torch.Tensor], pad: int) -> torch.Tensor:
    """[T, L, k]: what slime's ``prepare_routed_experts_for_routing_replay`` builds (TP = CP = 1)."""
    rows = [slime_src._pad_routed_experts(r, 1, args.num_experts) for r in routed]
    return slime_src._pad_routed_experts(torch.cat(rows), pad, args.num_experts)


def forward_step_fn(args: Any, case: Any) -> Any:
    """slime's ``forward_step`` (model.py) on the stand-ins of the module docstring."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple:
        batch = data_iterator.get_next(["tokens", "rollout_routed_experts"])
        tokens = batch["tokens"]
        n = sum(int(t.numel()) for t in tokens)
        pad = (PAD_MULTIPLIER - n % PAD_MULTIPLIER) % PAD_MULTIPLIER
        ids = torch.cat([*tokens, torch.zeros(pad, dtype=torch.long)])
        routes = _routes(args, batch["rollout_routed_experts"], pad)
        for l, r in enumerate(ms.routers(model)):
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(routes[:, l].to(torch.int64))
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        t = ids.numel()
        mask = torch.ones(t, t, dtype=torch.bool)
        keep = torch.zeros(t, dtype=torch.float32)
        start = 0
        for size in [int(x.numel()) for x in tokens] + ([pad] if pad else []):
            mask[start : start + size, start : start + size] = torch.triu(
                torch.ones(size, size, dtype=torch.bool), diagonal=1
            )
            if start + size <= n:
                keep[start : start + size - 1] = 1.0
            start += size
        labels = torch.roll(ids, -1)
        out = model(ids[None], torch.arange(t)[None], mask[None, None], labels=labels[None])

        def loss_function(output: torch.Tensor) -> tuple:
            loss = (output.float()[0] * keep).sum()
            tokens = int(keep.sum())
            return loss, torch.tensor(tokens, dtype=torch.int), {"loss": loss.detach().item() / tokens}

        return out, loss_function

    return forward_step


def train_one_step(args: Any, case: Any, step_id: int, data_iterator: Any, model: Any, optimizer: Any, n: int):
    """slime's ``train_one_step`` (model.py) with the user's two lines."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_step = forward_step_fn(args, case)
    forward_step = rs.begin_step(model, optimizer, data_iterator, step_id, forward_step)  # + (user change)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=n,
        seq_length=0,
        micro_batch_size=1,
        forward_only=False,
    )
    rs.finish_step(model)  # + (user change)
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return [x["loss"] for x in losses], float(grad_norm)


def train(args: Any, case: Any, model: Any, optimizer: Any, rollout_data: Dict[str, Any]) -> List[List[float]]:
    """slime's ``train`` (model.py): every step of the rollout, one data iterator throughout."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    data_iterator = [slime_src.DataIterator(rollout_data, rollout_data["micro_batch_indices"])]
    for it in data_iterator:
        it.reset()
    for chunk in model:
        chunk.train()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    out = []
    for step_id, n in enumerate(rollout_data["num_microbatches"]):
        losses, _ = train_one_step(args, case, step_id, data_iterator, model, optimizer, n)
        out.append(losses)
    return out


@torch.no_grad()
def forward_only(args: Any, case: Any, model: Any, rollout_data: Dict[str, Any]) -> List[float]:
    """slime's ``forward_only`` (a log-prob pass, e.g. the reference model's) over every
    microbatch of the rollout; the losses stand in for the log-probs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data_iterator = [slime_src.DataIterator(rollout_data, rollout_data["micro_batch_indices"])]
    for chunk in model:
        chunk.eval()
    out = get_forward_backward_func()(
        forward_step_func=forward_step_fn(args, case),
        data_iterator=data_iterator,
        model=model,
        num_microbatches=sum(rollout_data["num_microbatches"]),
        seq_length=0,
        micro_batch_size=1,
        forward_only=True,
    )
    return [x["loss"] for x in out]


def rollout(case: Any, rollout_id: int, samples: int, cap: int) -> Dict[str, Any]:
    """slime's train data for one rollout: per-sample tokens and the routes SGLang recorded
    (every token but the last), each layer's experts drawn from a skewed popularity that moves
    between rollouts (so placements change)."""
    rng = np.random.default_rng([case.seed, 13, rollout_id])
    data: Dict[str, Any] = {"tokens": [], "rollout_ids": [], "rollout_routed_experts": [], "rewards": []}
    base = np.array([0.4, 0.25, 0.1, 0.08, 0.07, 0.04, 0.03, 0.03])
    for s in range(samples):
        n = int(rng.integers(cap // 2 - 2, cap - 8))
        routed = np.zeros((n - 1, case.layers, case.top_k), dtype=np.int32)
        for l in range(case.layers):
            pop = np.roll(base, 3 * rollout_id + l)
            for t in range(n - 1):
                routed[t, l] = rng.choice(case.experts, size=case.top_k, replace=False, p=pop)
        g = torch.Generator().manual_seed(zlib.crc32(f"{case.seed}:{rollout_id}:{s}".encode()))
        data["tokens"].append(torch.randint(1, case.vocab, (n,), generator=g))
        data["rollout_ids"].append(s)
        data["rollout_routed_experts"].append(torch.from_numpy(routed))
        data["rewards"].append(float(rng.random()))
    return data


def exported(model: Any) -> Dict[str, np.ndarray]:
    """`routepack.integrations.megatron.export_weights` as numpy (collective over EP)."""
    from routepack.integrations import megatron as rm

    return {k: v.detach().numpy().copy() for k, v in rm.export_weights(model)}


def slime_view(args: Any, model: Any) -> Dict[str, np.ndarray]:
    """What slime's weight update reads on this rank: ``named_params_and_buffers`` (global names)."""
    return {k: v.detach().numpy().copy() for k, v in named_params_and_buffers(args, model)}
