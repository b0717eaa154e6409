"""verl's v1 trainer (``trainer.use_v1=true``, what ``python -m verl.trainer.main_ppo`` starts
by default in verl 0.9.1) on CPU, on top of `verl_harness`'s workers and engine stand-in.

What is verl's (imported): the v1 ``PPOTrainer._balance_batch`` (hooked by routepack),
``_get_required_batch_multiple``, ``_compute_old_log_prob`` and ``_update_actor`` called on a
stand-in trainer object; ``upsample_batch_to_divisible_size``; TransferQueue's own
``KVBatchMeta`` (its ``reorder`` and ``chunk``, which verl's dispatcher calls to cut equal DP
chunks); the agent loop's ``list_of_dict_to_tensordict`` (how samples enter TransferQueue); the
worker's ``train_mini_batch`` / ``infer_batch`` (as in `verl_harness`).

What stands in: TransferQueue's key-value store (``tq.kv_batch_put`` / ``kv_batch_get``, as the
trainer module and verl's padding module bound ``tq``). TransferQueue's controller and storage
units are Ray actors; ``tq.init()`` on a local Ray did not return within 5 minutes on this CPU
machine, so the store is a dict per partition that returns what TransferQueue returns: a
``TensorDict`` of the selected fields, jagged nested tensors for fields put as nested. The
worker group's transport stands in for ``tqbridge`` with its own lines
(``_async_meta_to_realdata``: the chunk's fields fetched, ``extra_info`` assigned as non-tensor
data) and, for a pass with outputs, ``_update_meta_with_output`` (the output's tensors put back).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import torch
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

import verl_harness as vh
from verl.trainer.ppo import padding_utils
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu


class KVStore:
    """TransferQueue's key-value interface over a dict: ``{(partition, key): {field: tensor}}``."""

    def __init__(self) -> None:
        self.rows: Dict[tuple, Dict[str, torch.Tensor]] = {}
        self.tags: Dict[tuple, dict] = {}
        self.nested: set = set()

    def kv_batch_put(self, keys: List[str], partition_id: str, fields: Any = None, tags: Any = None) -> KVBatchMeta:
        for i, key in enumerate(keys):
            row = self.rows.setdefault((partition_id, key), {})
            for name in [] if fields is None else fields.keys():
                value = fields[name]
                if getattr(value, "is_nested", False):
                    self.nested.add(name)
                    row[name] = value.unbind()[i].clone()
                elif isinstance(value, torch.Tensor):
                    row[name] = value[i].clone()
            if tags is not None:
                self.tags[(partition_id, key)] = {**self.tags.get((partition_id, key), {}), **tags[i]}
        names = sorted(set().union(*(self.rows[(partition_id, k)].keys() for k in keys))) if keys else []
        return KVBatchMeta(
            keys=list(keys),
            tags=[self.tags.get((partition_id, k), {}) for k in keys],
            partition_id=partition_id,
            fields=names,
        )

    def kv_batch_get(self, keys: List[str], partition_id: str, select_fields: Any = None) -> TensorDict:
        rows = [self.rows[(partition_id, k)] for k in keys]
        names = list(select_fields) if select_fields is not None else sorted(rows[0].keys())
        out = {}
        for name in names:
            values = [r[name] for r in rows]  # KeyError where a sample lacks the field, as TransferQueue raises
            if name in self.nested:
                out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
            else:
                out[name] = torch.stack(values)
        return TensorDict(out, batch_size=len(keys))


def install_store(monkeypatch: Any) -> KVStore:
    """The stand-in store as ``tq`` where verl's v1 trainer and its padding call it."""
    store = KVStore()
    for module in (trainer_base, padding_utils):
        monkeypatch.setattr(module, "tq", store)
    return store


def put_samples(store: KVStore, samples: List[Dict[str, Any]], step: int) -> KVBatchMeta:
    """Samples as the v1 agent loop puts them (``AgentLoopWorkerTQ._agent_loop_postprocess``):
    one dict per sample, ``list_of_dict_to_tensordict``, tags with ``seq_len``."""
    keys = [f"s{step}_{i}" for i in range(len(samples))]
    tags = [
        {"status": "success", "prompt_len": s["prompts"].numel(), "response_len": s["responses"].numel()}
        for s in samples
    ]
    for tag in tags:
        tag["seq_len"] = tag["prompt_len"] + tag["response_len"]
    fields = tu.list_of_dict_to_tensordict(samples)
    for name in fields.keys():
        if getattr(fields[name], "is_nested", False):
            store.nested.add(name)
    return store.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)


