"""routepack inside slime: a `Window` from slime's per-sample routing replay, and from
plans exactly the structure ``slime/utils/dp_schedule.py::build_dp_schedule`` returns, so a
slime user swaps one call.

slime's layout (THUDM/slime, 2026: ``ray/rollout.py``, ``backends/megatron_utils/
cp_utils.py``):

* per sample ``rollout_routed_experts`` int32 ``[len(tokens) - 1, L, k]``: SGLang routes
  every token but the last generated one;
* for training, ``prepare_routed_experts_for_routing_replay`` appends one row per sample
  for that last token, ``arange(L * k).reshape(1, L, k) % num_experts`` (layer l routes it
  to experts ``(l*k + j) % E``), and pads the microbatch to the TP/CP multiple the same way.

The schedule: ``build_dp_schedule(args, train_parallel_config, total_lengths, *,
global_batch_size, rollout_indices)`` returns ``(partitions, micro_batch_indices,
num_microbatches, global_batch_sizes)``: per DP rank its global sample indices, per rank its
microbatches as index lists into its partition (tiling it in order, steps one after the
other), per step the microbatches each rank runs, per step the rollouts in it. Samples are
grouped into steps of ``global_batch_size`` rollouts (first-occurrence order; all samples of
a rollout in one step; trailing rollouts that do not fill a step dropped).

`plan_dp_schedule` is the drop-in for that call in ``RolloutManager._split_train_data_by_dp``
(``slime/ray/rollout.py``): it plans each step from the rollouts' routes with a
`TrainerPlanner` (the policy the backend runs) and returns the same 4-tuple
(`build_dp_schedule` with the plans). Both of slime's batch modes: dynamic
(``use_dynamic_batch_size``: microbatches within ``max_tokens_per_gpu * cp_size``; a sample
longer than that runs alone in a microbatch of its own, as slime runs it, priced by
`routepack.simulate` and counted in the plan's certificate) and static (``micro_batch_size``
samples a microbatch). What slime's open bugs break holds by construction and is checked:
every microbatch within the cap but a lone over-cap sample (#2017: ``--balance-by-flops``
ignores it), no empty microbatch (#1838, #1860), no more microbatches than samples on a rank
(#2065), the same count on every DP rank, VPP's multiple.

On slime's Megatron backend the rest of the plan (expert placement, migration, redundant
experts, intra-batch replicas) runs in the train actor: `step_plans` ships each step's plan
with the step's data, and the actor's `layer_spec` / `begin_step` / `finish_step` /
`stock_layout` carry it out (`routepack.integrations.slime.actor`; docs/trainers.md has
the user change, `limits` what blocks it).

The driver's side needs numpy only (torch tensors are read without importing torch); the
actor's functions import torch and Megatron-Core when they run.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import logging

import numpy as np

from routepack._checks import boolean, positive_int, sequence
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.integrations.shared.arrays import as_numpy, num_ranks, plans_list, rank_cells
from routepack.integrations.slime.actor import (
    LAYOUT_ARGS,
    PLANS_KEY,
    begin_step,
    finish_step,
    layer_spec,
    layout,
    limits,
    plan_spec,
    stock_layout,
    step_plans,
)
from routepack.integrations.shared.trainer import BACKENDS, TrainerPlanner, backend_policy, plan_seconds, step_metrics
from routepack.routes.layers import MoELayers
from routepack.routes.slime import DEFAULT_LAST_TOKEN, LAST_TOKEN, slime_pad_row, slime_summary
from routepack.window import Window

LOG = logging.getLogger("routepack.integrations.slime")
#: Fallbacks to slime's own schedule in this process, by kind; each kind is logged once.
FALLBACKS: Dict[str, int] = {}


def window_from_slime(
    rollout_routed_experts: Any,
    num_experts: int,
    total_lengths: Any = None,
    last_token: str = DEFAULT_LAST_TOKEN,
    moe_layers: Any = None,
) -> Window:
    """A `Window` from slime's ``rollout_routed_experts``.

    Args:
        rollout_routed_experts: a list of per-sample ``[T_i, L, k]`` arrays (numpy, read-only
            ones too, or torch; int32 as slime keeps them, or uint8 | int16 | int64), same L,
            k and dtype.
        num_experts:   E; every counted id lies in [0, E), and ``k <= E``.
        total_lengths: optional ints ``[S]``, ``len(tokens)`` of each sample (slime's
            ``total_lengths``); each must be ``T_i + 1``, as slime asserts.
        last_token:    ``"pad"`` (default): the last token is counted with the route slime
            replays for it (`slime_pad_row`); ``"skip"``: not counted.
        moe_layers:    the rows of the layer axis that are MoE layers (a model with dense
            layers: ``routepack.routes.MoELayers.from_config(args).moe_layers(L)``); None:
            every row.

    Sample i's length (int64) is ``T_i + 1``, the tokens the trainer runs; expert demand is
    ``[S, L', E]`` (one layer per MoE layer), ``top_k`` = k. The counting is
    `routepack.routes.slime_summary`'s.
    """
    return Window.from_summary(
        slime_summary(rollout_routed_experts, num_experts, total_lengths, last_token, moe_layers)
    )


def _lengths(total_lengths: Any, n: int) -> np.ndarray:
    lens = as_numpy(total_lengths, "total_lengths")
    if lens.ndim != 1 or lens.shape[0] != n or not np.issubdtype(lens.dtype, np.integer):
        raise RoutepackError(f"total_lengths: expected {n} integers, got shape {lens.shape} / dtype {lens.dtype}")
    return lens.astype(np.int64)


def moe_layers_from_args(args: Any, num_rows: int) -> Optional[List[int]]:
    """The ``moe_layers`` of slime's routes (``num_rows`` rows on the layer axis) from slime's
    Megatron arguments (``num_layers``, ``moe_layer_freq``, ``mtp_num_layers``: `MoELayers`);
    None where args name no layer count (every row counted) or every row is an MoE layer."""
    if getattr(args, "num_layers", None) is None:
        return None
    return MoELayers.from_config(args).moe_layers(num_rows)


# ------------------------------------------------------------------ the steps
def step_samples(rollout_indices: Any, global_batch_size: int) -> List[List[int]]:
    """The samples of each training step, as ``build_dp_schedule`` groups them: rollouts in
    first-occurrence order of ``rollout_indices`` (int ``[S]``, ``samples[i].index``), steps
    of ``global_batch_size`` rollouts, a rollout's samples together in order, trailing
    rollouts that do not fill a step dropped. Plan step s's window from these samples, in
    this order."""
    global_batch_size = positive_int(global_batch_size, "global_batch_size")
    ids = sequence(rollout_indices, "rollout_indices", "rollout ids")
    groups: Dict[Any, List[int]] = {}
    for pos, rid in enumerate(ids):
        groups.setdefault(rid, []).append(pos)
    rollouts = list(groups)
    steps = len(rollouts) // global_batch_size
    if steps < 1:
        raise RoutepackError(
            f"global_batch_size: {global_batch_size} rollouts per step, but rollout_indices holds {len(rollouts)}"
        )
    return [
        [pos for rid in rollouts[s * global_batch_size : (s + 1) * global_batch_size] for pos in groups[rid]]
        for s in range(steps)
    ]


def build_dp_schedule(
    args: Any,
    train_parallel_config: Dict[str, int],
    total_lengths: Sequence[int],
    *,
    global_batch_size: int,
    rollout_indices: Sequence[Any],
    plans: Any,
) -> Tuple[List[List[int]], List[List[List[int]]], List[int], List[int]]:
    """In place of slime's ``build_dp_schedule`` (same arguments, plus ``plans``): the same
    4-tuple, decided by the plans.

    Args:
        args: slime's namespace; reads ``use_dynamic_batch_size`` and, with it,
              ``max_tokens_per_gpu``, without it ``micro_batch_size``.
        train_parallel_config: ``{"dp_size", "cp_size", "vpp_size",
              "microbatch_group_size_per_vp_stage"}``.
        total_lengths: ints ``[S]``, tokens per sample (global indices).
        global_batch_size, rollout_indices: as slime's (`step_samples`).
        plans: one `Plan` per step (or one Plan for a single step), plan s over
              ``step_samples(...)[s]`` in that order, on ``dp_size`` DP ranks.

    Returns:
        ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``:
        ``list[dp][int]`` global sample indices (per step, rank r's samples step by plan
        step, ascending inside one); ``list[dp][list[int]]`` microbatches as local indices
        into ``partitions[r]``, execution order; ``list[steps][int]`` the plan's step count
        (the same on every rank); ``list[steps][int]`` = ``global_batch_size``.

    Refused (`RoutepackError` naming the argument): a microbatch over ``max_tokens_per_gpu *
    cp_size`` that holds more than one sample (a lone sample may exceed it, as in slime), or
    over ``micro_batch_size`` samples in static mode; a plan of the wrong size or DP width;
    a step count that is not a multiple of ``microbatch_group_size_per_vp_stage`` under VPP.
    """
    dynamic = boolean(getattr(args, "use_dynamic_batch_size", False), "args.use_dynamic_batch_size")
    cfg = _parallel_config(train_parallel_config)
    if dynamic:
        cap = positive_int(getattr(args, "max_tokens_per_gpu", None), "args.max_tokens_per_gpu") * cfg["cp_size"]
    else:
        size = positive_int(getattr(args, "micro_batch_size", None), "args.micro_batch_size")
    steps = step_samples(rollout_indices, global_batch_size)
    lens = _lengths(total_lengths, len(sequence(rollout_indices, "rollout_indices", "rollout ids")))
    plans = plans_list(plans)
    if len(plans) != len(steps):
        raise RoutepackError(f"plans: {len(plans)} plans for {len(steps)} training steps")
    dp = cfg["dp_size"]
    partitions: List[List[int]] = [[] for _ in range(dp)]
    micro: List[List[List[int]]] = [[] for _ in range(dp)]
    num_microbatches: List[int] = []
    for s, (plan, samples) in enumerate(zip(plans, steps)):
        name = f"plans[{s}]"
        _check_step_plan(plan, name, samples, dp, cfg)
        for r in range(dp):
            for m, cell in enumerate(rank_cells(plan, r, name)):
                glob = [samples[int(i)] for i in cell]
                tokens = int(lens[glob].sum())
                if dynamic and tokens > cap and len(glob) > 1:
                    raise RoutepackError(
                        f"{name}: microbatch {m} of DP rank {r} holds {tokens} tokens in {len(glob)} samples, more than "
                        f"max_tokens_per_gpu * cp_size = {cap} (only a lone sample may exceed it; plan with "
                        f"token_cap <= {cap} on these lengths)"
                    )
                if not dynamic and len(glob) > size:
                    raise RoutepackError(
                        f"{name}: microbatch {m} of DP rank {r} holds {len(glob)} samples, more than micro_batch_size = "
                        f"{size} (static batch mode)"
                    )
                start = len(partitions[r])
                partitions[r].extend(glob)
                micro[r].append(list(range(start, start + len(glob))))
        num_microbatches.append(int(plan.num_micro))
    return partitions, micro, num_microbatches, [int(global_batch_size)] * len(steps)


def planner_from_args(args: Any, cost: Any, backend: Optional[str] = None, **options: Any) -> TrainerPlanner:
    """A `TrainerPlanner` for a slime run from its arguments: ``num_experts``,
    ``expert_model_parallel_size`` (ep, default 1), ``num_gpus_per_node`` (default 8) and
    ``train_backend`` (``"megatron"``, slime's default, or ``"fsdp"``; ``backend`` overrides
    it). ``cost``: a `routepack.CostModel` or the path of one saved as JSON. ``options``:
    the planner's (``policy``, ``num_experts``, ``seed``, ``anneal_moves``,
    ``time_budget_s``, stage options). What the backend carries out, and so the policy, is
    `backend_policy`'s.

    On slime's Megatron backend the actor carries the whole plan out (`routepack.integrations.slime.actor`: the
    model built with ``--spec routepack.integrations.slime layer_spec``, the plans shipped by
    `step_plans`), unless `limits` names an option that blocks placement (the schedule alone
    then). The MoE layers' layout is the actor's: ``args.routepack_slots_per_rank`` (default
    ``ceil(E / ep)``) and ``args.routepack_replica_slots`` (default 0: no replicas), which
    ``options`` may not contradict. Refused, naming the option: redundant slots or replica
    buffers with ``--overlap-grad-reduce``, or with optimizer state in checkpoints (``--save``
    without ``--no-save-optim``)."""
    if backend is None:
        backend = getattr(args, "train_backend", None) or "megatron"
        if backend not in BACKENDS:
            raise RoutepackError(f"args.train_backend: routepack plans for {BACKENDS}, got {backend!r}")
    num_experts = options.pop("num_experts", None) or getattr(args, "num_experts", None)
    blocked: Dict[str, str] = {}
    if backend == "megatron":
        why = limits(args)
        if why is not None:
            blocked["placement"] = why
        else:
            lay = layout(args)
            for key, value in lay.items():
                if options.get(key) is not None and options[key] != value:
                    raise RoutepackError(
                        f"{key}: {options[key]} given, but slime's actor builds its MoE layers with "
                        f"args.{LAYOUT_ARGS[key]} = {value}; set it there (slime's --custom-config-path YAML)"
                    )
                options[key] = value
            if not lay["replica_slots"]:
                blocked["replicas"] = (
                    f"args.{LAYOUT_ARGS['replica_slots']} is 0: the MoE layers hold no replica buffers"
                )
    planner = TrainerPlanner(
        cost,
        backend,
        num_experts=num_experts,
        blocked=blocked or None,
        ep=int(getattr(args, "expert_model_parallel_size", 1) or 1),
        gpus_per_node=int(getattr(args, "num_gpus_per_node", 8) or 8),
        **options,
    )
    extra = planner.slots_per_rank * planner.ep > planner.num_experts or bool(planner.replica_slots)
    if backend == "megatron" and planner.runs.placement and extra:
        layout_ = f"{planner.slots_per_rank} slots a rank for {planner.num_experts} experts, {planner.replica_slots} replica buffers"
        if getattr(args, "overlap_grad_reduce", False):
            raise RoutepackError(
                f"--overlap-grad-reduce: the layout ({layout_}) has redundant slots or replica buffers, whose gradients "
                "complete in the last microbatch's backward, after DDP would start reducing them; drop the flag or "
                "use slots_per_rank = E / ep and replica_slots = 0"
            )
        if getattr(args, "save", None) and not getattr(args, "no_save_optim", False):
            raise RoutepackError(
                f"--no-save-optim: optimizer state of a model with redundant slots or replica buffers ({layout_}) is not "
                "placement-independent in checkpoints yet; pass --no-save-optim or use slots_per_rank = E / ep and "
                "replica_slots = 0"
            )
    return planner


def plan_dp_schedule(
    args: Any,
    train_parallel_config: Dict[str, int],
    total_lengths: Sequence[int],
    *,
    global_batch_size: int,
    rollout_indices: Sequence[Any],
    rollout_routed_experts: Any,
    planner: TrainerPlanner,
    metrics: Optional[Dict[str, Any]] = None,
    moe_layers: Any = "args",
    fallback: Optional[Callable[..., Any]] = None,
) -> Tuple[List[List[int]], List[List[List[int]]], List[int], List[int]]:
    """In place of ``build_dp_schedule(args, train_parallel_config, total_lengths, *,
    global_batch_size, rollout_indices)`` in ``_split_train_data_by_dp``: the same 4-tuple,
    each step planned by ``planner`` from ``rollout_routed_experts`` (slime's per-sample
    ``[len(tokens) - 1, L, k]`` arrays, ``data["rollout_routed_experts"]``).

    Dynamic mode (``args.use_dynamic_batch_size``): token cap ``max_tokens_per_gpu *
    cp_size``; a longer sample runs alone (`routepack.integrations.shared.layout.clamp_oversize`;
    ``plan.report["oversize"]``). Static mode: ``args.micro_batch_size`` samples a
    microbatch, ``ceil(S / micro_batch_size)`` microbatches a step as slime makes them (a
    count that is not a multiple of ``dp_size`` times VPP's group is refused, naming
    ``micro_batch_size``, as slime refuses it). Under VPP (``vpp_size > 1``) each rank's count
    is a multiple of ``microbatch_group_size_per_vp_stage``.

    ``moe_layers``: the route rows that are MoE layers; ``"args"`` (default) reads them from
    slime's Megatron arguments (`moe_layers_from_args`: ``num_layers``, ``moe_layer_freq``,
    ``mtp_num_layers``), None counts every row, or a list of rows.

    A rollout never crashes on routes it cannot plan: where planning raises a
    `RoutepackError` (routes of another layout, an id out of range, a step no plan can
    fill), the schedule is ``fallback``'s (default: slime's own
    ``slime.utils.dp_schedule.build_dp_schedule``, same arguments), the reason is logged once
    per kind (logger ``routepack.integrations.slime``; `FALLBACKS` counts them),
    ``planner.fell_back`` holds it, and `step_plans` ships no plans (the actor runs the
    placement in force). ``planner.fell_back`` is None after a planned rollout.

    ``metrics`` (optional dict) gets the step's figures under slime's names: ``routepack/…``
    (`step_metrics`, summed over the training steps of this rollout),
    ``perf/routepack_plan_time`` (seconds) and ``routepack/planned`` (1.0, or 0.0 after a
    fallback). ``planner.last_plans`` keeps the plans.
    """
    try:
        plans, windows = _plan_steps(
            args,
            train_parallel_config,
            total_lengths,
            global_batch_size,
            rollout_indices,
            rollout_routed_experts,
            planner,
            moe_layers,
        )
    except RoutepackError as e:
        kind = type(e).__name__
        FALLBACKS[kind] = FALLBACKS.get(kind, 0) + 1
        if FALLBACKS[kind] == 1:
            LOG.warning(
                "routepack: cannot plan this rollout (%s); slime's own build_dp_schedule runs instead [logged once per kind]",
                e,
            )
        planner.last_plans, planner.last_windows, planner.fell_back = [], [], str(e)
        if metrics is not None:
            metrics["routepack/planned"] = 0.0
        own = fallback if fallback is not None else _slime_schedule()
        return own(
            args,
            train_parallel_config,
            total_lengths,
            global_batch_size=global_batch_size,
            rollout_indices=rollout_indices,
        )
    planner.last_plans, planner.last_windows, planner.fell_back = plans, windows, None
    if metrics is not None:
        metrics.update(step_metrics(plans))
        metrics["perf/routepack_plan_time"] = plan_seconds(plans)
        metrics["routepack/planned"] = 1.0
    return build_dp_schedule(
        args,
        train_parallel_config,
        total_lengths,
        global_batch_size=global_batch_size,
        rollout_indices=rollout_indices,
        plans=plans,
    )


def _slime_schedule() -> Callable[..., Any]:
    """slime's own ``build_dp_schedule`` (``slime/utils/dp_schedule.py``)."""
    try:
        from slime.utils.dp_schedule import build_dp_schedule as own  # type: ignore[import-not-found]
    except ImportError as e:
        raise RoutepackError(
            f"fallback: slime.utils.dp_schedule is not importable ({e}); pass fallback=build_dp_schedule"
        ) from None
    return own  # type: ignore[no-any-return]


