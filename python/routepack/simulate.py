"""`simulate`: docs/design.md's cost model, evaluated in Rust, for any plan on any window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from routepack import _core
from routepack._checks import WINDOW_WORDS, boolean, callers_words, instance_of, positive_int
from routepack._checks import token_cap as check_token_cap
from routepack.errors import RoutepackError
from routepack.model import CostModel, Topology
from routepack.plan import Plan
from routepack.window import Window


@dataclass(frozen=True)
class SimResult:
    """What a plan costs on a window.

    * ``step_time``: seconds; max over EP groups of Σ_micro Σ_layer T_l, plus exposed migration,
      plus ``redundant_grads``. Under a pipeline (``topo.pp`` > 1) the slowest group's 1F1B
      schedule instead (docs/design.md, "Pipeline parallelism"), migration and the gradient sum
      per stage (the slowest stage's).
    * ``pipeline_bubble``: seconds of that group's pipeline time in which its busiest stage
      waits (warm-up, cool-down, sends between stages); 0 without a pipeline. The parts are then
      the busiest stage's, and parts + ``pipeline_bubble`` − ``hidden`` = ``step_time``.
    * ``ideal_time``: the *balanced* reference: every max replaced by the mean, uniform
      all-to-all (docs/design.md's ``ideal``). Not a bound: a plan that keeps tokens inside
      their node can beat it.
    * ``lower_bound_time``: a true lower bound: no valid plan for the window, topology, cost
      model and token cap (any placement, packing, layout, replicas) has a smaller
      ``step_time`` (docs/design.md, "Lower bound"). ``fraction_of_bound`` is
      ``lower_bound_time / step_time``, in [0, 1].
    * ``throughput`` / ``ideal_throughput``: Σ n_s over the times.

    A step can take 0 s: a `CostModel` must price some work (it refuses one whose every
    coefficient is 0), but a window can hold none of the work it prices (say ``a_lin = 0``,
    ``a_quad`` all 0 and no routed tokens). Then ``step_time`` is 0.0, ``throughput`` is
    ``inf`` (tokens in no time: every plan is as fast as can be), and ``fraction_of_bound``
    and ``fraction_of_balanced`` are 1.0; the same holds for ``ideal_time`` and
    ``ideal_throughput`` on their own. ``fraction_of_bound`` is 0.0 only when the bound is 0
    but the plan is not (a cost model that prices migration alone, and a plan that moves
    experts where keeping them would cost nothing).
    * ``redundant_grads``: seconds of summing, once per step, the fp32 gradients of every
      expert the placement holds in more than one slot of a layer over the EP group (a ring
      all-reduce of ``cost.expert_grad_bytes`` each; what `routepack.torch` does in the last
      microbatch's backward); 0 without redundant copies.
    * ``attention``, ``expert``, ``all_to_all``, ``replication``, ``migration``,
      ``redundant_grads``: the parts of ``step_time`` on the slowest group; ``hidden``: the seconds of that all-to-all hidden
      behind compute (0 unless ``cost.overlap`` is ``"dispatch_combine"``). The parts minus
      ``hidden`` add up to ``step_time``.
    * ``group_times``: float64 ``[G]``.
    * ``imbalance``: float64 ``[G, M, L]``: max over EP ranks / mean over EP ranks of expert
      tokens per (group, micro, layer); ``mean_imbalance`` its average.
    * ``intra_node_bytes`` / ``cross_node_bytes``: the routed-token bytes the all-to-all moves
      between EP ranks of the same node / of different nodes, over the whole window (every EP
      group, microbatch and MoE layer), counted as the cost model counts them: a token computed on a
      rank other than the one holding its sample moves ``cost.token_bytes`` in dispatch and
      again in combine, in the forward and in the backward pass (4 × its dispatch bytes); a
      token computed on its own rank moves nothing. Replica weights, gradients and migration
      are not counted. ``cross_node_bytes`` is 0 when an EP group fits in one node.
    * ``cross_node_bytes_per_token``: ``cross_node_bytes`` / Σ n_s (the window's tokens).
    """

    step_time: float
    ideal_time: float
    lower_bound_time: float
    throughput: float
    ideal_throughput: float
    attention: float
    expert: float
    all_to_all: float
    replication: float
    migration: float
    critical_group: int
    group_times: np.ndarray = field(repr=False)
    imbalance: np.ndarray = field(repr=False)
    mean_imbalance: float = 0.0
    hidden: float = 0.0
    intra_node_bytes: float = 0.0
    cross_node_bytes: float = 0.0
    cross_node_bytes_per_token: float = 0.0
    redundant_grads: float = 0.0
    pipeline_bubble: float = 0.0

    @property
    def fraction_of_balanced(self) -> float:
        """``ideal_time / step_time``: how close the plan is to the balanced reference (every
        max replaced by the mean, uniform traffic). A reference, not a bound: a plan that keeps
        tokens inside their node can exceed 1. 1.0 for a step of 0 s."""
        return self.ideal_time / self.step_time if self.step_time > 0 else 1.0

    @property
    def fraction_of_ideal(self) -> float:
        """The old name of `fraction_of_balanced` (kept for callers)."""
        return self.fraction_of_balanced

    @property
    def fraction_of_bound(self) -> float:
        """``lower_bound_time / step_time`` in [0, 1]: 1 means no valid plan could be faster
        (1.0 for a step of 0 s). Not clamped: the core's bound is a bound as computed (it
        subtracts a relative margin that covers rounding), so a ratio above 1 would be a fault
        and shows."""
        return self.lower_bound_time / self.step_time if self.step_time > 0 else 1.0

    def breakdown(self) -> Dict[str, float]:
        return {
            "attention": self.attention,
            "expert": self.expert,
            "all_to_all": self.all_to_all,
            "replication": self.replication,
            "migration": self.migration,
            "redundant_grads": self.redundant_grads,
        }

    def summary(self) -> Dict[str, Any]:
        """Scalars only (what plan reports and JSON hold)."""
        out = {
            k: getattr(self, k)
            for k in (
                "step_time",
                "ideal_time",
                "lower_bound_time",
                "throughput",
                "ideal_throughput",
                "attention",
                "expert",
                "all_to_all",
                "replication",
                "migration",
                "critical_group",
                "mean_imbalance",
                "intra_node_bytes",
                "cross_node_bytes",
                "cross_node_bytes_per_token",
                "hidden",
                "redundant_grads",
                "pipeline_bubble",
            )
        }
        out["fraction_of_ideal"] = self.fraction_of_ideal
        out["fraction_of_balanced"] = self.fraction_of_balanced
        out["fraction_of_bound"] = self.fraction_of_bound
        return out


def lower_bound_micro(window: Any, topo: Any, token_cap: int) -> int:
    """ceil(ceil(Σ n_s / cap) / dp), raised to a pipeline's microbatch rule (at least
    ``topo.min_micro``, a multiple of ``topo.micro_multiple``): the fewest microbatches per DP
    rank any plan can use. The core's rule (``MicroRule::fewest``, `_core.lower_bound_micro`);
    ``window`` needs only ``total_tokens``, ``topo`` only ``dp``, ``pp`` and ``vpp``."""
    return int(
        _core.lower_bound_micro(
            int(window.total_tokens),
            int(token_cap),
            int(topo.dp),
            int(getattr(topo, "pp", 1)),
            int(getattr(topo, "vpp", 1)),
        )
    )


def simulate(
    plan: Any,
    window: Any,
    topo: Any,
    cost: Any,
    token_cap: Optional[int] = None,
    validate: bool = False,
    oversize: Any = None,
) -> SimResult:
    """Scores `plan` on `window` under `topo` and `cost` (docs/design.md, "The cost model").

    ``token_cap`` sets the microbatch count of the balanced reference ``ideal_time`` (the
    lower bound ``ceil(ceil(Σ n / cap) / dp)``) and the cap ``lower_bound_time`` assumes; by
    default the cap recorded in ``plan.report``, else the plan's own count and no cap (the
    weakest bound). The plan is checked for well-formedness first (not against a cap: that is
    the planner's business; where one of its rows exceeds the cap, the bound is taken at that
    row's size, so it still bounds this plan). With ``validate`` (a bool) the plan is first
    checked as ``plan.validate(window, topo, token_cap)`` checks it (``token_cap`` then
    required), raising the same `InvalidPlanError`, in the same call over the window (what
    `plan_window` runs on the plan it assembles); ``oversize`` as `Plan.validate` takes it
    (None: the mode ``plan.report`` records). The plan's copies are priced as
    ``plan.replica_timing`` says they move.
    """
    from routepack.oversize import plan_mode

    instance_of(plan, Plan, "plan")
    instance_of(window, Window, "window")._check_fields("window")
    instance_of(topo, Topology, "topo")
    instance_of(cost, CostModel, "cost")
    cost.check_window_shape(window.num_layers, window.num_experts)
    plan._check_fields("plan.")  # before reading plan.report: a field set to None must be named
    validate = boolean(validate, "validate")
    if token_cap is not None:
        token_cap = check_token_cap(token_cap)
    elif validate:
        raise RoutepackError("token_cap: validate=True checks the plan against a cap; pass token_cap=")
    cap = token_cap
    if cap is None and plan.report.get("token_cap") is not None:
        # the cap plan_window recorded (a report is a plain dict: an edited one is checked)
        cap = positive_int(plan.report["token_cap"], "plan.report['token_cap']")
    return score(
        plan, window, topo, cost, cap, plan_cap=token_cap if validate else None, oversize=plan_mode(plan, oversize)
    )


def score(
    plan: Plan,
    window: Window,
    topo: Topology,
    cost: CostModel,
    token_cap: Optional[int],
    plan_cap: Optional[int] = None,
    oversize: str = "refuse",
    step_only: bool = False,
) -> SimResult:
    """`simulate` of arguments already checked (the planner's, or `simulate`'s own): one call
    into the core's simulator (``simulate::simulate_in``). ``token_cap``: the cap the bound and
    the balanced reference assume (None: none); ``plan_cap``: validate the plan against it first
    (None: well-formedness only); ``oversize``: "refuse", "alone" or "split"; ``step_only``: the
    step time and its parts only, ``lower_bound_time`` and ``ideal_time`` NaN (a choice among
    candidates reads no more; the pass over the window skips the bound's sums)."""
    ideal_micro = lower_bound_micro(window, topo, token_cap) if token_cap and not step_only else None
    with callers_words(WINDOW_WORDS):
        out = _core.simulate(
            plan,
            window.seq_lens,
            window.counts,
            topo,
            cost,
            ideal_micro,
            token_cap,
            plan_cap,
            oversize,
            plan.replica_timing,
            step_only,
        )
    return SimResult(**out)