def agent_loop_sample(rng: Any, prompt: int, response: int, layers: int, k: int, experts: int) -> Dict[str, Any]:
    """One sample as verl's agent loop builds it (``agent_loop.py``): prompt and response ids,
    ``routed_experts`` int16 ``[prompt + response, L, k]`` aligned from the first prompt token,
    the rollout's ``n - 1`` rows and a zero row for the last generated token."""
    n = prompt + response
    ids = torch.from_numpy(rng.integers(3, 97, size=n)).long()
    routes = np.zeros((n, layers, k), dtype=np.int16)
    for t in range(n - 1):
        for layer in range(layers):
            routes[t, layer] = rng.choice(experts, size=k, replace=False)
    return {
        "prompts": ids[:prompt],
        "responses": ids[prompt:],
        "response_mask": torch.ones(response, dtype=torch.int64),
        "rollout_log_probs": torch.zeros(response, dtype=torch.float32),
        "input_ids": ids,
        "attention_mask": torch.ones(n, dtype=torch.int64),
        "position_ids": torch.arange(n),
        "routed_experts": torch.from_numpy(routes),
    }


class WorkerGroup(vh.WorkerGroup):
    """verl's worker group for KVBatchMeta batches: ``KVBatchMeta.chunk`` (verl's dispatcher)
    to each rank's worker in turn, each chunk's data fetched as ``tqbridge`` fetches it."""

    def __init__(self, workers: List[Any], store: KVStore) -> None:
        super().__init__(workers)
        self.store = store

    def _fetch(self, chunk: KVBatchMeta) -> TensorDict:
        data = self.store.kv_batch_get(keys=chunk.keys, partition_id=chunk.partition_id)
        for key, val in copy.deepcopy(chunk.extra_info).items():
            tu.assign_non_tensor_data(tensor_dict=data, key=key, val=val)
        return data

    def update_actor(self, batch: KVBatchMeta) -> Any:
        outs = [w.train_mini_batch(self._fetch(c)) for w, c in zip(self.workers, batch.chunk(len(self.workers)))]
        return outs[0]

    def compute_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        for w, c in zip(self.workers, batch.chunk(len(self.workers))):
            out = w.infer_batch(self._fetch(c))
            tensors = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
            self.store.kv_batch_put(keys=c.keys, partition_id=c.partition_id, fields=out.select(*tensors))
        return batch


class Trainer:
    """The attributes of a v1 ``PPOTrainer`` that ``_balance_batch``, ``_compute_old_log_prob``
    and ``_update_actor`` read; verl's methods called on it."""

    def __init__(self, config: Any, workers: List[Any], store: KVStore) -> None:
        self.config, self.actor_rollout_wg = config, WorkerGroup(workers, store)
        self.global_steps, self.use_critic = 1, False
        self.tokenizer = SimpleNamespace(eos_token_id=2)

    _get_required_batch_multiple = PPOTrainer._get_required_batch_multiple

    def balance(self, batch: KVBatchMeta, metrics: Dict[str, Any]) -> KVBatchMeta:
        return PPOTrainer._balance_batch(self, batch, metrics=metrics)  # the class attribute: hooked or not

    def old_log_prob(self, batch: KVBatchMeta, metrics: Dict[str, Any]) -> KVBatchMeta:
        return PPOTrainer._compute_old_log_prob(self, batch, metrics=metrics)

    def update_actor(self, batch: KVBatchMeta, metrics: Dict[str, Any]) -> KVBatchMeta:
        return PPOTrainer._update_actor(self, batch, metrics=metrics)


def harness(backend: str, dp: int, config: Any, store: KVStore):
    """(trainer, log): a stand-in v1 trainer over ``dp`` of `verl_harness`'s workers."""
    vh.init_process_group()
    log: List[Dict[str, Any]] = []
    workers = [vh.worker(backend, r, dp, config, log) for r in range(dp)]
    return Trainer(config, workers, store), log