def _plan_steps(
    args: Any,
    train_parallel_config: Dict[str, int],
    total_lengths: Sequence[int],
    global_batch_size: int,
    rollout_indices: Sequence[Any],
    rollout_routed_experts: Any,
    planner: TrainerPlanner,
    moe_layers: Any,
) -> Tuple[List[Any], List[Window]]:
    """Each training step's validated plan and window (`plan_dp_schedule`)."""
    cfg = _parallel_config(train_parallel_config)
    dynamic = boolean(getattr(args, "use_dynamic_batch_size", False), "args.use_dynamic_batch_size")
    group = cfg["microbatch_group_size_per_vp_stage"] if cfg["vpp_size"] > 1 else 1
    routed = sequence(rollout_routed_experts, "rollout_routed_experts", "[T_i, L, k] arrays")
    if isinstance(moe_layers, str) and moe_layers == "args":
        rows = as_numpy(routed[0], "rollout_routed_experts[0]").shape[1] if routed else 1
        moe_layers = moe_layers_from_args(args, int(rows))
    plans, windows = [], []
    for samples in step_samples(rollout_indices, global_batch_size):
        window = window_from_slime(
            [routed[i] for i in samples],
            planner.num_experts,
            total_lengths=[total_lengths[i] for i in samples],
            moe_layers=moe_layers,
        )
        if dynamic:
            cap = positive_int(getattr(args, "max_tokens_per_gpu", None), "args.max_tokens_per_gpu") * cfg["cp_size"]
            plan = planner.plan(window, cfg["dp_size"], cap, multiple=group, oversize_alone=True)
        else:
            size = positive_int(getattr(args, "micro_batch_size", None), "args.micro_batch_size")
            plan = planner.plan(window, cfg["dp_size"], 1, multiple=group, micro_batch_size=size)
        plan.validate(
            window,
            planner.topology(cfg["dp_size"]),
            max(plan.report["trainer"]["token_cap"], int(window.seq_lens.max())),
        )
        plans.append(plan)
        windows.append(window)
    return plans, windows


