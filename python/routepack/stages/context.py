"""`PlanContext`: everything a stage function may read, the stage signatures' types, and the
one check of what a stage function is handed (`stage_context`, `check_placement_fits`,
`check_fills_cells`), which `plan_window` and every stage function called directly share.

A context is checked once: `PlanContext.check` remembers what it found valid (the fields'
objects and values), so a stage handed a checked, unchanged context (every stage of one
`plan_window` call) does not check it again; a context built or changed by a caller is checked
in full by the first stage it reaches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

import numpy as np

from routepack._checks import finite_float, instance_of, positive_int, token_cap
from routepack.errors import InfeasibleError, RoutepackError, RoutepackTypeError
from routepack.model import CostModel, Topology
from routepack.oversize import oversize_mode, refusal
from routepack.plan import Placement
from routepack.simulate import lower_bound_micro
from routepack.stages.policy import Policy
from routepack.window import Window

#: `plan_window`'s defaults, defined here once: every entry point that plans a window
#: (`PlanContext`, `routepack.plan_window`, `routepack.torch.plan_window_distributed`,
#: `routepack.compare.compare`, ...) names these rather than writing the numbers again.
#: The stage options' defaults are the Rust core's (`routepack.stages.options.DEFAULTS`).
DEFAULT_TOKEN_CAP = 65536
DEFAULT_POLICY = "routepack"
DEFAULT_SEED = 0

#: Packing returns (sample_rank [S], sample_micro [S], num_micro, report dict).
PackingResult = Tuple[np.ndarray, np.ndarray, int, Dict[str, Any]]


@dataclass
class PlanContext:
    """Everything a stage may read. A stage's own options arrive as its typed options
    dataclass (the stage function's second argument); ``options`` holds every option
    ``plan_window`` was given, under its current (stage-prefixed) name.

    Its fields are plain attributes a caller may set; `check` (which every built-in stage
    function runs first, through `stage_context`, unless the context is `checked` and
    unchanged since) checks and normalises them all, naming the field: ``token_cap``,
    ``seed``, ``anneal_moves`` and ``time_budget_s`` as `plan_window` takes them (a budget here
    may be 0: a stage's share of a spent budget)."""

    window: Any
    topo: Any
    cost: Any
    token_cap: int
    previous: Any = None
    previous_window: Any = None
    seed: int = DEFAULT_SEED
    anneal_moves: Optional[int] = None
    time_budget_s: Optional[float] = None
    options: Dict[str, Any] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)
    #: What stages report about their decisions, by stage name (lands in plan.report).
    reports: Dict[str, Any] = field(default_factory=dict)
    #: Samples over the cap: "refuse" (None), "alone", "split" (`routepack.oversize`).
    oversize: Optional[str] = None
    #: What `check` found valid (`_state`), and what `check_fills_cells` found fillable: None
    #: until then. Not fields a caller sets.
    _checked: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)
    _fillable: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def _state(self) -> tuple:
        """What `check` checks, as it stands: the objects (compared by identity; held, so no
        other object takes their ids) and the values (by type and value). ``time_budget_s`` is
        left out: a planner sets each stage's share on a checked context (`stage_context`
        checks it alone)."""
        objects = (self.window, self.topo, self.cost, self.previous, self.previous_window, self.options)
        values = (self.token_cap, self.seed, self.anneal_moves, self.oversize, self.policy, self.reports)
        return objects, tuple((type(v), id(v) if isinstance(v, dict) else v) for v in values)

    def _unchanged(self, seen: Optional[tuple]) -> bool:
        """Whether `_state` is what ``seen`` recorded."""
        if seen is None:
            return False
        objects, values = self._state()
        return all(a is b for a, b in zip(objects, seen[0])) and values == seen[1]

    @property
    def checked(self) -> bool:
        """Whether `check` passed on these fields as they are now (then no stage checks them
        again)."""
        return self._unchanged(self._checked)

    def derived(self, **changes: Any) -> "PlanContext":
        """A copy with ``changes`` (e.g. ``window=`` the pieces of a split plan), trusted as
        checked: for a planner handing a stage what it built from this checked context."""
        out = replace(self, **changes)
        out._checked = out._state() if self.checked else None
        out._fillable = out._checked if self._unchanged(self._fillable) else None
        return out

    def choose(self, options: Mapping[str, Any], policy: Policy) -> "PlanContext":
        """Sets ``options`` (canonical: `routepack.stages.registry.canonical_options`) and the
        resolved ``policy`` on this context, which stays checked if it was (what `check` asks of
        them, a mapping and a `Policy`, is checked here). Returns self."""
        was = self.checked
        if not isinstance(options, Mapping):
            raise RoutepackTypeError(f"ctx.options: expected a dict of options, got {type(options).__name__}")
        self.options, self.policy = dict(options), instance_of(policy, Policy, "ctx.policy")
        if was:
            self._checked = self._state()
        return self

    def check(self) -> "PlanContext":
        """Checks every field (types, ranges, and that the cost model, ``previous`` and
        ``previous_window`` fit the window and topology), normalising the numbers to Python
        ints and floats; raises `RoutepackError` / `RoutepackTypeError` naming the field.
        Returns self, remembered as checked (`checked`)."""
        window = instance_of(self.window, Window, "window")._check_fields("window")
        topo = instance_of(self.topo, Topology, "topo")
        cost = instance_of(self.cost, CostModel, "cost")
        self.token_cap = token_cap(self.token_cap)
        self.seed = positive_int(self.seed, "seed", minimum=0, maximum=2**64 - 1)
        if self.anneal_moves is not None:
            self.anneal_moves = positive_int(self.anneal_moves, "anneal_moves", minimum=0)
        if self.time_budget_s is not None:
            self.time_budget_s = finite_float(self.time_budget_s, "time_budget_s")
        self.oversize = oversize_mode(self.oversize)
        topo.check_experts(window.num_experts)
        cost.check_window_shape(window.num_layers, window.num_experts)
        prev_window = self.previous_window
        if prev_window is not None:
            instance_of(prev_window, Window, "previous_window")._check_fields("previous_window")
            if prev_window.num_layers != window.num_layers or prev_window.num_experts != window.num_experts:
                raise RoutepackError(
                    f"previous_window: has L={prev_window.num_layers}, E={prev_window.num_experts}; "
                    f"the window has L={window.num_layers}, E={window.num_experts}"
                )
        if self.previous is not None:
            check_placement_fits(self.previous, "previous", window, topo)
        if not isinstance(self.options, Mapping):
            raise RoutepackTypeError(f"ctx.options: expected a dict of options, got {type(self.options).__name__}")
        instance_of(self.policy, Policy, "ctx.policy")
        if not isinstance(self.reports, dict):
            raise RoutepackTypeError(f"ctx.reports: expected a dict, got {type(self.reports).__name__}")
        self._checked = self._state()
        return self

    def placement_loads(self) -> np.ndarray:
        """float64 ``[L, E]`` loads the placement stage balances."""
        if self.policy.loads == "previous":
            if self.previous_window is None:
                raise RoutepackError(
                    "previous_window: this policy plans placement from the previous window's loads; pass previous_window="
                )
            return self.previous_window.layer_expert_load()
        return self.window.layer_expert_load()

    def loads_name(self) -> str:
        """What `placement_loads` are the loads of, in the caller's words (for its errors)."""
        which = "previous_window" if self.policy.loads == "previous" else "window"
        return f"{which}.expert_tokens (its loads)"

    def demand_window(self) -> Any:
        """The window whose samples gave `placement_loads` (None when it is missing)."""
        return self.previous_window if self.policy.loads == "previous" else self.window


