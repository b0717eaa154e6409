"""Token remapping: logical top-k ids → physical slots and replica copies under a plan.

The destination of every token is decided by `routepack-core/src/flow/` (`route_exchange`,
bound as `_core.route_cell`: the same function the simulator prices), so the tokens each EP
rank receives are exactly the plan's prediction. This module turns the cell's flow table (counts) into concrete token
assignments, deterministically:

* at the origin rank, the (token, k) pairs routed to logical expert e are taken in ascending
  flat index ``t*k + j`` and handed to e's flows from this rank in flow-table order;
* the send buffer is ordered by destination rank, then by flow-table order (stable), so the
  receiver can name the compute unit of every row it gets without any index exchange.

Logical routing and gate weights never change; only where each pair is computed does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from routepack import _core
from routepack._checks import positive_int
from routepack.errors import RoutepackError
from routepack.torch import _args

#: One row of a cell's flow table (see `flow_table`).
FLOW_DTYPE = np.dtype(
    [
        ("origin", "<i4"),
        ("dst_rank", "<i4"),
        ("dst_slot", "<i4"),
        ("replica", "<i4"),
        ("expert", "<i4"),
        ("count", "<i8"),
    ]
)


def flow_table(origin: np.ndarray, phy2log_row: np.ndarray, topo: Any, cell_rows: np.ndarray) -> np.ndarray:
    """The flow table of one (group, micro, layer) cell, via the Rust core.

    Args:
        origin:      int64 ``[ep, E]``: tokens of logical expert e from EP-local rank r.
        phy2log_row: int32 ``[ep*slots_per_rank]``: the layer's placement.
        topo:        `routepack.Topology`.
        cell_rows:   the cell's replicas (`routepack.REPLICA_DTYPE`), in plan table order.

    Returns:
        Structured array of `FLOW_DTYPE`: experts ascending, each in `route_expert`'s order;
        ``dst_slot`` is -1 for a replica flow, ``replica`` (index into ``cell_rows``) is -1
        for a slot flow.
    """
    origin, phy2log_row, topo, cell_rows = _check_cell(origin, phy2log_row, topo, cell_rows)
    return _flow_table(origin, phy2log_row, topo, cell_rows)


def _check_cell(origin: Any, phy2log_row: Any, topo: Any, cell_rows: Any) -> tuple:
    """`flow_table`'s arguments checked (each error names its argument), in the dtypes the
    core reads."""
    _args.topology(topo)
    origin = _args.counts_table(origin, "origin", topo.ep)
    e_n = int(origin.shape[1])
    row = _args.placement_row(phy2log_row, "phy2log_row", topo.num_slots, e_n)
    rows = _args.replica_rows(cell_rows, "cell_rows", e_n, topo.ep)
    return origin, row, topo, rows


def _flow_table(origin: np.ndarray, phy2log_row: np.ndarray, topo: Any, cell_rows: np.ndarray) -> np.ndarray:
    cols = _core.route_cell(
        np.ascontiguousarray(origin, dtype=np.int64),
        np.ascontiguousarray(phy2log_row, dtype=np.int32),
        topo,
        np.ascontiguousarray(cell_rows["expert"], dtype=np.int32),
        np.ascontiguousarray(cell_rows["dst_rank"], dtype=np.int32),
        np.ascontiguousarray(cell_rows["share"], dtype=np.float32),
    )
    out = np.zeros(len(cols[0]), dtype=FLOW_DTYPE)
    for name, col in zip(FLOW_DTYPE.names or (), cols):
        out[name] = col
    return out


def incoming(flows: np.ndarray, cell_rows: np.ndarray, ep_rank: int, spr: int) -> tuple:
    """The flows of a cell's flow table (`FLOW_DTYPE`) into EP rank ``ep_rank``, grouped by
    origin (table order kept inside), with the compute unit of each (int64: ``0..spr-1`` a
    local slot, ``spr + j`` the j-th of the rank's replica copies) and the indices of those
    copies in ``cell_rows`` (int64 ``[R]``, cell order): ``(flows, unit, replica_rows)``. What
    the rank computes, per unit, is ``bincount(unit, weights=flows["count"])``."""
    inc = flows[flows["dst_rank"] == ep_rank]
    inc = inc[np.argsort(inc["origin"], kind="stable")]
    replica_rows = np.flatnonzero(cell_rows["dst_rank"] == ep_rank).astype(np.int64)
    unit_of_row = np.full(len(cell_rows) + 1, -1, dtype=np.int64)  # last entry: slot flows
    unit_of_row[replica_rows] = spr + np.arange(len(replica_rows))
    unit = np.where(inc["dst_slot"] >= 0, inc["dst_slot"].astype(np.int64) - ep_rank * spr, unit_of_row[inc["replica"]])
    return inc, unit, replica_rows


@dataclass(frozen=True)
class TokenRoute:
    """How one EP rank's (token, k) pairs of one (micro, layer) travel, and what it computes.

    * ``send_order``  int64 ``[T*k]``: flat pair indices (``t*k + j``) in send order.
    * ``send_splits`` / ``recv_splits``: rows sent to / received from each EP rank (``[ep]``).
    * ``recv_unit``   int64 ``[N_recv]``: compute unit of each received row: ``0..slots-1`` a
      local placement slot, ``slots + j`` the j-th entry of ``replica_rows``.
    * ``replica_rows`` int64 ``[R]``: indices (into the cell's rows) of the replica copies this
      rank computes, cell order.
    * ``received``    int64 ``[ep]``: rows every EP rank of the group receives (the plan's
      prediction for this cell, from the whole flow table).
    * ``flows``: the cell's flow table (`FLOW_DTYPE`).
    """

    send_order: np.ndarray
    send_splits: list
    recv_splits: list
    recv_unit: np.ndarray
    replica_rows: np.ndarray
    received: np.ndarray
    flows: np.ndarray


def expert_counts(topk_ids: Any, num_experts: int) -> np.ndarray:
    """int64 ``[E]``: (token, k) pairs routed to each logical expert. ``topk_ids``: integer
    ids of any shape (a numpy array, a sequence or a torch tensor). Raises on an id outside
    ``[0, E)`` or ids that are not integers."""
    num_experts = positive_int(num_experts, "num_experts")
    flat = _args.int_ids(topk_ids, "topk_ids").reshape(-1)
    _args.ids_in_range(flat, "topk_ids", num_experts)
    return np.bincount(flat, minlength=num_experts).astype(np.int64)


def route_tokens(topk_ids: Any, origin: Any, phy2log_row: Any, topo: Any, cell_rows: Any, ep_rank: int) -> TokenRoute:
    """Assigns this rank's (token, k) pairs to destinations and names what it receives.

    Args:
        topk_ids: int ``[T, k]``: logical expert ids of this rank's tokens (replayed); T may
                  be 0 (a rank without tokens still receives and computes others' tokens).
        origin:   int64 ``[ep, E]``: every EP rank's pair counts per expert (all-gathered);
                  row ``ep_rank`` must equal the histogram of ``topk_ids``.
        phy2log_row, topo, cell_rows: as in `flow_table`.
        ep_rank:  this rank's EP-local rank, in ``[0, ep)``.
    """
    origin, row, topo, rows = _check_cell(origin, phy2log_row, topo, cell_rows)
    ep_rank = _args.rank(ep_rank, "ep_rank", topo.ep)
    ids = _args.int_ids(topk_ids, "topk_ids", 2)
    mine = expert_counts(ids, origin.shape[1])
    if not np.array_equal(mine, origin[ep_rank]):
        raise RoutepackError(f"origin[{ep_rank}]: counts differ from the histogram of topk_ids")
    return _route(ids, origin, row, topo, rows, ep_rank)


def _route(
    ids: np.ndarray, origin: np.ndarray, phy2log_row: np.ndarray, topo: Any, cell_rows: np.ndarray, ep_rank: int
) -> TokenRoute:
    """`route_tokens` on checked arguments (`EPMoE` calls it directly: its placement was
    checked when set, ``origin`` is the all-gather of checked counts, the plan's rows passed
    `Plan.validate`)."""
    ep, spr = topo.ep, topo.slots_per_rank
    flat = ids.reshape(-1)
    flows = _flow_table(origin, phy2log_row, topo, cell_rows)

    # origin side: pairs grouped by expert (ascending flat index inside), which is exactly the
    # order of this rank's flows in the table (experts ascending), so counts line up
    out = flows[flows["origin"] == ep_rank]
    order = np.argsort(flat, kind="stable")
    dst_of_pair = np.repeat(out["dst_rank"].astype(np.int64), out["count"])
    send_order = order[np.argsort(dst_of_pair, kind="stable")]
    send_splits = np.bincount(dst_of_pair, minlength=ep)

    # receiving side: flows into this rank grouped by origin, table order kept inside
    inc, unit, replica_rows = incoming(flows, cell_rows, ep_rank, spr)
    recv_unit = np.repeat(unit, inc["count"])
    recv_splits = np.bincount(inc["origin"].astype(np.int64), weights=inc["count"], minlength=ep).astype(np.int64)
    received = np.bincount(flows["dst_rank"].astype(np.int64), weights=flows["count"], minlength=ep).astype(np.int64)
    return TokenRoute(
        send_order=send_order.astype(np.int64),
        send_splits=[int(x) for x in send_splits],
        recv_splits=[int(x) for x in recv_splits],
        recv_unit=recv_unit,
        replica_rows=replica_rows,
        received=received,
        flows=flows,
    )
