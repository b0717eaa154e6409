"""routepack's Megatron execution inside verl's Megatron engine (``verl.workers.engine.megatron``,
verl 0.9): the plans the driver ships with each PPO mini-batch are carried out whole, expert
placement, migration, redundant experts and replicas included.

Hooked by `patch_engine` (`routepack.integrations.verl.setup_process` / ``install`` on the
workers), on ``MegatronEngine``:

* ``_build_megatron_module``: the actor's model is built through the bridge with
  `routepack.integrations.megatron.plan_layer_spec` (physical slots and replica buffers; the
  layout from ``actor.megatron.override_mcore_model_config.routepack``: ``slots_per_rank``,
  ``replica_slots``), and a `MegatronRunner` (`routepack.integrations.megatron.handoff.Handoff`)
  is tied to the DDP-wrapped model. The bridge's HF name mapping (load) and export (weight sync
  to the rollout engine, HF checkpoints) see logical experts.
* ``forward_backward_batch`` / verl's ``make_batch_generator``: a training pass over a planned
  mini-batch first runs ``begin_window(plan, window, optimizer)`` (migration with the
  optimizer's state) and feeds Megatron's schedule the plan's microbatches in order; a pass
  verl microbatches itself (a fallback) runs with the placement in force.
* ``optimizer_step``: `MegatronRunner.finish_step` (or the redundant experts' sum after an
  unplanned pass) before Megatron's optimizer steps.
* ``save_checkpoint``: refuses optimizer state of a model with redundant slots or replica
  buffers (not placement-independent yet), naming ``checkpoint.save_contents``.

What the hand-off cannot map makes it run the schedule alone, said once: `limits` (shared with
the driver, which then plans without placement).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Dict, List, Mapping, Optional

from routepack._checks import positive_int
from routepack.errors import RoutepackError
from routepack.integrations.megatron.handoff import Handoff, unpack_plan
from routepack.integrations.verl.plans import PLAN_PREFIX, SAMPLE_KEY

LOG = logging.getLogger("routepack.integrations.verl")
#: The key of routepack's layout in ``actor.megatron.override_mcore_model_config``.
LAYOUT_KEY = "routepack"
_LAYOUT_KEYS = ("slots_per_rank", "replica_slots")
#: engine id -> its `Handoff`
HANDOFFS: Dict[int, Handoff] = {}
_ORIGINALS: Dict[str, Any] = {}
_SAID: set = set()
#: the training pass in progress: engine, data, handoff (set by the forward_backward_batch hook)
_PASS: Dict[str, Any] = {}
#: the last `prepare_micro_batches` answer routepack gave: (id of the data, index lists) or None
LAST_PLANNED: Dict[str, Any] = {}


def say_once(kind: str, message: str) -> None:
    if kind not in _SAID:
        _SAID.add(kind)
        LOG.warning("routepack (worker): %s [logged once]", message)


def layout(override: Any) -> Dict[str, Optional[int]]:
    """``{"slots_per_rank": int or None, "replica_slots": int}`` from verl's
    ``override_mcore_model_config`` (its ``routepack`` entry), refusing other keys."""
    section = None
    if override is not None:
        try:
            section = override.get(LAYOUT_KEY)
        except Exception:  # an OmegaConf node in struct mode
            section = None
    section = dict(section or {})
    unknown = sorted(set(section) - set(_LAYOUT_KEYS))
    if unknown:
        raise RoutepackError(
            f"actor_rollout_ref.actor.megatron.override_mcore_model_config.{LAYOUT_KEY}: unknown key(s) {unknown}; "
            f"expected {list(_LAYOUT_KEYS)}"
        )
    where = f"override_mcore_model_config.{LAYOUT_KEY}"
    spr = section.get("slots_per_rank")
    return {
        "slots_per_rank": None if spr is None else positive_int(int(spr), f"{where}.slots_per_rank"),
        "replica_slots": positive_int(int(section.get("replica_slots", 0) or 0), f"{where}.replica_slots", minimum=0),
    }


#: the ``actor.megatron`` settings `limits` reads
LIMIT_KEYS = (
    "vanilla_mbridge",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_tensor_parallel_size",
    "use_megatron_fsdp",
    "dynamic_context_parallel",
)


def limits(values: Mapping[str, Any]) -> Optional[str]:
    """Why the hand-off cannot carry out placement in a Megatron engine with these settings
    (None: it can). ``values``: verl's ``actor.megatron`` names (``vanilla_mbridge``,
    ``tensor_model_parallel_size``, ...). Read on the driver from the config and on a worker
    from Megatron's parallel state, so both decide alike."""
    p = "actor_rollout_ref.actor.megatron"
    if not values.get("vanilla_mbridge", False):
        return (
            f"{p}.vanilla_mbridge=False (Megatron-Bridge): its HF export and load number experts by Megatron's "
            "static layout; routepack maps the names of mbridge (vanilla_mbridge=True) or of dist checkpoints only"
        )
    for key, why in (
        ("tensor_model_parallel_size", "the logical export gathers no tensor-parallel shards"),
        ("pipeline_model_parallel_size", "the logical export and HF names cover one stage"),
        ("virtual_pipeline_model_parallel_size", "one model chunk per rank"),
        ("context_parallel_size", "routepack's MoE layer refuses context parallelism"),
        ("expert_tensor_parallel_size", "routepack's MoE layer refuses expert tensor parallelism"),
    ):
        if int(values.get(key) or 1) > 1:
            return f"{p}.{key}={values.get(key)} ({why})"
    for key in ("use_megatron_fsdp", "dynamic_context_parallel"):
        if values.get(key):
            return f"{p}.{key}=True (not supported by routepack's Megatron execution)"
    return None


