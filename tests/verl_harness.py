"""A RayPPOTrainer-free harness that runs verl's own driver and worker code on CPU.

What is verl's (verl 0.9.1, imported): ``RayPPOTrainer._balance_batch`` (hooked by
routepack), ``_update_actor`` and ``_compute_old_log_prob`` called on a stand-in trainer
object, the dispatcher's chunking (``_split_args_kwargs_data_proto``), the worker's
``TrainingWorker.train_mini_batch`` / ``train_batch`` / ``infer_batch`` and
``_postprocess_output`` (unwrapped from their Ray decorators), ``make_iterator`` (mini-batches,
epochs), ``left_right_2_no_padding`` / ``no_padding_2_padding``, ``postprocess_batch_func``
(``restore_dynamic_batch``) and ``DataProto``/``TensorDict`` themselves.

What stands in for verl (no model, no GPU, no Ray): the worker group (a list of workers, one
per DP rank, called in turn), the trainer object's attributes, and the engine: its
``train_batch`` / ``infer_batch`` run the first lines of ``FSDPEngine.forward_backward_batch``
(``prepare_micro_batches`` as the engine module bound it, with its arguments), record the
microbatches, and return per-sample outputs (log-prob = the sample's position, so a wrong
restore shows) in place of a model's. A process group of one (gloo) backs the worker's
``all_gather_object`` calls.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import verl
from verl.protocol import DataProto
from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import postprocess_batch_func
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: F401  (the tests convert batches with it)

CONFIGS = {
    "fsdp": "trainer/config/_generated_ppo_trainer.yaml",
    "megatron": "trainer/config/_generated_ppo_megatron_trainer.yaml",
}
ENGINE_MODULES = {
    "fsdp": "verl.workers.engine.fsdp.transformer_impl",
    "megatron": "verl.workers.engine.megatron.transformer_impl",
}


def init_process_group() -> None:
    """One gloo process (rank 0 of 1): what the worker's collectives need on CPU."""
    if not dist.is_initialized():
        import tempfile

        store = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def verl_config(backend: str = "fsdp", v1: bool = False, **values: Any) -> Any:
    """verl's generated trainer config for ``backend`` with ``values`` set (dotted keys
    relative to the root, e.g. ``{"actor_rollout_ref.actor.ppo_epochs": 2}``), for the legacy
    trainer this harness runs (``trainer.use_v1=False``; ``v1=True`` keeps verl's default) and
    with the two verl settings a routepack run needs (dynamic batch sizes, recorded routes)."""
    import os

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), CONFIGS[backend]))
    defaults = {
        "trainer.use_v1": v1,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.multi_turn.enable": False,
        "trainer.n_gpus_per_node": 2,
    }
    for key, value in {**defaults, **values}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def data_proto(vb: Any, prompt: int) -> DataProto:
    """verl's batch for a `verl_batches.VerlBatch` (prompts left-padded to ``prompt``)."""
    mask = torch.from_numpy(vb.attention_mask)
    b, t = mask.shape
    ids = torch.arange(b * t).reshape(b, t) % 97 + 3
    tensors = {
        "input_ids": ids,
        "prompts": ids[:, :prompt],
        "responses": ids[:, prompt:],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": torch.from_numpy(vb.response_mask),
        "routed_experts": torch.from_numpy(vb.routed_experts),
    }
    uid = np.array([f"s{i}" for i in range(b)], dtype=object)
    return DataProto.from_dict(tensors, {"uid": uid}, meta_info={"temperature": 1.0})


class Engine:
    """Stands in for verl's engine on one DP rank: ``prepare_micro_batches`` as the engine
    module calls it, the microbatches recorded, per-sample outputs instead of a model's."""

    def __init__(self, backend: str, rank: int, dp: int, log: List[Dict[str, Any]], record_routes: Any = None):
        self.backend, self.rank, self.dp, self.log, self.record_routes = backend, rank, dp, log, record_routes
        self.module = importlib.import_module(ENGINE_MODULES[backend])
        self.vpp_group = None  # Megatron's num_batches_divided_by (microbatch_group_size_per_vp_stage under VPP)
        self.force_group_size = None  # set on the data as verl's reward-model trainer does

    def get_data_parallel_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_group(self) -> Any:
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def lr_scheduler_step(self) -> float:
        return 1e-6

    @contextlib.contextmanager
    def train_mode(self, **_: Any):
        yield

    eval_mode = train_mode

    def _run(self, data: Any, forward_only: bool) -> Dict[str, Any]:
        tu.assign_non_tensor(data, sp_size=1)  # FSDPEngine.forward_backward_batch's first lines
        if self.force_group_size is not None:
            tu.assign_non_tensor(data, force_group_size=self.force_group_size)
        kwargs = {"num_batches_divided_by": self.vpp_group} if self.backend == "megatron" else {}
        micro_batches, indices = self.module.prepare_micro_batches(
            data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True, **kwargs
        )
        ids = data["routepack_sample"][:, 1].tolist() if "routepack_sample" in data.keys() else None
        self.log.append(
            {
                "rank": self.rank,
                "forward_only": forward_only,
                "samples": ids,
                "micro": [[ids[i] for i in idx] for idx in indices] if ids is not None and indices else None,
                "sizes": [len(m) for m in micro_batches],
                "tokens": [int(m["input_ids"].offsets().diff().sum()) for m in micro_batches],
            }
        )
        outputs = []
        for m in micro_batches:
            lens = m["input_ids"].offsets().diff().tolist()
            pos = m["routepack_sample"][:, 1].tolist() if "routepack_sample" in m.keys() else [0] * len(lens)
            out = {
                "log_probs": torch.nested.as_nested_tensor(
                    [torch.full((n,), float(p)) for n, p in zip(lens, pos)], layout=torch.jagged
                )
            }
            out["entropy"] = out["log_probs"]
            if forward_only and self.record_routes is not None:
                out["routed_experts"] = torch.nested.as_nested_tensor(
                    [self.record_routes(n) for n in lens], layout=torch.jagged
                )
            outputs.append({"model_output": out, "loss": 0.0, "metrics": {}})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def train_batch(self, data: Any, loss_function: Any) -> Dict[str, Any]:
        out = self._run(data, False)
        out["loss"] = [0.0] * max(1, len(out["loss"]))
        return out

    def infer_batch(self, data: Any, loss_function: Any) -> Dict[str, Any]:
        out = self._run(data, True)
        out["loss"] = [0.0]
        return out


