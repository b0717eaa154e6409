"""What a trainer's backend can carry out of a plan, and one trainer step planned with it:
shared by the verl and slime adapters.

A plan has three parts: the schedule (which DP rank and microbatch runs each sample), the
expert placement (which rank holds each expert's weights) and intra-batch replicas. A
backend without expert parallelism (FSDP, which shards parameters, not experts) can run the
schedule only; a Megatron backend with expert parallelism can move experts and copy them
only where routepack's Megatron execution is installed, which says so in
``routepack.integrations.megatron.EXECUTES`` (a set holding ``"placement"`` and/or
``"replicas"``; absent: neither). `backend_policy` picks the policy a backend can run
(``policy="auto"``) or refuses one it cannot; `TrainerPlanner` plans each step with it and
reports which parts will run (``plan.report["trainer"]["runs"]``); `step_metrics` turns a
step's plans into the figures a trainer's logger takes.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from routepack._checks import instance_of, positive_int
from routepack.errors import RoutepackError
from routepack.integrations.shared.equal_counts import plan_equal_counts
from routepack.integrations.shared.layout import align_steps, clamp_oversize, fixed_size_layout
from routepack.model import CostModel, Topology
from routepack.plan import Placement, Plan
from routepack.policies import PRESETS, resolve
from routepack.simulate import simulate
from routepack.stages.policy import Policy
from routepack.window import Window

#: The backends an adapter plans for: ``fsdp`` (FSDP / FSDP2: parameters sharded, every rank
#: computes every expert it routes to) and ``megatron`` (Megatron-Core with expert parallelism).
BACKENDS = ("fsdp", "megatron")


@dataclass(frozen=True)
class BackendRuns:
    """Which parts of a plan ``backend`` carries out (the schedule always), and why not the rest."""

    backend: str
    placement: bool
    replicas: bool
    why: str

    def as_dict(self) -> Dict[str, Any]:
        return {"schedule": True, "placement": self.placement, "replicas": self.replicas, "why": self.why}


def megatron_executes() -> frozenset:
    """What routepack's Megatron execution carries out on a trainer's workers beyond the
    schedule: ``routepack.integrations.megatron.EXECUTES`` (``"placement"``: moving experts
    between EP ranks with their weights and optimizer state; ``"replicas"``: intra-batch
    copies), empty where it is not declared. The execution itself being importable is not
    enough: the plan must also be handed to it on the workers, which is what the declaration
    says."""
    module = importlib.import_module("routepack.integrations.megatron")
    return frozenset(getattr(module, "EXECUTES", ()))


def backend_runs(backend: Any, blocked: Optional[Mapping[str, str]] = None) -> BackendRuns:
    """`BackendRuns` of ``backend`` (one of `BACKENDS`). ``blocked``: parts (``"placement"``,
    ``"replicas"``) the adapter's hand-off to the backend cannot carry out in this trainer's
    configuration, each with the reason (naming the option); ``"placement"`` blocks replicas too."""
    if backend not in BACKENDS:
        raise RoutepackError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "fsdp":
        return BackendRuns("fsdp", False, False, "FSDP shards parameters, not experts: no expert to move or copy")
    done = megatron_executes()
    blocked = dict(blocked or {})
    if "placement" in blocked:
        blocked.setdefault("replicas", blocked["placement"])
    why = {
        p: f"routepack.integrations.megatron does not carry out {p} (its EXECUTES)"
        for p in ("placement", "replicas")
        if p not in done
    }
    for part, reason in blocked.items():
        if part not in ("placement", "replicas"):
            raise RoutepackError(f"blocked: expected 'placement' or 'replicas', got {part!r}")
        why.setdefault(part, reason)
    runs = {p: p not in why for p in ("placement", "replicas")}
    text = "; ".join(dict.fromkeys(why.values())) or "routepack.integrations.megatron carries out every part"
    return BackendRuns("megatron", runs["placement"], runs["replicas"], text)


def backend_policy(
    backend: Any, policy: Any = "auto", blocked: Optional[Mapping[str, str]] = None
) -> Tuple[str, Policy, BackendRuns]:
    """(name, `Policy`, `BackendRuns`): ``policy="auto"`` is the richest preset ``backend``
    runs (``routepack`` with placement and replicas, ``routepack_no_replication`` with
    placement alone, else ``routepack_packing``: the schedule on the static placement); any
    other preset or `Policy` is refused, naming ``policy`` and ``backend``, when it plans a
    part the backend cannot run. ``blocked``: as `backend_runs`."""
    runs = backend_runs(backend, blocked)
    if isinstance(policy, str) and policy == "auto":
        name = (
            "routepack"
            if runs.placement and runs.replicas
            else "routepack_no_replication"
            if runs.placement
            else "routepack_packing"
        )
        return name, PRESETS[name], runs
    name, pol = resolve(policy)
    if pol.placement != "static" and not runs.placement:
        raise RoutepackError(
            f"policy: {name!r} plans expert placement ({pol.placement!r}), which backend={backend!r} cannot carry out "
            f"({runs.why}); use policy='auto' or a policy with placement 'static'"
        )
    if pol.replication != "none" and not runs.replicas:
        raise RoutepackError(
            f"policy: {name!r} plans intra-batch replicas ({pol.replication!r}), which backend={backend!r} cannot carry "
            f"out ({runs.why}); use policy='auto' or a policy with replication 'none'"
        )
    return name, pol, runs


def window_from_loads(seq_lens: Any, previous: Window) -> Window:
    """A `Window` for samples whose routes are not known yet (verl's R2 mode, where the
    trainer records them in a later pass): each sample's ``n·k`` routed tokens of a layer
    shared among the experts in proportion to ``previous``'s loads of that layer (largest
    remainders, so they add up to ``n·k`` and none exceeds ``n``). ``previous`` needs
    ``top_k``; a layer with no load spreads evenly."""
    instance_of(previous, Window, "previous")
    if previous.top_k is None:
        raise RoutepackError("previous: the window's top_k is unknown; build it from routing replay")
    lens = np.asarray(seq_lens, dtype=np.int64)
    k = previous.top_k
    load = previous.layer_expert_load()
    total = load.sum(axis=1, keepdims=True)
    share = np.where(total > 0, load / np.where(total > 0, total, 1), 1.0 / previous.num_experts)
    exact = (lens * k)[:, None, None] * share[None]
    counts = np.floor(exact).astype(np.int64)
    left = (lens * k)[:, None] - counts.sum(axis=2)
    order = np.argsort(np.argsort(-(exact - counts), axis=2, kind="stable"), axis=2, kind="stable")
    counts += order < left[:, :, None]
    return Window(lens, np.minimum(counts, lens[:, None, None]), top_k=k)


class TrainerPlanner:
    """Plans a trainer's steps with the policy its backend runs (`backend_policy`).

    Args:
        cost:           the `CostModel` (one ``a_quad`` per MoE layer), or the path of one
                        saved as JSON (`CostModel.load`, what ``routepack calibrate`` writes).
        backend:        one of `BACKENDS`.
        num_experts:    E; default ``cost.num_experts`` (one of them is needed).
        ep:             expert-parallel ranks (1 for FSDP without EP).
        gpus_per_node:  GPUs per node (default 8).
        slots_per_rank: expert slots per EP rank; default ``ceil(E / ep)``. Where the backend
                        cannot move experts it must be ``E / ep`` (the static layout).
        replica_slots:  replica buffers per EP rank and layer (`Topology.replica_slots`; default
                        the topology's): the model's, where it holds them (Megatron).
        blocked:        parts the adapter's hand-off cannot carry out here (`backend_runs`).
        policy:         ``"auto"`` (default), a preset name or a `Policy`.
        seed, anneal_moves, time_budget_s, options: as `routepack.plan_window`.

    The placement in force and the previous step's window are kept between steps (migration
    is planned from the one, ``loads="previous"`` policies read the other).
    """

    def __init__(
        self,
        cost: Any,
        backend: str,
        *,
        num_experts: Optional[int] = None,
        ep: int = 1,
        gpus_per_node: int = 8,
        slots_per_rank: Optional[int] = None,
        replica_slots: Optional[int] = None,
        blocked: Optional[Mapping[str, str]] = None,
        policy: Any = "auto",
        seed: int = 0,
        anneal_moves: Optional[int] = None,
        time_budget_s: Optional[float] = None,
        **options: Any,
    ) -> None:
        if isinstance(cost, (str, os.PathLike)):
            cost = CostModel.load(os.fspath(cost))
        self.cost = instance_of(cost, CostModel, "cost")
        self.policy_name, self.policy, self.runs = backend_policy(backend, policy, blocked)
        self.replica_slots = replica_slots
        if num_experts is None:
            num_experts = cost.num_experts
        if num_experts is None:
            raise RoutepackError("num_experts: the cost model does not say how many experts; pass num_experts=")
        self.num_experts = positive_int(num_experts, "num_experts")
        self.ep = positive_int(ep, "ep")
        self.gpus_per_node = positive_int(gpus_per_node, "gpus_per_node")
        even = -(-self.num_experts // self.ep)
        self.slots_per_rank = even if slots_per_rank is None else positive_int(slots_per_rank, "slots_per_rank")
        if not self.runs.placement and (self.num_experts % self.ep or self.slots_per_rank != even):
            raise RoutepackError(
                f"slots_per_rank: backend={backend!r} keeps the static layout of E/ep experts per rank "
                f"(num_experts={self.num_experts}, ep={self.ep}), so slots_per_rank must be {even} and E a multiple "
                f"of ep; got slots_per_rank={self.slots_per_rank}"
            )
        self.seed, self.anneal_moves, self.time_budget_s, self.options = seed, anneal_moves, time_budget_s, options
        self.placement: Optional[Placement] = None
        self.last_window: Optional[Window] = None
        self.last_plans: List[Plan] = []  # what an adapter planned last (slime: one per training step)
        self.last_windows: List[Window] = []  # the windows of ``last_plans`` (slime ships them with the plans)
        #: why the last rollout fell back to the trainer's own schedule (slime), or None when it was planned
        self.fell_back: Optional[str] = None

    def topology(self, dp: int) -> Topology:
        """The `Topology` of ``dp`` DP ranks."""
        extra: Dict[str, Any] = {} if self.replica_slots is None else {"replica_slots": self.replica_slots}
        return Topology(
            dp=positive_int(dp, "dp"),
            ep=self.ep,
            gpus_per_node=self.gpus_per_node,
            slots_per_rank=self.slots_per_rank,
            **extra,
        )

    def plan(
        self,
        window: Window,
        dp: int,
        token_cap: int,
        *,
        equal_counts: bool = False,
        multiple: int = 1,
        multiple_option: str = "microbatch_group_size_per_vp_stage",
        oversize_alone: bool = False,
        micro_batch_size: Optional[int] = None,
    ) -> Plan:
        """One step's plan, validated and priced on ``window``.

        ``equal_counts``: as many samples on every DP rank (verl's equal chunks; the plan is also
        made with verl's Karmarkar–Karp packing and the faster of the two, as predicted, kept:
        ``report["trainer"]["kk_step_time"]``, ``["kept"] = "kk"``); ``multiple``:
        microbatches per rank a multiple of it (VPP; ``multiple_option`` names the setting in
        errors); ``oversize_alone``: a sample over ``token_cap`` runs alone in a microbatch (slime),
        see `clamp_oversize`; ``micro_batch_size``: the trainer's static batch mode, at most
        that many samples per microbatch, no token cap (`fixed_size_layout`). The report gains
        ``trainer``: backend, the parts that run, the policy, wall seconds, per-layer imbalance.
        """
        start = time.perf_counter()
        instance_of(window, Window, "window")
        topo = self.topology(dp)
        token_cap = positive_int(token_cap, "token_cap")
        kwargs = dict(seed=self.seed, anneal_moves=self.anneal_moves, time_budget_s=self.time_budget_s, **self.options)
        if self.runs.placement:  # the first plan moves experts from the model's static layout
            previous = self.placement
            if previous is None or previous.num_layers != window.num_layers:
                previous = Placement.static(window.num_layers, self.num_experts, topo)
            kwargs["previous"] = previous
        if self.policy.loads == "previous":
            kwargs["previous_window"] = self.last_window if self.last_window is not None else window
        extra: Dict[str, Any] = {}
        if micro_batch_size is not None:
            plan, token_cap = self._static_plan(window, topo, micro_batch_size, multiple, kwargs)
            extra["static_batch"] = {"micro_batch_size": micro_batch_size}
        else:
            planned, over = clamp_oversize(window, token_cap) if oversize_alone else (window, np.zeros(0, np.int64))
            if equal_counts:
                plan = plan_equal_counts(planned, topo, self.cost, token_cap, self.policy, **kwargs)
                if self.policy.packing != "kk":  # never slower than verl's own balancing, as predicted
                    kk = Policy(self.policy.placement, "kk", self.policy.replication, loads=self.policy.loads)
                    other = plan_equal_counts(planned, topo, self.cost, token_cap, kk, **kwargs)
                    extra["kk_step_time"] = other.report["predicted"]["step_time"]
                    if extra["kk_step_time"] < plan.report["predicted"]["step_time"]:
                        plan, extra["kept"] = other, "kk"
            else:
                from routepack.planner import plan_window

                plan = plan_window(planned, topo, self.cost, token_cap=token_cap, policy=self.policy, **kwargs)
            plan = align_steps(plan, planned, topo, token_cap, multiple, multiple_option, None, not equal_counts)
            if over.size:
                _check_alone(plan, window, topo, token_cap, over)
                extra["oversize"] = {
                    "samples": over.tolist(),
                    "token_cap": token_cap,
                    "bound_cap": int(window.seq_lens.max()),
                }
        plan.validate(window, topo, max(token_cap, int(window.seq_lens.max())))
        sim = simulate(plan, window, topo, self.cost, token_cap)
        plan.report["predicted"] = sim.summary()
        plan.report["trainer"] = {
            "backend": self.runs.backend,
            "runs": self.runs.as_dict(),
            "policy": self.policy_name,
            "dp": dp,
            "token_cap": token_cap,
            "max_vio": (sim.imbalance - 1.0).max(axis=(0, 1)).tolist(),
            "rank_time_vio": float(sim.group_times.max() / sim.group_times.mean() - 1.0)
            if sim.group_times.mean() > 0
            else 0.0,
            **extra,
            "seconds": time.perf_counter() - start,
        }
        self.placement, self.last_window = plan.placement, window
        return plan

    def _static_plan(self, window: Window, topo: Topology, mbs: int, multiple: int, kwargs: dict) -> Tuple[Plan, int]:
        """Static batch mode: the placement the policy plans (the static one where the backend
        cannot move experts), no replicas, `fixed_size_layout`'s microbatches; the cap is the
        fullest microbatch's tokens (there is no token cap in this mode)."""
        mbs = positive_int(mbs, "micro_batch_size")
        rank, micro, steps = fixed_size_layout(window, topo.dp, mbs, multiple, self.cost)
        cells = np.zeros((topo.dp, steps), dtype=np.int64)
        np.add.at(cells, (rank, micro), window.seq_lens)
        cap = int(cells.max())
        if self.runs.placement and self.policy.placement != "static":
            from routepack.planner import plan_window

            pol = Policy(self.policy.placement, "kk", "none", loads=self.policy.loads)
            placement = plan_window(
                window, topo, self.cost, token_cap=int(window.seq_lens.max()), policy=pol, **kwargs
            ).placement
        else:
            placement = Placement.static(window.num_layers, window.num_experts, topo)
        plan = Plan(placement, rank, micro, steps, policy=self.policy_name, report={"token_cap": cap})
        return plan.validate(window, topo, cap), cap


