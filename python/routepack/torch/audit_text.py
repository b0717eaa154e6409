"""What the execution audit reports (`routepack.torch.audit`): its error, the per-step record
it keeps for metrics, the row of ints each rank contributes to the step's exchange, and the
message every rank builds from all the rows alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from routepack.errors import RoutepackError

#: `PlanRunner(audit=...)`: count and compare every step and raise on any difference (the
#: default); log route differences and raise on the rest; count and exchange nothing
MODES = ("raise", "warn", "off")

#: where a rank found its step open when starting something new (`StepAudit.skipped`), by code
#: (0: it did not: it is in ``finish_step``), and how the message puts it
SKIP_POINTS = ("finish_step", "start_micro", "forward", "optimizer.step", "begin_window")
_SKIP_TEXT = (
    "finish_step",
    "start_micro of its next step",
    "a forward of its next step",
    "optimizer.step",
    "begin_window",
)

#: one rank's verdict in the step's exchange, int64 each:
#: who (its DP rank, pipeline stage, slots a layer), its step number and plan digest, whether
#: it only warns on route differences, where it found its step left open (`SKIP_POINTS`, 0:
#: not); the planned cells whose backward never ran (how many, the first one's micro, MoE layer
#: and forwards); the forwards whose tokens per unit differ from the plan (how many, the first
#: one's micro, layer, unit (-1: the unit count differs, -2: counted on the device, the cell's
#: total then), tokens computed and planned); the cells fed ids other than the replay (how
#: many, the first one's micro and layer); the forwards of a cell after its backward while
#: the step's other cells had none (how many, the first one's micro and layer)
ROW = (
    "dp_rank",
    "stage",
    "slots",
    "step",
    "digest",
    "warn",
    "skipped",
    "missing",
    "missing_m",
    "missing_l",
    "missing_f",
    "route",
    "route_m",
    "route_l",
    "route_u",
    "route_got",
    "route_want",
    "ids",
    "ids_m",
    "ids_l",
    "rerun",
    "rerun_m",
    "rerun_l",
)

#: ranks a cause names before "and N more"
_NAMED = 4


class AuditError(RoutepackError):
    """A step did not run the plan (`routepack.torch.audit`): raised on every rank of the
    runner's groups alike, naming the cause and the ranks. The step's gradients are not what
    the plan computes and nothing was summed across EP groups: do not step the optimizer.
    The runner's step is closed (the next step starts afresh)."""


@dataclass(frozen=True)
class AuditReport:
    """One step as the audit saw it on this rank (`PlanRunner.last_audit`).

    * ``step``: the runner's step number (0 first, counted over windows); ``digest``: the
      plan's `digest_int`; ``layers``: the plan's MoE layer of each layer position.
    * ``tokens`` int64 ``[M, L, U]``: tokens each compute unit of this rank computed in
      (micro, layer), summed over the step's forwards (units: the rank's ``slots_per_rank``
      slots, then its replica copies of the cell in plan table order, zero-padded to U).
    * ``planned`` int64 ``[M, L, U]``: the plan's tokens per unit for one forward.
    * ``forwards`` / ``backwards`` int64 ``[M, L]``: forwards and backwards of each cell.
    * ``verdict``: ``"ok"``, or the message raised (or, under ``audit="warn"``, logged).
    """

    step: int
    digest: int
    layers: List[int]
    tokens: np.ndarray
    planned: np.ndarray
    forwards: np.ndarray
    backwards: np.ndarray
    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def measured_per_forward(self) -> np.ndarray:
        """float64 ``[M, L, U]``: tokens per unit in one forward (``tokens / forwards``; 0
        where a cell never ran), to set beside ``planned``."""
        f = self.forwards[:, :, None].astype(np.float64)
        return np.divide(self.tokens, f, out=np.zeros(self.tokens.shape), where=f > 0)