def worker(backend: str, rank: int, dp: int, config: Any, log: List[Dict[str, Any]], record_routes: Any = None) -> Any:
    """A stand-in ``TrainingWorker`` instance (verl's methods bound to it)."""
    actor = config.actor_rollout_ref.actor
    w = SimpleNamespace(
        engine=Engine(backend, rank, dp, log, record_routes),
        profiler=SimpleNamespace(step=lambda: None),
        loss_fn=lambda *a, **k: None,
        engine_config=SimpleNamespace(
            forward_only=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=int(actor.ppo_max_token_len_per_gpu),
            infer_max_token_len_per_gpu=int(actor.ppo_max_token_len_per_gpu),
            micro_batch_size_per_gpu=None,
            infer_micro_batch_size_per_gpu=None,
            use_fused_kernels=False,
        ),
        model_config={"use_remove_padding": True},
        flops_counter=SimpleNamespace(estimate_flops=lambda *a, **k: (1.0, 1.0)),
        device_name="cpu",
    )
    for name in ("train_mini_batch", "train_batch", "infer_batch", "_postprocess_output"):
        setattr(w, name, inspect.unwrap(getattr(TrainingWorker, name)).__get__(w))  # past the Ray/profiler decorators
    return w


class WorkerGroup:
    """verl's worker group, in-process: equal chunks (verl's own splitting) to each rank's
    worker in turn; rank 0's output returned (outputs concatenated for log-prob)."""

    def __init__(self, workers: List[Any]):
        self.workers, self._dispatch_info = workers, {}

    def _query_dispatch_info(self, role: str) -> List[int]:
        return list(range(len(self.workers)))

    def _chunks(self, td: Any) -> List[Any]:
        (chunks,), _ = _split_args_kwargs_data_proto(len(self.workers), td)
        return [c.clone() for c in chunks]  # what a worker receives through Ray: its own, unlocked copy

    def update_actor(self, td: Any) -> Any:
        outs = [w.train_mini_batch(c) for w, c in zip(self.workers, self._chunks(td))]
        return outs[0]

    def compute_log_prob(self, td: Any) -> Any:
        outs = [w.infer_batch(c) for w, c in zip(self.workers, self._chunks(td))]
        metrics = tu.get(outs[0], "metrics")
        merged = tu.concat_tensordict([tu.get_keys(o, [k for k in o.keys() if k != "metrics"]) for o in outs])
        tu.assign_non_tensor(merged, metrics=metrics)
        return merged


class Trainer:
    """The attributes of a ``RayPPOTrainer`` that ``_balance_batch``, ``_update_actor`` and
    ``_compute_old_log_prob`` read; verl's methods called on it."""

    def __init__(self, config: Any, workers: List[Any]):
        self.config, self.actor_rollout_wg = config, WorkerGroup(workers)
        self.global_steps, self.use_prefix_grouper = 1, False

    _get_dp_size = RayPPOTrainer._get_dp_size

    def balance(self, batch: DataProto, metrics: Dict[str, Any]) -> None:
        RayPPOTrainer._balance_batch(self, batch, metrics=metrics)  # the class attribute: hooked or not
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()  # as fit() does

    def old_log_prob(self, batch: DataProto) -> Any:
        return RayPPOTrainer._compute_old_log_prob(self, batch)

    def update_actor(self, batch: DataProto) -> Any:
        return RayPPOTrainer._update_actor(self, batch)


def harness(backend: str, dp: int, config: Any, record_routes: Any = None):
    """(trainer, log): a stand-in trainer over ``dp`` stand-in workers, and the list every
    engine call appends its microbatches to."""
    init_process_group()
    log: List[Dict[str, Any]] = []
    workers = [worker(backend, r, dp, config, log, record_routes) for r in range(dp)]
    return Trainer(config, workers), log
