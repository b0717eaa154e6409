"""Routing tables of a window, computed once per window from the plan and the replayed ids.

Under routing replay the ids every rank feeds each MoE layer are known before the step: the
window's ``expert_tokens`` with the plan's layout give every EP rank's per-expert counts of
each (micro, layer) cell (what `EPMoE` otherwise all-gathers in the forward), and the
rank's own replayed ids give its send order. `window_routes` computes every cell's
`CellRoute` at `PlanRunner.begin_window` (with ``microbatches=``), with the index tensors
already on the device, so the forward does no host copy and no all-gather per layer: it
only compares its ids with the precomputed ones on the device, and `PlanRunner.finish_step`
checks that flag once per step (every rank raises when a rank was fed other ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch

from routepack.errors import RoutepackError
from routepack.torch.remap import TokenRoute, _route


@dataclass(frozen=True)
class CellRoute:
    """One (micro, layer) cell's route on this rank with its device index tensors.

    * ``route``: the `TokenRoute`; ``k``: experts per token.
    * ``src_rows`` int64 ``[T*k]``: token row of each sent pair (``send_order // k``).
    * ``back`` int64 ``[T*k]``: where each pair lands after the combine (``argsort(send_order)``).
    * ``unit_perm`` / ``unit_inv`` int64 ``[N_recv]``: received rows sorted by compute unit
      (stable) and back; ``unit_counts`` int64 ``[units]`` (host).
    * ``ids``: the replayed ids ``[T, k]`` this route was made for (on the device), or None.
    """

    route: TokenRoute
    k: int
    src_rows: torch.Tensor
    back: torch.Tensor
    unit_perm: torch.Tensor
    unit_inv: torch.Tensor
    unit_counts: np.ndarray
    ids: Any = None


def cell_route(route: TokenRoute, k: int, units: int, device: Any, ids: Any = None) -> CellRoute:
    """`CellRoute` of ``route`` (``units``: local slots + replica copies on this rank)."""
    perm = np.argsort(route.recv_unit, kind="stable")
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    return CellRoute(
        route=route,
        k=k,
        src_rows=dev(route.send_order // k),
        back=dev(np.argsort(route.send_order)),
        unit_perm=dev(perm),
        unit_inv=dev(np.argsort(perm)),
        unit_counts=np.bincount(route.recv_unit, minlength=units).astype(np.int64),
        ids=ids,
    )


def cell_origins(plan: Any, window: Any, group_index: int, ep: int) -> np.ndarray:
    """int64 ``[M, ep, L, E]``: pairs of logical expert e from EP-local rank r of EP group
    ``group_index`` in each (micro, layer), from the window's counts and the plan's layout."""
    sel = np.flatnonzero(plan.sample_rank // ep == group_index)
    out = np.zeros((plan.num_micro, ep, window.num_layers, window.num_experts), dtype=np.int64)
    np.add.at(out, (plan.sample_micro[sel], plan.sample_rank[sel] % ep), window.counts[sel].astype(np.int64))
    return out


def window_routes(runner: Any, plan: Any, window: Any, microbatches: Sequence[Any]) -> Dict[Tuple[int, int], CellRoute]:
    """Every (micro, layer) `CellRoute` of this rank for the window (host work, once).

    ``microbatches``: this rank's `routepack.torch.Microbatch` list in execution order
    (`rank_microbatches(plan, routed, dp_rank, ...)`, ids of every MoE layer of the plan),
    one per micro of the plan. Cells are keyed by (micro, `EPMoE.layer`): the runner's layers
    only (a pipeline stage's). Raises `RoutepackError` when they do not fit the plan or their
    ids disagree with the window."""
    mbs = list(microbatches)
    if [getattr(mb, "micro", None) for mb in mbs] != list(range(plan.num_micro)):
        raise RoutepackError(
            f"microbatches: expected this rank's {plan.num_micro} Microbatch objects in execution "
            f"order (rank_microbatches), got {len(mbs)} with micro "
            f"{[getattr(mb, 'micro', None) for mb in mbs][:8]}"
        )
    topo, layers = runner.topo, runner.layers
    origins = cell_origins(plan, window, runner.ep_group_index, topo.ep)
    me = layers[0].ep_rank
    out: Dict[Tuple[int, int], CellRoute] = {}
    for mb in mbs:
        routed = (
            mb.routed.detach().cpu().numpy().astype(np.int64)
            if isinstance(mb.routed, torch.Tensor)
            else np.asarray(mb.routed, dtype=np.int64)
        )
        if routed.ndim != 3 or routed.shape[1] != window.num_layers:
            raise RoutepackError(
                f"microbatches[{mb.micro}].routed: expected [T, L={window.num_layers}, k], got {routed.shape}"
            )
        for mod in layers:
            l = mod.layer
            ids = routed[:, l]
            origin = origins[mb.micro, :, l]
            mine = np.bincount(ids.reshape(-1), minlength=mod.num_experts) if ids.size else np.zeros(mod.num_experts)
            if mine.size != mod.num_experts or not np.array_equal(mine, origin[me]):
                raise RoutepackError(
                    f"microbatches[{mb.micro}].routed[:, {l}]: counts differ from the window's "
                    f"expert_tokens for this rank's samples (not this plan's replay)"
                )
            rows = runner.cell_rows_of(mb.micro, l)
            route = _route(ids, np.ascontiguousarray(origin), mod.phy2log, topo, rows, me)
            units = mod.slots_per_rank + int(route.replica_rows.size)
            dev_ids = torch.from_numpy(np.ascontiguousarray(ids)).to(mod.w1.device)
            out[(mb.micro, l)] = cell_route(route, ids.shape[1], units, mod.w1.device, dev_ids)
    return out
