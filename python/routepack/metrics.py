"""Metrics of a plan for the trainer's own logger (verl's ``Tracking``, slime's wandb call,
Megatron's tensorboard or wandb writer): what the plan promised, what it balanced, what it moved.

`plan_metrics` computes them from the plan and its window (numpy and the core, no torch); the
runners add the step they timed (`routepack.torch.step_metrics`: ``runner.metrics()``) and
`log_metrics` hands the dict to a logger. Every name, its unit and meaning: `METRICS` (also
docs/metrics.md).

Imbalance of a layer: in each exchange (EP group, microbatch, layer) the tokens its busiest EP
rank computes over the mean of its ranks (1 is perfectly balanced), averaged over the
window's exchanges of the layer; "before" under Megatron's static placement with the plan's own
layout and no replicas (what the step would run without routepack's placement and copies),
"after" under the plan. Percentiles across the MoE layers, as Megatron-LM issue 2398 asks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np

from routepack import _core
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.plan import Placement, Plan
from routepack.window import Window

#: every metric name, with its meaning; ``*`` marks the ones a runner adds (it timed the step)
#: and ``?`` the ones present only when the plan records them (`plan_window`'s plans do)
METRICS: Dict[str, str] = {
    "moe/max_vio/max": "routing: max over layers of max_e (share_e * E - 1), verl's vio",
    "moe/max_vio/avg": "routing: mean over layers of max_e (share_e * E - 1)",
    "moe/min_vio/max": "routing: max over layers of min_e (share_e * E - 1)",
    "moe/min_vio/avg": "routing: mean over layers of min_e (share_e * E - 1)",
    "moe/avg_vio/max": "routing: max over layers of mean_e abs(share_e * E - 1)",
    "moe/avg_vio/avg": "routing: mean over layers of mean_e abs(share_e * E - 1)",
    "routepack/predicted_step_s": "the cost model's step time of the plan (seconds, slowest EP group)",
    "routepack/imbalance_before/mean": "per-layer rank imbalance under the static placement: mean over layers",
    "routepack/imbalance_before/p50": "... its median over layers",
    "routepack/imbalance_before/p90": "... its 90th percentile over layers",
    "routepack/imbalance_before/max": "... its max over layers",
    "routepack/imbalance_after/mean": "per-layer rank imbalance under the plan: mean over layers",
    "routepack/imbalance_after/p50": "... its median over layers",
    "routepack/imbalance_after/p90": "... its 90th percentile over layers",
    "routepack/imbalance_after/max": "... its max over layers",
    "routepack/experts_moved": "migration rows of the plan (experts moved between ranks this window)",
    "routepack/migration_bytes": "bytes this rank sent migrating experts (runner), else rows x expert_state_bytes",
    "routepack/replicas": "intra-batch replica rows of the plan (copies of hot experts per microbatch)",
    "routepack/cross_node_bytes": "predicted all-to-all bytes between nodes over the window",
    "routepack/plan_s?": "planner wall time (seconds)",
    "routepack/measured_step_s*": "the step the runner timed: first start_micro to finish_step (seconds)",
    "routepack/measured_over_predicted*": "measured_step_s / predicted_step_s",
}

#: the names a logger receives, without the marks of `METRICS`
NAMES = tuple(k.rstrip("*?") for k in METRICS)

_PERCENTILES = (("mean", None), ("p50", 50.0), ("p90", 90.0), ("max", 100.0))


def vio_metrics(window: Window) -> Dict[str, float]:
    """verl's MoE balance metrics (``verl/trainer/ppo/metric_utils.py``) of the window's routing:
    per layer the experts' load shares ``share [E]``, ``vio = share * E - 1``, then the max, min
    and mean |.| of vio over experts, each as its max and mean over layers."""
    load = np.asarray(window.counts, dtype=np.float64).sum(axis=0)  # [L, E]
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1.0)
    dev = share * load.shape[1] - 1.0
    per = {"max_vio": dev.max(axis=1), "min_vio": dev.min(axis=1), "avg_vio": np.abs(dev).mean(axis=1)}
    out = {}
    for name, v in per.items():
        out[f"moe/{name}/max"] = float(v.max())
        out[f"moe/{name}/avg"] = float(v.mean())
    return out


def layer_imbalance(plan: Plan, window: Window, topo: Any) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``([L], [L])``: each MoE layer's rank imbalance before and after the plan (the
    module docs), from the tokens each EP rank receives (``_core.rank_tokens``, ``[G, M, L, ep]``)."""

    def per_layer(p: Plan) -> np.ndarray:
        tok = _core.rank_tokens(p, window.seq_lens, window.counts, topo).astype(np.float64)
        mean = tok.mean(axis=3)
        ratio = np.where(mean > 0, tok.max(axis=3) / np.where(mean > 0, mean, 1.0), 1.0)  # [G, M, L]
        return np.asarray(ratio.mean(axis=(0, 1)))

    static = Placement.static(window.num_layers, window.num_experts, topo)
    before = Plan(static, plan.sample_rank, plan.sample_micro, plan.num_micro, policy="static")
    return per_layer(before), per_layer(plan)


