"""Type stubs for the Rust extension `routepack._core` (kept by hand; see src/*.rs)."""

from typing import Any, Dict, Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

class RoutepackError(ValueError): ...
class RoutepackTypeError(RoutepackError, TypeError): ...
class InvalidPlanError(RoutepackError): ...
class InfeasibleError(RoutepackError): ...
class RoutepackInternalError(RuntimeError): ...

def defaults() -> Dict[str, Dict[str, Any]]:
    """Every stage option's default, by stage (read from the Rust core's defaults)."""


I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
MigrationColumns = Tuple[I32, I32, I32, I32, I32, I32, F64]
ReplicaColumns = Tuple[I32, I32, I32, I32, I32, I32, F32]

def static_placement(num_layers: int, num_experts: int, topo: Any) -> I32:
    """phy2log [L, ep*slots_per_rank]: expert e on rank e // ceil(E/ep); spare slots -1."""

def placement_tables(phy2log: I32, num_experts: int, slots_per_rank: int) -> Tuple[I32, I32]:
    """(logcnt [L, E], log2phy [L, E, max_replicas]) of a checked phy2log."""

def validate_plan(plan: Any, seq_lens: I64, expert_tokens: I32, topo: Any, token_cap: int) -> None:
    """Raises InvalidPlanError with the first broken invariant."""

def migration_diff(previous: I32, next: I32, num_experts: int, slots_per_rank: int,
                   bytes_per_expert: float, ranks_per_node: int = 1) -> MigrationColumns:
    """Moves turning `previous` into `next` (sources on the destination's node preferred)."""

def pack_sequential(seq_lens: I64, token_cap: int, dp: int) -> Tuple[I32, I32, int]:
    """Arrival-order first fit: (sample_rank [S], sample_micro [S], num_micro)."""

def pack_kk(seq_lens: I64, token_cap: int, dp: int) -> Tuple[I32, I32, int, Dict[str, Any]]:
    """verl's Karmarkar–Karp balancing: (sample_rank [S], sample_micro [S], num_micro, report)."""

def pack_rows(seq_lens: I64, token_cap: int, step: int, node_limit: int = ...) -> Dict[str, Any]:
    """Fewest rows in multiples of `step` with their certificate: rows, bins, l1, l2,
    lower_bound, certified, gap, method, nodes."""

def pack_routepack(seq_lens: I64, expert_tokens: I32, topo: Any, cost: Any, phy2log: I32, token_cap: int,
                   seed: int = ..., anneal_moves: int = ..., time_budget_s: Optional[float] = ...,
                   chains: int = ..., steps: int = ..., exact_nodes: int = ..., lambda_: float = ...,
                   start_accept: float = ..., cooling: float = ...,
                   mix: Tuple[float, float, float, float] = ...) -> Tuple[I32, I32, int, Dict[str, Any]]:
    """Certified rows + annealed layout: (sample_rank [S], sample_micro [S], num_micro, report)."""

def layout_proxy_cost(seq_lens: I64, expert_tokens: I32, topo: Any, cost: Any, phy2log: I32,
                      sample_rank: I32, sample_micro: I32, num_micro: int) -> float:
    """The layout proxy's step time (max over EP groups of accumulated cost) of a layout."""

def simulate(plan: Any, seq_lens: I64, expert_tokens: I32, topo: Any, cost: Any) -> Dict[str, Any]:
    """DESIGN.md's cost model; keys are the fields of routepack.SimResult."""

def expert_tokens_from_routed(routed: np.ndarray, cu_seqlens: I64, num_experts: int) -> Tuple[I64, I32]:
    """(seq_lens [S], expert_tokens [S, L, E]) from top-k ids [T, L, k] (uint8/int16/int32/int64)."""

def route_cell(origin: I64, phy2log: I32, topo: Any, rep_expert: I32, rep_dst: I32,
               rep_share: F32) -> Tuple[I32, I32, I32, I32, I32, I64]:
    """Flow table of one (group, micro, layer) cell (flow.rs::route_cell):
    (origin_rank, dst_rank, dst_slot or -1, replica row or -1, expert, count)."""

def rank_tokens(plan: Any, seq_lens: I64, expert_tokens: I32, topo: Any) -> npt.NDArray[np.int64]:
    """int64 [G, M, L, ep]: tokens each EP rank receives under the plan (the simulator's tokens(p))."""

def replicate_hot_n(seq_lens: I64, expert_tokens: I32, phy2log: I32, sample_rank: I32, sample_micro: I32,
                    num_micro: int, topo: Any, cost: Any, hot_experts: int) -> ReplicaColumns:
    """MindSpeed's hot-expert broadcast: N hot experts per (group, micro, layer), copies on
    every other EP rank computing their own tokens."""

def replicate_relibra(seq_lens: I64, expert_tokens: I32, phy2log: I32, sample_rank: I32, sample_micro: I32,
                      num_micro: int, topo: Any, cost: Any, replica_slots: int) -> ReplicaColumns:
    """ReLibra's intra-node replication, at most `replica_slots` copies per rank per cell."""

def replicate_routepack(seq_lens: I64, expert_tokens: I32, phy2log: I32, sample_rank: I32, sample_micro: I32,
                        num_micro: int, topo: Any, cost: Any, replica_slots: int,
                        candidate_experts: int = 2, candidate_dsts: int = 2) -> ReplicaColumns:
    """routepack's replication: per cell, rows minimising the simulated layer time."""

def relibra_placement(loads: F64, topo: Any, previous: I32 | None = None) -> I32:
    """ReLibra's node-level expert reordering: phy2log [L, ep*slots_per_rank] from loads [L, E]."""

# ---- placement (src/py_placement.rs)
def rebalance_experts(weight: F64, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Tuple[I64, I64, I64]:
    """DeepSeek EPLB: (phy2log [L, R], log2phy [L, E, X], logcnt [L, E]) from weight [L, E] float64."""

def eplb_placement(loads: F64, topo: Any, num_groups: int) -> I32:
    """EPLB as a routepack placement: phy2log [L, ep*slots_per_rank]."""

def eplb_default_num_groups(num_experts: int, topo: Any) -> int:
    """Nodes per EP group when they divide E (hierarchical policy), else 1 (global)."""

def chunk_demand(seq_lens: I64, expert_tokens: I32, num_chunks: int) -> F64:
    """[L, E, B] tokens per expert in each of B consecutive-sample chunks."""

def routepack_placement(loads: F64, chunks: F64, topo: Any, cost: Any, previous: I32 | None = None,
                        cells: int = 0, slack: float = 5e-5, explore: float = 0.01,
                        fluct_evals: int = 1000, migration_aware: bool = True) -> Tuple[I32, Dict[str, Any]]:
    """(phy2log [L, ep*slots_per_rank], report: choice, swaps, moves, predicted_s, predicted_keep_s,
    predicted_fresh_s [L] each, migration_s)."""

def aggregate_imbalance(phy2log: I32, num_experts: int, slots_per_rank: int, loads: F64) -> F64:
    """[L] max / mean rank load over the window."""

def imbalance_lower_bound(loads: F64, num_slots: int, ranks: int) -> F64:
    """[L] lowest aggregate imbalance any placement can reach."""