def expert_limits(grouped: Any, mode: Any) -> List[str]:
    """Why a plan's placement cannot run in the model verl builds (empty: it can), past
    `limits`: live routing (``router_replay.mode``) and grouped experts (``grouped``: the
    config's ``override_transformer_config.moe_grouped_gemm``, None where unset: mbridge's MoE
    bridges set ``moe_grouped_gemm=True``, building ``TEGroupedMLP``)."""
    p = "actor_rollout_ref.actor.megatron"
    out = []
    if mode not in ("R2", "R3"):
        out.append(
            f"{p}.router_replay.mode={mode!r}: the trainer's router routes live, so experts placed and copied for the "
            f"replayed routes would not meet the tokens they were planned for; {p}.router_replay.mode=R3 enables it"
        )
    if grouped is not False:
        out.append(
            f"{p}.override_transformer_config.moe_grouped_gemm is not False: mbridge builds grouped experts "
            "(TEGroupedMLP), which routepack's MoE layer does not run under a plan yet; "
            f"+{p}.override_transformer_config.moe_grouped_gemm=False builds SequentialMLP experts, which it runs"
        )
    return out


# ----------------------------------------------------------------------- model building
def _worker_values(engine: Any) -> Dict[str, Any]:
    from megatron.core import parallel_state as mpu

    cfg = engine.engine_config
    return {
        "vanilla_mbridge": getattr(engine, "vanilla_bridge", False) and getattr(engine, "provider", None) is None,
        "tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": getattr(cfg, "virtual_pipeline_model_parallel_size", None),
        "context_parallel_size": mpu.get_context_parallel_world_size(),
        "expert_tensor_parallel_size": mpu.get_expert_tensor_parallel_world_size(),
        "use_megatron_fsdp": getattr(cfg, "use_megatron_fsdp", False),
        "dynamic_context_parallel": getattr(cfg, "dynamic_context_parallel", False),
    }