def _check_alone(plan: Plan, window: Window, topo: Topology, token_cap: int, over: np.ndarray) -> None:
    """Checks that ``plan`` (made on `clamp_oversize`'s window) runs each over-cap sample of
    the real ``window`` alone and keeps every other microbatch within ``token_cap``: what a
    cut sample filling its cell guarantees, checked all the same."""
    cell = plan.sample_rank.astype(np.int64) * plan.num_micro + plan.sample_micro
    size = np.bincount(cell, minlength=topo.dp * plan.num_micro)
    tokens = np.bincount(cell, weights=window.seq_lens, minlength=topo.dp * plan.num_micro)
    shared = np.setdiff1d(np.arange(len(size)), cell[over])
    if (size[cell[over]] != 1).any() or (tokens[shared] > token_cap).any():
        raise RoutepackError("plan: an over-cap sample shares its microbatch, or a microbatch exceeds token_cap")


def step_metrics(plans: List[Plan], repeats: int = 1, prefix: str = "routepack") -> Dict[str, float]:
    """A trainer step's figures from its plans (one per mini-batch; each run ``repeats``
    times, PPO's epochs): ``{prefix}/step_time_s`` (predicted, Σ over plans × repeats),
    ``/lower_bound_s``, ``/fraction_of_bound``, ``/max_vio/layer_{l}``, ``/max_vio/max``,
    ``/max_vio/avg`` (per MoE layer, the worst microbatch's max over EP ranks / mean over EP
    ranks of routed tokens, minus 1: verl's ``max_vio`` form, 0 when balanced),
    ``/rank_time_vio`` (slowest EP group's predicted time / mean − 1), ``/experts_migrated``,
    ``/replicas``, ``/microbatches`` (per DP rank, all plans), ``/plans``; wall time is
    the caller's to name (`plan_seconds`)."""
    trainers = [p.report["trainer"] for p in plans]
    step = sum(p.report["predicted"]["step_time"] for p in plans) * repeats
    bound = sum(p.report["predicted"]["lower_bound_time"] for p in plans) * repeats
    vio = np.max(np.array([t["max_vio"] for t in trainers]), axis=0)
    out = {
        f"{prefix}/step_time_s": step,
        f"{prefix}/lower_bound_s": bound,
        f"{prefix}/fraction_of_bound": bound / step if step > 0 else 1.0,
        **{f"{prefix}/max_vio/layer_{i}": float(v) for i, v in enumerate(vio)},
        f"{prefix}/max_vio/max": float(vio.max()),
        f"{prefix}/max_vio/avg": float(vio.mean()),
        f"{prefix}/rank_time_vio": max(t["rank_time_vio"] for t in trainers),
        f"{prefix}/experts_migrated": float(sum(len(p.migration) for p in plans)),
        f"{prefix}/replicas": float(sum(len(p.replicas) for p in plans)),
        f"{prefix}/microbatches": float(sum(p.num_micro for p in plans)),
        f"{prefix}/plans": float(len(plans)),
    }
    return out


def plan_seconds(plans: List[Plan]) -> float:
    """Wall seconds the plans took (their ``report["trainer"]["seconds"]``)."""
    return float(sum(p.report["trainer"]["seconds"] for p in plans))


__all__ = [
    "BACKENDS",
    "BackendRuns",
    "TrainerPlanner",
    "backend_policy",
    "backend_runs",
    "megatron_executes",
    "plan_seconds",
    "step_metrics",
    "window_from_loads",
]