def plan_metrics(
    plan: Plan, window: Window, topo: Any, cost: Any = None, migration_bytes: Optional[float] = None
) -> Dict[str, float]:
    """The plan's metrics (`METRICS`, without the runner's ``*``): the predicted step time from
    ``plan.report["predicted"]`` (`plan_window`'s), else `simulate` under ``cost`` (a plan
    without a prediction needs one); ``migration_bytes`` what the runner sent, else the rows
    times ``cost.expert_state_bytes``."""
    if not isinstance(plan, Plan):
        raise RoutepackTypeError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
    if not isinstance(window, Window):
        raise RoutepackTypeError(f"window: expected routepack.Window, got {type(window).__name__}")
    predicted = plan.report.get("predicted") or {}
    if "step_time" not in predicted:
        if cost is None:
            raise RoutepackError("cost: the plan records no predicted step time (not from plan_window); pass cost=")
        from routepack.simulate import simulate

        predicted = simulate(plan, window, topo, cost).summary()
    out = vio_metrics(window)
    out["routepack/predicted_step_s"] = float(predicted["step_time"])
    before, after = layer_imbalance(plan, window, topo)
    for name, values in (("before", before), ("after", after)):
        for key, q in _PERCENTILES:
            v = values.mean() if q is None else np.percentile(values, q)
            out[f"routepack/imbalance_{name}/{key}"] = float(v)
    moved = int(plan.migration.size)
    out["routepack/experts_moved"] = float(moved)
    if migration_bytes is None:
        migration_bytes = moved * float(cost.expert_state_bytes) if cost is not None else math.nan
    out["routepack/migration_bytes"] = float(migration_bytes)
    out["routepack/replicas"] = float(plan.replicas.size)
    out["routepack/cross_node_bytes"] = float(predicted.get("cross_node_bytes", math.nan))
    seconds = (plan.report.get("stage_seconds") or {}).get("total")
    if seconds is not None:
        out["routepack/plan_s"] = float(seconds)
    return out


def log_metrics(logger: Any, metrics: Mapping[str, float], step: int) -> None:
    """Hands ``metrics`` to the trainer's logger at ``step``: a Megatron writer (tensorboard
    ``SummaryWriter``: ``add_scalar(name, value, step)`` each), verl's ``Tracking`` or a wandb
    run (``log(data, step=step)``), or a callable (slime's ``log(metrics, step)`` style)."""
    if hasattr(logger, "add_scalar"):
        for name, value in metrics.items():
            logger.add_scalar(name, value, step)
    elif hasattr(logger, "log") and callable(logger.log):
        logger.log(dict(metrics), step=step)
    elif callable(logger):
        fn: Callable[..., Any] = logger
        fn(dict(metrics), step)
    else:
        raise RoutepackTypeError(
            f"logger: expected a writer with add_scalar, a logger with log(data, step=) or a callable, "
            f"got {type(logger).__name__}"
        )