def gpus_per_node() -> int:
    """The trainer's GPUs per node as a worker sees it: verl's ``RAY_LOCAL_WORLD_SIZE``
    (``LOCAL_WORLD_SIZE`` under torchrun), else 8 (verl's ``trainer.n_gpus_per_node`` default)."""
    for var in ("RAY_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var):
            return positive_int(int(os.environ[var]), var)
    return 8


def worker_topology(num_experts: int, settings: Mapping[str, Any]) -> Any:
    from megatron.core import parallel_state as mpu

    from routepack.model import Topology

    ep = mpu.get_expert_model_parallel_world_size()
    spr = settings["slots_per_rank"] or -(-num_experts // ep)
    return Topology(
        dp=mpu.get_data_parallel_world_size(),
        ep=ep,
        gpus_per_node=gpus_per_node(),
        slots_per_rank=spr,
        replica_slots=settings["replica_slots"],
    )


def _build_megatron_module(self: Any) -> Any:
    """``MegatronEngine._build_megatron_module``: the actor's model with routepack's MoE layers."""
    original = _ORIGINALS["MegatronEngine:_build_megatron_module"]
    if self.engine_config.forward_only or getattr(self, "is_value_model", False):
        return original(self)
    why = limits(_worker_values(self))
    bridge = getattr(self, "bridge", None)
    config = getattr(bridge, "config", None)
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        return original(self)
    missing = [a for a in ("_get_transformer_layer_spec", "export_weights") if not hasattr(bridge, a)]
    if why is None and missing:
        why = f"the bridge {type(bridge).__name__} has no {missing} (mbridge's AutoBridge has)"
    if why is None and getattr(config, "moe_grouped_gemm", False):  # what the bridge builds, as the driver reads it
        why = "; ".join(expert_limits(True, "R3"))
    replay = getattr(getattr(self.engine_config, "router_replay", None), "mode", "R3")
    if why is None and replay not in ("R2", "R3"):
        why = "; ".join(expert_limits(False, replay))
    if why is not None:
        say_once("schedule_only", f"the Megatron engine runs routepack's schedule only: {why}")
        return original(self)
    settings = layout(self.engine_config.override_mcore_model_config)
    topo = worker_topology(int(experts), settings)
    hook_bridge(bridge, topo, int(settings["replica_slots"] or 0))
    module = original(self)
    HANDOFFS[id(self)] = Handoff(module, topo, "verl's Megatron engine")
    return module


def hook_bridge(bridge: Any, topo: Any, replica_slots: int) -> None:
    """On one mbridge bridge instance: layer specs through `plan_layer_spec`; the local → global
    name map (its HF load) with every slot named by the logical expert it holds; its export
    (weight sync, HF checkpoint save) in logical experts."""
    from routepack.integrations.megatron import plan_layer_spec

    spec_fn = bridge._get_transformer_layer_spec
    names_fn = getattr(bridge, "_weight_name_mapping_mcore_local_to_global", None)

    def _get_transformer_layer_spec(*args: Any, **kwargs: Any) -> Any:
        return plan_layer_spec(spec_fn(*args, **kwargs), topo, replica_slots)

    bridge._get_transformer_layer_spec = _get_transformer_layer_spec
    if names_fn is not None:
        bridge._weight_name_mapping_mcore_local_to_global = lambda model, consider_ep=True: logical_names(
            model, names_fn(model, consider_ep=False)
        )
    bridge.export_weights = lambda models: logical_export(bridge, models)


_EXPERT = re.compile(
    r"^(?P<owner>.*\.mlp\.experts\.)(?:local_experts\.(?P<i>\d+)\.(?P<rest>.+)|(?P<tail>.+?)(?P<j>\d+))$"
)


def _unwrap(model: Any) -> Any:
    import torch

    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def logical_names(model: Any, names: Dict[str, str]) -> Dict[str, str]:
    """``names`` (local → global state-dict names) with each local expert of a routepack MoE
    layer named by the logical expert it holds (an empty slot or replica buffer: its layer's
    expert 0, which it never computes)."""
    from routepack.integrations.megatron.layer import PlanMoELayer

    inner = _unwrap(model)
    owners = {f"{n}.experts.": m for n, m in inner.named_modules() if isinstance(m, PlanMoELayer)}
    out = {}
    for local, name in names.items():
        m, g = _EXPERT.match(local), _EXPERT.match(name)
        layer = owners.get(m.group("owner")) if m is not None else None
        if layer is None or m is None or g is None:
            out[local] = name
            continue
        slot = int(m.group("i") if m.group("i") is not None else m.group("j"))
        e = max(int(layer.slot_experts()[slot]), 0)
        out[local] = (
            f"{g.group('owner')}local_experts.{e}.{g.group('rest')}"
            if g.group("i") is not None
            else f"{g.group('owner')}{g.group('tail')}{e}"
        )
    return out


def logical_export(bridge: Any, models: Any) -> Any:
    """mbridge's ``export_weights`` for a routepack model: `export_weights` (every expert in
    logical order, collective over the EP group) through the bridge's own
    ``_weight_to_hf_format``; buffers other than ``expert_bias`` left out, as mbridge does."""
    from routepack.integrations.megatron.checkpoint import export_weights

    chunks = list(models) if isinstance(models, (list, tuple)) else [models]
    skip = set()
    for c in chunks:
        inner = _unwrap(c)
        params = {n for n, _ in inner.named_parameters()}
        skip |= {k for k in inner.state_dict() if k not in params and "expert_bias" not in k}
    for name, tensor in export_weights(chunks):
        if name in skip:
            continue
        names, tensors = bridge._weight_to_hf_format(name, tensor)
        yield from zip(names, tensors)


# ----------------------------------------------------------------------- training passes
def _forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
    original = _ORIGINALS["MegatronEngine:forward_backward_batch"]
    handoff = HANDOFFS.get(id(self))
    if handoff is None or forward_only:
        return original(self, data, loss_function, forward_only)
    _PASS.update(engine=self, data=data, handoff=handoff)
    LAST_PLANNED.clear()
    try:
        return original(self, data, loss_function, forward_only)
    finally:
        _PASS.clear()


def _make_batch_generator(batches: Any, vpp_size: int) -> Any:
    """verl's ``make_batch_generator`` with the plan's microbatches made current one by one."""
    gen = _ORIGINALS["transformer_impl:make_batch_generator"](batches, vpp_size)
    if not _PASS:
        return gen
    handoff, engine, data = _PASS["handoff"], _PASS["engine"], _PASS["data"]
    found = _minibatch_plan(data, batches)
    if found is None:
        handoff.unplanned()
        return gen
    plan, window, topo, micro_ids = found
    handoff.check_topology(topo, "the mini-batch's plan")
    handoff.begin(plan, window, engine.optimizer, micro_ids)
    return handoff.iterate(gen)


def _minibatch_plan(data: Any, batches: List[Any]) -> Optional[tuple]:
    """(plan, window, topology, the plan's microbatch of each of ``batches``) when the pass's
    microbatches are the planned ones of one mini-batch; None otherwise (said once)."""
    from verl.utils import tensordict_utils as tu

    planned = LAST_PLANNED.get("idx") if LAST_PLANNED.get("data") == id(data) else None
    if planned is None:
        say_once("unplanned", "a training pass ran verl's own microbatches: the placement in force runs, unplanned")
        return None
    ids = data[SAMPLE_KEY][:, 1].tolist()
    payloads = {k: tu.get_non_tensor_data(data, k, None) for k in data.keys() if isinstance(k, str)}
    payloads = {k: v for k, v in payloads.items() if k.startswith(PLAN_PREFIX) and isinstance(v, dict)}
    position = {int(ids[i]): i for i in range(len(ids))}
    hits = []
    for p in payloads.values():
        for r, cells in enumerate(p["ranks"]):
            micro = {int(q): m for m, cell in enumerate(cells) for q in cell}
            if position and all(q in micro for q in position):
                hits.append((p, r, micro))
    if len(hits) != 1:
        say_once(
            "multi", "a training pass holds samples of several mini-batches: the placement in force runs, unplanned"
        )
        return None
    p, r, micro = hits[0]
    plan, window, topo = unpack_plan(p.get("megatron"), f"plan {p.get('step')}/{p.get('minibatch')}")
    group = r // topo.ep
    for rank in range(group * topo.ep, (group + 1) * topo.ep):
        if any(len(c) == 0 for c in p["ranks"][rank]):
            say_once("empty", f"the plan leaves a microbatch of DP rank {rank} empty: it runs unplanned")
            return None
    return plan, window, topo, [micro[int(ids[idx[0]])] for idx in planned]


def _optimizer_step(self: Any) -> Any:
    handoff = HANDOFFS.get(id(self))
    if handoff is not None:
        handoff.before_optimizer_step()
    return _ORIGINALS["MegatronEngine:optimizer_step"](self)


def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
    handoff = HANDOFFS.get(id(self))
    if handoff is not None:
        contents = list(getattr(self.checkpoint_config, "save_contents", None) or [])
        topo, experts = handoff.topo, handoff.runner.layers[0].num_logical
        if "optimizer" in contents and (topo.num_slots > experts or topo.replica_slots > 0):
            raise RoutepackError(
                "actor_rollout_ref.actor.checkpoint.save_contents: 'optimizer' state of a model with redundant slots "
                f"or replica buffers ({topo.num_slots} slots for {experts} experts, replica_slots="
                f"{topo.replica_slots}) is not placement-independent yet; save ['model', 'extra'] or plan with "
                "slots_per_rank = E / ep and replica_slots = 0"
            )
    return _ORIGINALS["MegatronEngine:save_checkpoint"](self, *args, **kwargs)


def patch_engine() -> bool:
    """Hooks verl's Megatron engine in this process; False where it does not import (no
    megatron-core, or another verl)."""
    try:
        from verl.workers.engine.megatron import transformer_impl as ti
    except ImportError:
        return False
    cls = ti.MegatronEngine
    for name, hook in (
        ("_build_megatron_module", _build_megatron_module),
        ("forward_backward_batch", _forward_backward_batch),
        ("optimizer_step", _optimizer_step),
        ("save_checkpoint", _save_checkpoint),
    ):
        if cls.__dict__.get(name) is not hook:
            _ORIGINALS.setdefault(f"MegatronEngine:{name}", cls.__dict__[name])
            setattr(cls, name, hook)
    if ti.make_batch_generator is not _make_batch_generator:
        _ORIGINALS.setdefault("transformer_impl:make_batch_generator", ti.make_batch_generator)
        ti.make_batch_generator = _make_batch_generator
    return True


def unpatch_engine() -> None:
    ti = sys.modules.get("verl.workers.engine.megatron.transformer_impl")
    if ti is None:
        return
    for key, value in _ORIGINALS.items():
        owner, name = key.split(":")
        setattr(ti.MegatronEngine if owner == "MegatronEngine" else ti, name, value)


__all__ = [
    "HANDOFFS",
    "LAYOUT_KEY",
    "LIMIT_KEYS",
    "expert_limits",
    "hook_bridge",
    "layout",
    "limits",
    "logical_export",
    "logical_names",
    "patch_engine",
    "unpatch_engine",
]
