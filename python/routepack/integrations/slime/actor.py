"""routepack's Megatron execution inside slime's Megatron actor (slime at 624b824:
``slime/backends/megatron_utils``): the plans `routepack.integrations.slime.plan_dp_schedule`
makes on the driver are carried out whole, expert placement, migration, redundant experts and
intra-batch replicas included. The call sites (docs/trainers.md has the user change):

* `layer_spec`: slime's ``--spec routepack.integrations.slime layer_spec`` (slime's model
  provider calls ``spec(args, config, vp_stage)``): slime's own default spec for an MoE model
  with its MoE layers made routepack's (`routepack.integrations.megatron.plan_layer_spec`);
  `plan_spec` does the same to a spec of the user's own. The layout: ``slots_per_rank`` and
  ``replica_slots`` from ``args.routepack_slots_per_rank`` / ``args.routepack_replica_slots``
  (slime's ``--custom-config-path`` YAML sets them), read alike by the driver's planner.
* `step_plans` (driver, ``_split_train_data_by_dp``): each training step's plan with its
  window and topology (`routepack.integrations.megatron.handoff.pack_plan`), shipped to every
  DP rank in its ``rollout_data[PLANS_KEY]``.
* `begin_step` (``train_one_step``, before Megatron's ``forward_backward_func``): the step's
  plan goes to a `routepack.integrations.megatron.handoff.Handoff` tied to the model (made at
  the first step): ``begin_window`` (migration of weights, ``main_grad`` and the optimizer's
  state), and Megatron's ``forward_step_func`` makes the plan's microbatches current in order.
* `finish_step` (before ``optimizer.step()``): ``MegatronRunner.finish_step`` (after a step
  without plans, the redundant experts' gradients summed).
* `stock_layout` (slime's ``named_params_and_buffers``): the model in Megatron's stock expert
  layout (`routepack.integrations.megatron.stock`), for the weight update to SGLang, slime's
  weight backups (reference / old actor models) and its HF checkpoint load and save.

What slime's configuration does not let the hand-off map is in `limits` (shared with the
driver, which then plans the schedule alone): named by the option. This module needs numpy
only until a function that touches the model runs.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import numpy as np

from routepack._checks import positive_int
from routepack.errors import RoutepackError

LOG = logging.getLogger("routepack.integrations.slime")
#: The key of the shipped plans in each DP rank's ``rollout_data``.
PLANS_KEY = "routepack_plans"
#: slime arguments (``--custom-config-path`` YAML keys) holding the MoE layers' layout.
LAYOUT_ARGS = {"slots_per_rank": "routepack_slots_per_rank", "replica_slots": "routepack_replica_slots"}
#: the ``--custom-config-path`` YAML key naming the model-plugin spec `layer_spec` wraps
SPEC_ARG = "routepack_spec"
_SAID: set = set()
#: id of a model's first chunk -> (that chunk, its Handoff or None for a stock model)
_HANDOFFS: Dict[int, tuple] = {}
#: id of a planner -> (its last_plans list, their packed payloads)
_SHIPPED: Dict[int, tuple] = {}


def say_once(kind: str, message: str) -> None:
    if kind not in _SAID:
        _SAID.add(kind)
        LOG.warning("routepack (slime actor): %s [logged once]", message)


def layout(args: Any) -> Dict[str, Optional[int]]:
    """``{"slots_per_rank": int or None (default ceil(E / ep)), "replica_slots": int}`` from
    ``args.routepack_slots_per_rank`` / ``args.routepack_replica_slots``."""
    spr = getattr(args, LAYOUT_ARGS["slots_per_rank"], None)
    rs = getattr(args, LAYOUT_ARGS["replica_slots"], None)
    return {
        "slots_per_rank": None if spr is None else positive_int(spr, f"args.{LAYOUT_ARGS['slots_per_rank']}"),
        "replica_slots": positive_int(rs or 0, f"args.{LAYOUT_ARGS['replica_slots']}", minimum=0),
    }


def _size(args: Any, name: str) -> int:
    return int(getattr(args, name, None) or 1)


def limits(args: Any) -> Optional[str]:
    """Why slime's actor cannot carry out expert placement with these arguments (None: it can),
    naming the option. Read alike on the driver (`routepack.integrations.slime.planner_from_args`)
    and in the actor (`layer_spec`), so both decide alike."""
    if not getattr(args, "num_experts", None):
        return "--num-experts is not set: the model has no MoE layer"
    spec = getattr(args, "spec", None)
    names = [spec] if isinstance(spec, str) else list(spec or [])
    if not any("routepack" in str(n) for n in names) and not getattr(args, "routepack_plan_spec", False):
        return (
            f"--spec is {spec!r}, not 'routepack.integrations.slime layer_spec': the actor's MoE layers are "
            "Megatron's (to keep a model-plugin spec, pass --spec routepack.integrations.slime layer_spec and name "
            f"yours in the --custom-config-path YAML: {SPEC_ARG}: <module> <function>)"
        )
    for name, flag, why in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size", "the MoE layers' EP groups must be DP blocks"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", "the stock-layout view covers one stage"),
        ("virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage", "one chunk per rank"),
        ("context_parallel_size", "--context-parallel-size", "routepack's MoE layer refuses context parallelism"),
        ("expert_tensor_parallel_size", "--expert-tensor-parallel-size", "routepack's MoE layer refuses it"),
    ):
        if _size(args, name) > 1:
            return f"{flag}={getattr(args, name)} ({why})"
    freq = getattr(args, "moe_layer_freq", 1)
    if freq not in (1, None) and not (isinstance(freq, (list, tuple)) and all(int(f) == 1 for f in freq)):
        return "--moe-layer-freq: dense layers among the MoE ones (slime's routes cover every layer; plans cover MoE)"
    for name, flag, why in (
        ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction layers' MoE are not mapped"),
        ("use_critic", "--use-critic", "the critic trains these microbatches without routing replay"),
        (
            "moe_grouped_gemm",
            "--moe-grouped-gemm",
            "routepack's logical checkpoints (slime's Megatron --load/--save) support SequentialMLP experts only",
        ),
        ("overlap_param_gather", "--overlap-param-gather", "migration would move parameters not yet gathered"),
    ):
        if getattr(args, name, None):
            return f"{flag} ({why})"
    dispatcher = getattr(args, "moe_token_dispatcher_type", None) or "alltoall"
    if dispatcher not in ("alltoall", "allgather"):
        return f"--moe-token-dispatcher-type={dispatcher} (routepack's MoE layer runs alltoall or allgather)"
    return None


def actor_topology(args: Any) -> Any:
    """The plans' `routepack.Topology` as an actor sees it: Megatron's DP and EP sizes,
    ``args.num_gpus_per_node`` (slime's, default 8) and the layout (`layout`)."""
    from megatron.core import parallel_state as mpu  # type: ignore[import-untyped]

    from routepack.model import Topology

    ep = mpu.get_expert_model_parallel_world_size()
    lay = layout(args)
    experts = positive_int(args.num_experts, "args.num_experts")
    return Topology(
        dp=mpu.get_data_parallel_world_size(),
        ep=ep,
        gpus_per_node=int(getattr(args, "num_gpus_per_node", 8) or 8),
        slots_per_rank=lay["slots_per_rank"] or -(-experts // ep),
        replica_slots=int(lay["replica_slots"] or 0),
    )


def plan_spec(args: Any, spec: Any) -> Any:
    """``spec`` (a Megatron layer or block spec) with its MoE layers routepack's, laid out by
    `actor_topology`; ``spec`` itself where `limits` blocks placement (said once)."""
    why = limits(args)
    if why is not None:
        say_once("schedule_only", f"slime's actor runs routepack's schedule only: {why}")
        return spec
    from routepack.integrations.megatron.layer import plan_layer_spec

    topo = actor_topology(args)
    return plan_layer_spec(spec, topo, topo.replica_slots)


def their_spec(args: Any) -> Any:
    """The user's own spec function named by ``args.routepack_spec`` (what the run passed as
    ``--spec``: ``"slime_plugins.models.qwen3_next get_qwen3_next_spec"`` or a two-item list),
    imported as slime imports ``--spec`` (Megatron's ``import_module``); None where unset."""
    named = getattr(args, SPEC_ARG, None)
    if not named:
        return None
    parts = named.split() if isinstance(named, str) else list(named)
    if len(parts) != 2:
        raise RoutepackError(f"args.{SPEC_ARG}: expected 'module function' (slime's --spec), got {named!r}")
    from megatron.core.transformer.spec_utils import import_module  # type: ignore[import-untyped]

    return import_module(tuple(parts))


def _is_provider(result: Any) -> bool:
    """slime's own test for a ``--spec`` function that returned a model provider."""
    import inspect

    if not callable(result) or isinstance(result, type):
        return False
    try:
        return "pre_process" in inspect.signature(result).parameters
    except (TypeError, ValueError):
        return False


def layer_spec(args: Any, config: Any, vp_stage: Optional[int] = None) -> Any:
    """For slime's ``--spec routepack.integrations.slime layer_spec``: the user's model-plugin
    spec (``args.routepack_spec``, called as slime calls a ``--spec`` function:
    ``spec(args, config, vp_stage)``), or else the spec slime's model provider builds without
    ``--spec`` (``get_gpt_decoder_block_spec`` for an MoE model, with Transformer Engine where
    ``--transformer-impl transformer_engine``); either through `plan_spec`."""
    from megatron.core.models.gpt import gpt_layer_specs as specs  # type: ignore[import-untyped]

    theirs = their_spec(args)
    if theirs is not None:
        built = theirs(args, config, vp_stage) if callable(theirs) else theirs
        if _is_provider(built):  # a model provider of its own (slime delegates model building to it)
            raise RoutepackError(
                f"args.{SPEC_ARG}: {getattr(args, SPEC_ARG)!r} returns a model provider, not a layer spec: "
                "routepack cannot put its MoE layers into a model it does not build from a spec"
            )
        return plan_spec(args, built)

    use_te = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    if getattr(args, "num_experts", None):
        kwargs: Dict[str, Any] = {"use_transformer_engine": use_te}
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return plan_spec(args, specs.get_gpt_decoder_block_spec(config, **kwargs))
    build = specs.get_gpt_layer_with_transformer_engine_spec if use_te else specs.get_gpt_layer_local_spec
    return build(
        num_experts=None,
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        moe_use_legacy_grouped_gemm=getattr(args, "moe_use_legacy_grouped_gemm", False),
    )


# ----------------------------------------------------------------------- the driver's side
def step_plans(planner: Any) -> Optional[List[Dict[str, Any]]]:
    """The plans of the rollout `plan_dp_schedule` planned last (one per training step), each
    with its window and topology as bytes (`pack_plan`), for ``rollout_data[PLANS_KEY]``; None
    when that rollout fell back to slime's own schedule (``planner.fell_back``): the actor's
    `begin_step` then runs the placement in force."""
    from routepack.integrations.megatron.handoff import pack_plan
    from routepack.integrations.shared.arrays import num_ranks

    if getattr(planner, "fell_back", None):
        return None
    plans, windows = planner.last_plans, planner.last_windows
    if len(plans) != len(windows) or not plans:
        raise RoutepackError("planner: no plans of a rollout to ship (call plan_dp_schedule with this planner first)")
    cached = _SHIPPED.get(id(planner))
    if cached is not None and cached[0] is plans:  # one packing for every DP rank's dict
        return cached[1]
    out = [
        pack_plan(p, w, planner.topology(num_ranks(p, f"planner.last_plans[{s}]")))
        for s, (p, w) in enumerate(zip(plans, windows))
    ]
    _SHIPPED[id(planner)] = (plans, out)
    return out


# ----------------------------------------------------------------------- the actor's side
def handoff(model: Any) -> Any:
    """The `Handoff` of slime's model (a list of DDP chunks), made at the first call; None for
    a model without routepack's MoE layers."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    hit = _HANDOFFS.get(id(chunks[0]))
    if hit is not None and hit[0] is chunks[0]:
        return hit[1]
    from routepack.integrations.megatron.handoff import Handoff
    from routepack.integrations.megatron.layer import PlanMoELayer

    layers = [m for c in chunks for m in c.modules() if isinstance(m, PlanMoELayer)]
    out = Handoff(chunks, layers[0].topo, "slime's Megatron actor") if layers else None
    _HANDOFFS[id(chunks[0])] = (chunks[0], out)
    return out


def _moves(plan: Any) -> bool:
    from routepack.plan import Placement

    p = plan.placement
    static = Placement.static(p.num_layers, p.num_experts, _topology_of(p))
    return bool(plan.migration.size or plan.replicas.size) or not np.array_equal(p.phy2log, static.phy2log)


def _topology_of(placement: Any) -> Any:
    from routepack.model import Topology

    return Topology(
        dp=placement.num_ranks, ep=placement.num_ranks, gpus_per_node=1, slots_per_rank=placement.slots_per_rank
    )


def begin_step(model: Any, optimizer: Any, data_iterator: Any, step_id: int, forward_step: Any) -> Any:
    """In slime's ``train_one_step``, before ``forward_backward_func``: the step's plan (from
    ``data_iterator[0].rollout_data[PLANS_KEY][step_id]``) begins on the model (migration with
    ``optimizer``'s state; collective over the EP group); returns ``forward_step`` with the
    plan's microbatches made current one by one, to pass as ``forward_step_func``.

    A model without routepack's MoE layers gets ``forward_step`` back (refused when the plan
    moves or copies experts: the model was built without ``--spec``); a step without shipped
    plans runs with the placement in force (said once)."""
    h = handoff(model)
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    rollout = getattr(iterators[0], "rollout_data", None) if iterators else None
    payloads = rollout.get(PLANS_KEY) if isinstance(rollout, dict) else None
    where = f"rollout_data[{PLANS_KEY!r}][{step_id}]"
    if payloads is not None and not 0 <= step_id < len(payloads):
        raise RoutepackError(f"{where}: the rollout ships {len(payloads)} step plans")
    if h is None:
        if payloads is not None:
            from routepack.integrations.megatron.handoff import unpack_plan

            if _moves(unpack_plan(payloads[step_id], where)[0]):
                raise RoutepackError(
                    f"{where}: the plan moves or copies experts, but the model has no routepack MoE layer (build it "
                    "with --spec routepack.integrations.slime layer_spec, or plan without placement)"
                )
        return forward_step
    if payloads is None:
        say_once(
            "no_plans",
            f"a training step found no {PLANS_KEY!r} in rollout_data (add rs.step_plans to _split_train_data_by_dp): "
            "it runs with the placement in force, unplanned",
        )
        h.unplanned()
        return forward_step
    from routepack.integrations.megatron.handoff import unpack_plan

    plan, window, topo = unpack_plan(payloads[step_id], where)
    h.check_topology(topo, where)
    assert isinstance(rollout, dict)  # payloads came from it
    _check_share(rollout, iterators[0], step_id, plan, where)
    h.begin(plan, window, optimizer, list(range(plan.num_micro)))
    return h.step_function(forward_step)


def _check_share(rollout: Dict[str, Any], iterator: Any, step_id: int, plan: Any, where: str) -> None:
    """This DP rank's microbatches of the step are the plan's cells, and the iterator is at the
    step's first one."""
    from megatron.core import parallel_state as mpu  # type: ignore[import-untyped]

    counts = list(rollout.get("num_microbatches") or [])
    if step_id >= len(counts) or int(counts[step_id]) != plan.num_micro:
        raise RoutepackError(
            f"{where}: the plan has {plan.num_micro} microbatches a rank, rollout_data['num_microbatches'] says "
            f"{counts[step_id] if step_id < len(counts) else 'nothing'} for step {step_id}"
        )
    start = sum(int(c) for c in counts[:step_id])
    offset = getattr(iterator, "offset", start)
    if offset != start:
        raise RoutepackError(f"{where}: the data iterator is at microbatch {offset}, step {step_id} starts at {start}")
    rank = mpu.get_data_parallel_rank()
    mbs = rollout["micro_batch_indices"][start : start + plan.num_micro]
    want = [len(plan.cell_samples(rank, m)) for m in range(plan.num_micro)]
    if [len(mb) for mb in mbs] != want:
        raise RoutepackError(
            f"{where}: DP rank {rank}'s microbatches hold {[len(mb) for mb in mbs]} samples, the plan's cells {want} "
            "(the schedule must be plan_dp_schedule's)"
        )


def finish_step(model: Any) -> None:
    """In slime's ``train_one_step``, before ``optimizer.step()``: the step's end
    (`Handoff.before_optimizer_step`); nothing for a model without routepack's MoE layers."""
    h = handoff(model)
    if h is not None:
        h.before_optimizer_step()


def stock_layout(model: Any) -> Any:
    """In slime's ``named_params_and_buffers``: ``model`` in Megatron's stock expert layout
    (`routepack.integrations.megatron.stock.stock_view`; ``model`` itself without routepack's
    MoE layers). Reading and writing through it is collective over the EP group."""
    from routepack.integrations.megatron.stock import stock_view

    return stock_view(model)


__all__ = [
    "LAYOUT_ARGS",
    "PLANS_KEY",
    "SPEC_ARG",
    "actor_topology",
    "begin_step",
    "finish_step",
    "handoff",
    "layer_spec",
    "layout",
    "limits",
    "plan_spec",
    "stock_layout",
    "step_plans",
    "their_spec",
]