def stage_context(ctx: Any, options: Any, options_class: type) -> PlanContext:
    """What a stage function runs first: ``ctx`` a checked `PlanContext` (`PlanContext.check`,
    run here unless ``ctx`` is checked and unchanged, when only its ``time_budget_s`` is) and
    ``options`` an instance of the stage's own options dataclass, else an error naming ``ctx``
    / the field, or ``options``. Returns the context."""
    instance_of(ctx, PlanContext, "ctx")
    if not isinstance(options, options_class):
        raise RoutepackTypeError(
            f"options: expected routepack.stages.{options_class.__name__}, got {type(options).__name__} {options!r:.80}"
        )
    if not ctx.checked:
        return ctx.check()
    if ctx.time_budget_s is not None:
        ctx.time_budget_s = finite_float(ctx.time_budget_s, "time_budget_s")
    return ctx


def check_placement_fits(placement: Any, name: str, window: Any, topo: Any) -> Placement:
    """``placement`` as a `Placement` for the window's layers and experts on ``topo``'s slots,
    else an error naming ``name``."""
    instance_of(placement, Placement, name)._check_fields(name)
    if (
        placement.num_layers != window.num_layers
        or placement.num_experts != window.num_experts
        or placement.num_slots != topo.num_slots
        or placement.slots_per_rank != topo.slots_per_rank
    ):
        raise RoutepackError(
            f"{name}: {placement!r} does not fit the window (L={window.num_layers}, "
            f"E={window.num_experts}) and topology {topo}"
        )
    return placement


