"""The execution audit: every step shows that what ran is what was planned (issue 40).

A runner (`PlanRunner`; the Megatron runner builds on the same machinery) keeps one
`StepAudit`. During a step it counts, on this rank, for every (microbatch, MoE layer) cell:

* per forward, the tokens each compute unit computed (the rank's physical slots, then its
  replica buffers: `note_units`), compared at once with the plan's flow for the cell
  (`plan_units`: the cell's flow table from the window's counts and the plan's layout, the
  same function that routes). The counts are compared where they already live: host arrays
  for `EPMoE` (its kernel's group sizes come from them; no device work), device tensors for a
  layer whose dispatcher counts on the device (a compare and an add on the device, no sync);
* where the routes were precomputed from the replay, whether the ids fed equal the replayed
  ones (`note_ids`: a device flag per cell, no sync);
* the forwards and backwards of each cell (host ints).

A step opens with its first backward and closes at `finish`. A rank that starts a new step
while its last one is open (a forward of a cell whose backward already ran, ``start_micro``
of such a microbatch, ``optimizer.step`` on the layers' parameters, ``begin_window``) skipped
``finish_step``: it joins the exchange its peers make in their ``finish_step`` with that
verdict (`skipped`), so every rank raises there, before anything is summed.

`finish` packs this rank's verdict into one row of ints (`_ROW`) and all-gathers it over the
EP group, then the expert-data-parallel group (dp > ep) and the pipeline group (pp > 1), so
every rank holds every rank's row and raises the same `AuditError` naming the cause it can
tell (`routepack.torch.audit_text`): the step numbers or plans differ (a rank skipped
``finish_step``), a planned microbatch never ran (its backward never came: is the loop or the
data iterator running the plan's microbatches?), or the routes differ from the plan's (is
router replay on?). On a GPU the step costs one device-to-host copy of the cell flags and one
small all-gather per group (``3 + 17`` int64 a rank); nothing is synchronised per layer.
``audit="warn"`` logs route differences instead of raising (for a user who routes live on
purpose); the other causes always raise. ``audit="off"`` counts and exchanges nothing.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from routepack.errors import RoutepackError
from routepack.torch.audit_text import (
    MODES,
    ROW,
    SKIP_POINTS,
    AuditError,
    AuditReport,
    verdict,
)
from routepack.torch.broadcast import _no_answer, all_gather_tensors
from routepack.torch.remap import _flow_table, incoming
from routepack.torch.routes import cell_origins

log = logging.getLogger("routepack.torch.audit")

#: audits whose step is open (a backward ran since the last finish): checked before every
#: ``optimizer.step`` (a global pre-hook), so a rank that steps without ``finish_step`` joins
#: its peers' exchange before its optimizer moves anything
_OPEN: "weakref.WeakSet[StepAudit]" = weakref.WeakSet()


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for audit in list(_OPEN):
        if audit.holds(optimizer):
            audit.skipped("optimizer.step")


register_optimizer_step_pre_hook(_before_step)


def plan_units(
    plan: Any,
    window: Any,
    topo: Any,
    group_index: int,
    ep_rank: int,
    layers: Sequence[Tuple[int, np.ndarray]],
    cell_rows: Callable[[int, int], np.ndarray],
    width: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """The plan's tokens per compute unit of this rank in every cell: ``(planned, units)``.

    ``planned`` int64 ``[M, len(layers), U]``: tokens the rank's unit u computes in one
    forward of (micro, layer) (units: its ``slots_per_rank`` slots, then its replica copies
    of the cell in table order; U the most units of any cell, zero-padded); ``units`` int64
    ``[M, len(layers)]``: the cell's unit count. ``layers``: (the plan's MoE layer, its
    placement row ``[ep * slots_per_rank]``) of each of the runner's layers; ``cell_rows(m,
    l)``: the replica rows of this EP group's cell (`PlanRunner.cell_rows_of`). ``width``: the
    units a layer reports in every cell (Megatron's local experts: its slots and all its
    replica buffers, the j-th copy in buffer j), None: the cell's own count (`EPMoE`)."""
    spr = topo.slots_per_rank
    origins = cell_origins(plan, window, group_index, topo.ep)
    cells: Dict[Tuple[int, int], np.ndarray] = {}
    for m in range(plan.num_micro):
        for pos, (layer, row) in enumerate(layers):
            rows = cell_rows(m, layer)
            flows = _flow_table(np.ascontiguousarray(origins[m, :, layer]), row, topo, rows)
            inc, unit, replicas = incoming(flows, rows, ep_rank, spr)
            n = spr + int(replicas.size) if width is None else width
            cells[(m, pos)] = np.bincount(unit, weights=inc["count"], minlength=n).astype(np.int64)[:n]
    width = max((c.size for c in cells.values()), default=spr)
    planned = np.zeros((plan.num_micro, len(layers), width), dtype=np.int64)
    units = np.zeros((plan.num_micro, len(layers)), dtype=np.int64)
    for (m, pos), c in cells.items():
        planned[m, pos, : c.size] = c
        units[m, pos] = c.size
    return planned, units