def verdict(table: np.ndarray, where: str, never_ran: str) -> Tuple[str, bool]:
    """The message every rank raises for the step's exchange (``table`` int64 ``[ranks,
    len(ROW)]``, every rank's row), "" when every row is clean, and whether it only warns (route
    differences alone, with ``audit="warn"`` on every rank). One clause per cause, naming up to
    4 ranks each with what it saw, then what to check."""
    rows = sorted((dict(zip(ROW, (int(v) for v in r))) for r in table), key=lambda r: (r["stage"], r["dp_rank"]))
    staged = len({r["stage"] for r in rows}) > 1

    def who(r: Dict[str, int]) -> str:
        return f"DP rank {r['dp_rank']}" + (f" of pipeline stage {r['stage']}" if staged else "")

    order: List[str] = []
    skipped = [r for r in rows if r["skipped"]]
    if skipped and len(skipped) == len(rows):
        order.append(
            f"every rank left step {skipped[0]['step']} part-way and reached "
            f"{_points(skipped)} without finish_step: call finish_step after each step's backward, "
            "or runner.discard_step() to abandon a step part-way"
        )
    elif skipped:
        order.append(
            "step numbers differ: "
            + _list(
                skipped,
                lambda r: (
                    f"{who(r)} skipped finish_step of step {r['step']} (it reached {_SKIP_TEXT[r['skipped']]} "
                    "without it)"
                ),
            )
        )
    steps = _by(rows, "step", who)
    if len(steps) > 1:
        order.append("step numbers differ: " + "; ".join(f"step {s} on {', '.join(w)}" for s, w in steps.items()))
    digests = _by(rows, "digest", who)
    if len(digests) > 1:
        order.append(
            "the ranks run different plans: "
            + "; ".join(f"digest {d:016x} on {', '.join(w)}" for d, w in digests.items())
        )
    micro = []
    missing, rerun = [r for r in rows if r["missing"]], [r for r in rows if r["rerun"]]
    if missing:
        micro.append(
            "a planned microbatch never ran: "
            + _list(
                missing,
                lambda r: (
                    f"microbatch {r['missing_m']} on {who(r)} (MoE layer {r['missing_l']}: {r['missing_f']} "
                    f"forward(s), no backward; {r['missing']} planned cell(s) without a backward)"
                ),
            )
        )
    if rerun:
        micro.append(
            "a microbatch ran again after its backward, before the step's others: "
            + _list(
                rerun,
                lambda r: (
                    f"microbatch {r['rerun_m']} on {who(r)} (MoE layer {r['rerun_l']}: {r['rerun']} forward(s) "
                    "after their cell's backward)"
                ),
            )
        )
    if micro:
        order.append("; ".join(micro) + f": {never_ran}")
    structural = bool(order)
    routes = []
    ids, route = [r for r in rows if r["ids"]], [r for r in rows if r["route"]]
    if ids:
        routes.append(
            _list(
                ids,
                lambda r: (
                    f"{who(r)} fed MoE layer {r['ids_l']} top-k ids other than the replayed microbatch "
                    f"{r['ids_m']} ({r['ids']} cell(s))"
                ),
            )
        )
    if route:
        routes.append(_list(route, lambda r: _route_text(r, who(r))))
    if routes:
        order.append(
            "routes differ from the plan's: "
            + "; ".join(routes)
            + ": is router replay on (the model routing with the rollout's recorded ids)?"
        )
    if not order:
        return "", False
    warn_only = not structural and all(r["warn"] for r in rows)
    tail = (
        " (audit='warn': logged, the step goes on)"
        if warn_only
        else "; nothing was summed across EP groups: do not step the optimizer (zero the gradients; "
        "the runner's step is closed)"
    )
    return f"{where}: " + "; ".join(order) + tail, warn_only


def _route_text(r: Dict[str, int], who: str) -> str:
    m, l, u = r["route_m"], r["route_l"], r["route_u"]
    if u == -1:
        what = f"computed {r['route_got']} unit(s) where the plan has {r['route_want']}"
    elif u == -2:
        what = f"computed other tokens per expert than the plan's {r['route_want']} tokens"
    else:
        unit = f"slot {u}" if u < r["slots"] else f"replica copy {u - r['slots']}"
        what = f"computed {r['route_got']} tokens in its {unit} where the plan routes {r['route_want']}"
    return f"{who}'s MoE layer {l} {what} in microbatch {m} ({r['route']} forward(s) off the plan)"


def _list(rows: Sequence[Dict[str, int]], text: Callable[[Dict[str, int]], str]) -> str:
    """``text`` of the first ranks, then how many more."""
    out = [text(r) for r in rows[:_NAMED]]
    if len(rows) > _NAMED:
        out.append(f"and {len(rows) - _NAMED} more rank(s)")
    return ", ".join(out)


def _by(rows: Sequence[Dict[str, int]], key: str, who: Callable[[Dict[str, int]], str]) -> Dict[int, List[str]]:
    out: Dict[int, List[str]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(who(r))
    return {k: v[:_NAMED] + ([f"{len(v) - _NAMED} more"] if len(v) > _NAMED else []) for k, v in out.items()}


def _points(rows: Sequence[Dict[str, int]]) -> str:
    return " / ".join(sorted({_SKIP_TEXT[r["skipped"]] for r in rows}))