def check_fills_cells(ctx: PlanContext) -> None:
    """Raises `InfeasibleError` when no plan can exist for the window, ``topo.dp`` and
    ``token_cap``, naming them: a sample longer than the cap (the first such), or too few
    samples, since every cell (DP rank, microbatch) runs at least one sample and the cap needs
    at least `lower_bound_micro` microbatches on each of the ``topo.dp`` ranks. ``ctx`` is a
    checked context; once it passed here, unchanged, it is not looked at again."""
    if ctx._unchanged(ctx._fillable):
        return
    _check_fills_cells(ctx)
    ctx._fillable = ctx._state()


def _check_fills_cells(ctx: PlanContext) -> None:
    """`check_fills_cells`'s checks."""
    w, dp, cap = ctx.window, ctx.topo.dp, ctx.token_cap
    mode = oversize_mode(ctx.oversize)
    if int(w.seq_lens.max()) > cap and mode == "refuse":
        # the first cause of all: no row can hold this sample (the packings' own wording)
        s = int(np.flatnonzero(w.seq_lens > cap)[0])
        raise InfeasibleError(refusal(s, int(w.seq_lens[s]), cap))
    cells = w.num_samples
    if mode == "split":
        cells += _check_split(w.seq_lens, cap, ctx.topo.cp)
    # a sample over the cap fills a row of its own ("alone"), or cp rows ("split")
    micro = lower_bound_micro(
        _clamped(w, cap, ctx.topo.cp if mode == "split" else 1) if mode != "refuse" else w, ctx.topo, cap
    )
    if cells < micro * dp:
        need = (
            f"the {micro} microbatches token_cap = {ctx.token_cap} needs for its {w.total_tokens} tokens"
            if micro > 1
            else "one microbatch"
        )
        raise InfeasibleError(
            f"window: its {w.num_samples} samples cannot fill {need} on each of topo.dp = {dp} DP ranks "
            f"({micro * dp} cells, each running at least one sample)"
        )


class _Tokens:
    """What `lower_bound_micro` reads of a window: its tokens."""

    def __init__(self, total_tokens: int) -> None:
        self.total_tokens = total_tokens


def _clamped(window: Window, token_cap: int, rows: int = 1) -> _Tokens:
    """The window's tokens with every sample over the cap counted as ``rows`` full rows."""
    lens = window.seq_lens
    return _Tokens(int(np.where(lens > token_cap, rows * token_cap, lens).sum()))


def _check_split(seq_lens: np.ndarray, token_cap: int, cp: int) -> int:
    """Checks that every sample over the cap can be split over a CP group of ``cp`` ranks
    (`routepack.oversize`), naming ``topo.cp`` or the first sample that cannot; returns the
    cells beyond one a sample the splits fill."""
    if cp < 2:
        raise RoutepackError(
            f'topo.cp: oversize="split" splits a sample over a context-parallel group: needs cp >= 2, got {cp}'
        )
    over = np.flatnonzero(seq_lens > token_cap)
    for s in over[(seq_lens[over] > cp * token_cap) | (seq_lens[over] < cp)][:1]:
        n = int(seq_lens[s])
        why = (
            f"more than topo.cp x token_cap = {cp} x {token_cap}: no context-parallel group holds it; raise the cap or topo.cp"
            if n > cp * token_cap
            else f"fewer than topo.cp = {cp}: a split gives each rank of its group at least one"
        )
        raise InfeasibleError(f"sample {int(s)} has {n} tokens, {why}")
    return len(over) * (cp - 1)


__all__ = ["PackingResult", "PlanContext", "check_fills_cells", "check_placement_fits", "stage_context"]