class StepAudit:
    """One runner's audit (see the module docstring).

    Args:
        mode:       ``"raise"`` (default), ``"warn"`` (route differences logged, the rest
                    raised) or ``"off"`` (nothing counted or exchanged).
        layers:     the plan's MoE layer of each of the runner's layers (position = index).
        params:     the layers' parameters (an optimizer holding one of them is the layers').
        device:     where the exchange's tensors live (the layers').
        groups:     the process groups the verdicts are gathered over, in order: the EP group
                    (None: the default group), then the expert-data-parallel group where
                    dp > ep, then the pipeline group where pp > 1.
        dp_rank, stage, slots: this rank's DP rank, pipeline stage and slots a layer.
        timeout:    bound on the exchange.
        never_ran:  what a missing microbatch's message asks the user (the runner's loop).
        padded:     the layers' forwards may also compute padding tokens the plan does not
                    count (Megatron's ``[S, B]`` microbatches of a padded batch, a sequence
                    padded to the TP size): a unit computing more tokens than the plan's is
                    accepted, fewer is a route difference (padding only adds tokens, while
                    routes other than the plan's take some from a unit the plan fills).
    """

    def __init__(
        self,
        mode: str,
        layers: Sequence[int],
        params: Sequence[torch.Tensor],
        device: Any,
        groups: Sequence[Any],
        dp_rank: int,
        stage: int,
        slots: int,
        timeout: datetime.timedelta,
        never_ran: str,
        padded: bool = False,
    ) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise RoutepackError(f"audit: {mode!r} is not one of {MODES}")
        self.mode, self.layers, self.device = mode, [int(l) for l in layers], device
        self.groups, self.dp_rank, self.stage, self.timeout = list(groups), dp_rank, stage, timeout
        self.slots, self.never_ran, self.padded = slots, never_ran, bool(padded)
        #: called whenever a step closes (raised or not): the runner drops the step's state
        self.on_close: Optional[Callable[[], None]] = None
        self._pos = {l: i for i, l in enumerate(self.layers)}
        self._params = weakref.WeakSet(params)
        self._holders: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
        #: steps this rank has closed (agreed with every rank at each `finish`)
        self.step = 0
        self.digest = 0
        self.last: Optional[AuditReport] = None
        self.window(0, np.zeros((0, len(self.layers), 0), np.int64), np.zeros((0, len(self.layers)), np.int64))

    @property
    def on(self) -> bool:
        return self.mode != "off"

    # ------------------------------------------------------------ window
    def window(self, digest: int, planned: np.ndarray, units: np.ndarray) -> None:
        """Starts a window: its plan's `digest_int` and `plan_units`; no step open."""
        self.digest = int(digest)
        self.planned, self.units = planned, units
        self._planned_dev: Optional[torch.Tensor] = None
        self._reset()

    def _reset(self) -> None:
        m, l, u = self.planned.shape
        #: int64 [M, L, U]: tokens each unit computed, summed over the step's forwards (host counts)
        self.tokens = np.zeros((m, l, u), dtype=np.int64)
        self._tokens_dev: Optional[torch.Tensor] = None
        self.forwards = np.zeros((m, l), dtype=np.int64)
        self.backwards = np.zeros((m, l), dtype=np.int64)
        #: first forward whose host counts differ from the plan: (m, pos, unit, got, want); and how many did
        self._route: Optional[Tuple[int, int, int, int, int]] = None
        self._route_n = 0
        #: device bool [2, M, L]: [0] ids other than the replay, [1] device counts other than the plan's
        self._flags: Optional[torch.Tensor] = None
        #: first forward of a cell after its backward in an incomplete step: (m, pos); and how many
        self._rerun: Optional[Tuple[int, int]] = None
        self._rerun_n = 0
        self._skip = 0
        _OPEN.discard(self)

    @property
    def open(self) -> bool:
        """Whether a backward ran since the step began (the step must be closed by `finish`)."""
        return self in _OPEN

    # ------------------------------------------------------------ counting
    def note_forward(self, micro: int, layer: int) -> None:
        """A forward of (``micro``, MoE ``layer``) begins (before its collectives). Under
        autograd, a forward of a cell whose backward already ran this step starts the next
        step when every planned cell has had its backward (the last step was never finished:
        `skipped`), and otherwise runs the microbatch again (``start_micro`` not called for
        the next one): counted, and named at `finish`. (A recomputed forward, activation
        checkpointing, runs before its cell's backward.)"""
        if not self.on or self.forwards.shape[0] <= micro:
            return
        pos = self._pos[layer]
        if torch.is_grad_enabled() and self.backwards[micro, pos] and self.open:
            if self.complete:
                self.skipped("forward")
            self._rerun_n += 1
            if self._rerun is None:
                self._rerun = (micro, pos)
        self.forwards[micro, pos] += 1

    @property
    def complete(self) -> bool:
        """Whether every planned cell's backward ran this step."""
        return bool(self.backwards.size) and bool((self.backwards > 0).all())

    def note_micro(self, micro: int) -> None:
        """``start_micro(micro)``: a microbatch whose backward ran in a complete step starts
        the next one (`skipped`)."""
        if self.on and self.open and self.backwards.shape[0] > micro and self.backwards[micro].any() and self.complete:
            self.skipped("start_micro")

    def note_units(self, micro: int, layer: int, counts: Any) -> None:
        """Tokens each compute unit of this rank computed in this forward of (``micro``,
        ``layer``): int64 ``[units]`` on the host, or an integer tensor on the device (then
        compared and added there, without a sync)."""
        if not self.on or self.planned.shape[0] <= micro:
            return
        pos = self._pos[layer]
        want = self.planned[micro, pos, : self.units[micro, pos]]
        if isinstance(counts, torch.Tensor):
            self._note_device_units(micro, pos, counts)
            return
        n = min(counts.size, self.tokens.shape[2])
        self.tokens[micro, pos, :n] += counts[:n]
        off = counts.size != want.size or (
            bool((counts < want).any()) if self.padded else not np.array_equal(counts, want)
        )
        if off:
            self._route_n += 1
            if self._route is None:
                diff = [u for u in range(max(counts.size, want.size)) if _at(counts, u) != _at(want, u)]
                if self.padded and counts.size == want.size:
                    diff = [u for u in diff if _at(counts, u) < _at(want, u)]
                u = diff[0] if diff else 0
                self._route = (micro, pos, u, _at(counts, u), _at(want, u))

    def _note_device_units(self, micro: int, pos: int, counts: torch.Tensor) -> None:
        m, l, u = self.planned.shape
        if self._planned_dev is None or self._planned_dev.device != counts.device:
            # where the counts are (a dispatcher may keep them on the host): no copy per layer
            self._planned_dev = torch.from_numpy(self.planned).to(counts.device)
        if self._tokens_dev is None or self._tokens_dev.device != counts.device:
            self._tokens_dev = torch.zeros((m, l, u), dtype=torch.int64, device=counts.device)
        n = int(self.units[micro, pos])
        got = counts.reshape(-1).to(torch.int64)
        if got.numel() != n:
            self._route_n += 1
            if self._route is None:
                self._route = (micro, pos, -1, int(got.numel()), n)  # unit count itself: known on the host
            return
        self._tokens_dev[micro, pos, :n] += got
        want = self._planned_dev[micro, pos, :n]
        self._flag(1, micro, pos, ((got < want) if self.padded else (got != want)).any())

    def note_ids(self, micro: int, layer: int, differ: torch.Tensor) -> None:
        """``differ``: a device bool, whether this forward's ids differ from the replay."""
        if self.on:
            self._flag(0, micro, self._pos[layer], differ)

    def _flag(self, kind: int, micro: int, pos: int, value: torch.Tensor) -> None:
        if self._flags is None:
            m, l, _ = self.planned.shape
            self._flags = torch.zeros((2, m, l), dtype=torch.bool, device=value.device)
        self._flags[kind, micro, pos] |= value

    def note_backward(self, micro: Optional[int], layer: int) -> None:
        """A backward of (``micro``, ``layer``) ran (it opens the step). ``micro`` None: a
        backward outside planned microbatches (a Megatron forward whose data iterator was not
        wrapped): it opens the step too, whose planned cells then never ran."""
        if not self.on:
            return
        if micro is None:
            _OPEN.add(self)
        elif self.backwards.shape[0] > micro:
            self.backwards[micro, self._pos[layer]] += 1
            _OPEN.add(self)

    def holds(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps one of the layers' parameters (remembered per optimizer)."""
        got = self._holders.get(optimizer)
        if got is None:
            mine = {id(p) for p in self._params}
            groups = getattr(optimizer, "param_groups", None) or []
            got = any(id(p) in mine for g in groups for p in g.get("params", ()))
            try:
                self._holders[optimizer] = got
            except TypeError:  # not weakly referenceable: ask again next time
                pass
        return got

    def discard(self) -> None:
        """Forgets the step's counts without an exchange (a step abandoned on every rank)."""
        self._reset()

    # ------------------------------------------------------------ verdict
    def skipped(self, where: str) -> None:
        """This rank starts something new (``where``) with its step open: it skipped
        ``finish_step``. Joins the exchange its peers make in theirs with that verdict, then
        raises (every rank does, naming this one)."""
        self._skip = SKIP_POINTS.index(where)
        self.finish(where)

    def finish(self, where: str = "finish_step") -> Optional[AuditReport]:
        """Closes the step: one exchange of every rank's verdict (see the module docstring),
        then raises `AuditError` naming the cause on every rank, or (only route differences,
        ``audit="warn"`` on every rank) logs it. Returns the step's `AuditReport` (None when
        the audit is off). Collective over the runner's groups. A call with no backward since
        the last one (``finish_step`` twice for one step) raises here, on this rank only, and
        exchanges nothing: its peers are already in the next step."""
        if not self.on:
            return None
        if not self.open and not self._skip:
            step = self.step
            raise AuditError(
                f"{where}: no MoE layer ran backward on this rank (DP rank {self.dp_rank}) since "
                f"{'the last finish_step' if step else 'begin_window'} (step {step}): finish_step was called twice "
                "for one step, or before the step's backward; nothing was summed"
            )
        row, tokens = self._row()
        try:
            table = self._exchange(row)
        finally:
            report_args = (self.step, tokens, self.forwards.copy(), self.backwards.copy())
            self.step += 1
            self._reset()
            if self.on_close is not None:
                self.on_close()
        text, warn_only = verdict(table, where, self.never_ran)
        self.last = AuditReport(
            step=report_args[0],
            digest=self.digest,
            layers=list(self.layers),
            tokens=report_args[1],
            planned=self.planned.copy(),
            forwards=report_args[2],
            backwards=report_args[3],
            verdict=text or "ok",
        )
        if text and not warn_only:
            raise AuditError(text)
        if text:
            log.warning("%s", text)
        return self.last

    def _row(self) -> Tuple[List[int], np.ndarray]:
        """This rank's verdict as `ROW` ints, and the step's tokens per unit (host + device)."""
        flags = self._flags.cpu().numpy() if self._flags is not None else None  # the step's one host sync
        tokens = self.tokens
        if self._tokens_dev is not None:
            tokens = tokens + self._tokens_dev.cpu().numpy()
        out = dict.fromkeys(ROW, 0)
        out.update(dp_rank=self.dp_rank, stage=self.stage, slots=self.slots, step=self.step, digest=self.digest)
        out.update(warn=int(self.mode == "warn"), skipped=self._skip)
        missing = np.argwhere(self.backwards == 0) if self.backwards.size else np.zeros((0, 2), np.int64)
        if missing.size:
            m, pos = (int(v) for v in missing[0])
            out.update(
                missing=len(missing), missing_m=m, missing_l=self.layers[pos], missing_f=int(self.forwards[m, pos])
            )
        if self._route is not None:
            m, pos, u, got, want = self._route
            out.update(route=self._route_n, route_m=m, route_l=self.layers[pos], route_u=u, route_got=got)
            out.update(route_want=want)
        if self._rerun is not None:
            m, pos = self._rerun
            out.update(rerun=self._rerun_n, rerun_m=m, rerun_l=self.layers[pos])
        for kind, key in ((0, "ids"), (1, "route")):
            cells = np.argwhere(flags[kind]) if flags is not None else np.zeros((0, 2), np.int64)
            if cells.size and not (key == "route" and self._route is not None):
                m, pos = (int(v) for v in cells[0])
                out.update({key: len(cells), f"{key}_m": m, f"{key}_l": self.layers[pos]})
                if key == "route":
                    want = self.planned[m, pos]
                    out.update(route_u=-2, route_got=-1, route_want=int(want.sum()))
        return [int(out[k]) for k in ROW], tokens

    def _exchange(self, row: List[int]) -> np.ndarray:
        """Every rank's row: int64 ``[ranks, len(ROW)]`` (one all-gather per group; where the
        groups overlap, as an EP group inside a data-parallel one, a rank's row arrives more
        than once and is kept once)."""
        t = torch.tensor([row], dtype=torch.int64, device=self.device)
        for group in self.groups:  # None: the default group
            try:
                t = torch.cat(all_gather_tensors(t, group, self.timeout))
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:
                raise _no_answer(group, self.timeout) from e
        table = t.cpu().numpy()
        who = table[:, [ROW.index("stage"), ROW.index("dp_rank")]]
        return table[np.sort(np.unique(who, axis=0, return_index=True)[1])]


def _at(a: np.ndarray, i: int) -> int:
    return int(a[i]) if 0 <= i < a.size else 0