def _parallel_config(cfg: Any) -> Dict[str, int]:
    if not isinstance(cfg, dict):
        raise RoutepackTypeError(f"train_parallel_config: expected a dict, got {type(cfg).__name__}")
    out = {}
    for key in ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage"):
        if key not in cfg:
            raise RoutepackError(f"train_parallel_config: has no {key!r}")
        out[key] = positive_int(cfg[key], f"train_parallel_config[{key!r}]")
    return out


def _check_step_plan(plan: Any, name: str, samples: List[int], dp: int, cfg: Dict[str, int]) -> None:
    if plan.num_samples != len(samples):
        raise RoutepackError(f"{name}: plans {plan.num_samples} samples, step holds {len(samples)}")
    if num_ranks(plan, name) != dp:
        raise RoutepackError(f"{name}: runs on {num_ranks(plan, name)} DP ranks, dp_size is {dp}")
    group = cfg["microbatch_group_size_per_vp_stage"] if cfg["vpp_size"] > 1 else 1
    if plan.num_micro % group:
        raise RoutepackError(
            f"{name}: {plan.num_micro} microbatches per rank is not a multiple of "
            f"microbatch_group_size_per_vp_stage = {group} (VPP)"
        )


__all__ = [
    "BACKENDS",
    "FALLBACKS",
    "LAST_TOKEN",
    "LAYOUT_ARGS",
    "PLANS_KEY",
    "TrainerPlanner",
    "backend_policy",
    "begin_step",
    "build_dp_schedule",
    "finish_step",
    "layer_spec",
    "layout",
    "limits",
    "moe_layers_from_args",
    "plan_dp_schedule",
    "plan_spec",
    "planner_from_args",
    "slime_pad_row",
    "step_metrics",
    "step_plans",
    "step_samples",
    "stock_layout",
    "window_from_slime",
]
