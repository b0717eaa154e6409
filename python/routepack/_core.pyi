"""Type stubs for the Rust extension `routepack._core` (kept by hand beside src/*.rs, one
section per binding file; `.ci/run` checks them against the built module with
`python -m mypy.stubtest routepack._core`).

An option that defaults to None takes the Rust core's default (`defaults()` lists them)."""

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

# what the module exports (PyO3 fills the runtime `__all__` as each file registers)
__all__ = [
    "__version__",
    "RoutepackError",
    "RoutepackTypeError",
    "InvalidPlanError",
    "InfeasibleError",
    "RoutepackInternalError",
    "defaults",
    "cost_defaults",
    "check_cost",
    "MAX_TABLE_BYTES",
    "topology_defaults",
    "static_placement",
    "placement_tables",
    "validate_plan",
    "migration_diff",
    "pack_sequential",
    "split_pieces",
    "pack_kk",
    "pack_rows",
    "pack_routepack",
    "layout_proxy_cost",
    "order_microbatches",
    "micro_rule",
    "lower_bound_micro",
    "simulate",
    "simulate_terms",
    "pipeline_makespan",
    "expert_tokens_from_routed",
    "check_expert_tokens",
    "route_cell",
    "rank_tokens",
    "replicate_hot_n",
    "replicate_relibra",
    "replicate_routepack",
    "replicate_moonep",
    "replicate_ultraep",
    "relibra_placement",
    "rebalance_experts",
    "eplb_placement",
    "eplb_node_groups",
    "chunk_demand",
    "routepack_placement",
    "aggregate_imbalance",
    "imbalance_lower_bound",
]

__version__: str

# the private aliases below exist only here (stubtest skips private names)
_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]
_F32 = npt.NDArray[np.float32]
_F64 = npt.NDArray[np.float64]
#: a window's counts [S, L, E] as `Window.counts` stores them (every binding reads them zero-copy)
_Counts = Union[npt.NDArray[np.uint8], npt.NDArray[np.uint16], npt.NDArray[np.int32]]
#: (layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)
_MigrationColumns = Tuple[_I32, _I32, _I32, _I32, _I32, _I32, _F64]
#: (micro, group, layer, expert, src_rank, dst_rank, share)
_ReplicaColumns = Tuple[_I32, _I32, _I32, _I32, _I32, _I32, _F32]
#: (sample_rank [S], sample_micro [S], num_micro, report)
_CellsReport = Tuple[_I32, _I32, int, Dict[str, Any]]

# ---- errors (src/errors.rs)
class RoutepackError(ValueError): ...
class RoutepackTypeError(RoutepackError, TypeError): ...
class InvalidPlanError(RoutepackError): ...
class InfeasibleError(RoutepackError): ...
class RoutepackInternalError(RuntimeError): ...

# ---- options and their defaults (src/py_options.rs)
def defaults() -> Dict[str, Dict[str, Any]]:
    """Every stage option's default, by stage (read from the Rust core's defaults)."""

def cost_defaults() -> Dict[str, Any]:
    """The cost model options' defaults: c_weights, c_gemm, expert_table, c_call, a2a_latency,
    bw_reduce, reduce_latency, replica_prefetch, c_replica, c_migrate, migration_latency, overlap,
    passes (the core's)."""

def check_cost(cost: Any) -> None:
    """Raises RoutepackError naming the field unless the cost model passes the core's check:
    coefficients finite and >= 0, bandwidths > 0, no unit of a step's work priced past the
    core's ceiling (a step time that could not be finite)."""

#: the most bytes one table sized by an argument may take (the core's sizes::MAX_TABLE_BYTES)
MAX_TABLE_BYTES: int

def topology_defaults() -> Dict[str, Any]:
    """The topology's optional fields' defaults: replica_slots, pp, vpp, cp (the core's) and
    layers_per_stage (None: the even split)."""

# ---- placement tables and plans (src/py_plan.rs)
def static_placement(num_layers: int, num_experts: int, topo: Any) -> _I32:
    """phy2log [L, ep*slots_per_rank]: expert e on rank e // ceil(E/ep); spare slots -1."""

def placement_tables(phy2log: _I32, num_experts: int, slots_per_rank: int) -> Tuple[_I32, _I32]:
    """(logcnt [L, E], log2phy [L, E, max_replicas]) of a checked phy2log."""

def validate_plan(
    plan: Any, seq_lens: _I64, expert_tokens: _Counts, topo: Any, token_cap: int, oversize: Optional[str] = None
) -> None:
    """Raises InvalidPlanError with the first broken invariant (placement.logcnt / log2phy,
    where present, included). `oversize` "alone": a cell over the cap may hold one sample;
    "split": a sample over the cap split over a CP group of `topo.cp` ranks."""

def migration_diff(
    previous: _I32,
    next: _I32,
    num_experts: int,
    slots_per_rank: int,
    bytes_per_expert: float,
    ranks_per_node: Optional[int] = None,
) -> _MigrationColumns:
    """Moves turning `previous` into `next` (sources on the destination's node preferred;
    None: every rank its own node)."""

# ---- packing (src/py_packing.rs)
def pack_sequential(
    seq_lens: _I64,
    token_cap: int,
    dp: int,
    min_micro: Optional[int] = None,
    micro_multiple: Optional[int] = None,
    oversize: Optional[str] = None,
    cp: Optional[int] = None,
) -> _CellsReport:
    """Arrival-order first fit: (sample_rank [S], sample_micro [S], num_micro, report {rows, fallback}).
    `min_micro`, `micro_multiple`: a pipeline's microbatch rule; `oversize` "alone": a sample over
    the cap in a row of its own, "split": split over a CP group of `cp` ranks."""

def pack_kk(
    seq_lens: _I64,
    token_cap: int,
    dp: int,
    min_micro: Optional[int] = None,
    micro_multiple: Optional[int] = None,
    oversize: Optional[str] = None,
    cp: Optional[int] = None,
) -> _CellsReport:
    """verl's Karmarkar–Karp balancing: (sample_rank [S], sample_micro [S], num_micro, report)."""

def split_pieces(
    seq_lens: _I64, expert_tokens: _Counts, token_cap: int, cp: int, sample_rank: _I32, sample_micro: _I32
) -> Tuple[_I64, _I32, _I32, _I32]:
    """The pieces of a window whose samples over `token_cap` are split over CP groups of `cp` ranks:
    (seq_lens [S'], expert_tokens [S', L, E] int32, sample_rank [S'], sample_micro [S']), piece j
    of a split sample on its rank + j."""

def pack_rows(seq_lens: _I64, token_cap: int, step: int, node_limit: Optional[int] = None) -> Dict[str, Any]:
    """Fewest rows in multiples of `step` with their certificate: rows, bins, l1, l2,
    lower_bound, certified, gap, method, nodes."""

def pack_routepack(
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    phy2log: _I32,
    token_cap: int,
    seed: Optional[int] = None,
    anneal_moves: Optional[int] = None,
    time_budget_s: Optional[float] = None,
    chains: Optional[int] = None,
    steps: Optional[int] = None,
    exact_nodes: Optional[int] = None,
    lambda_: Optional[float] = None,
    start_accept: Optional[float] = None,
    cooling: Optional[float] = None,
    mix: Optional[Tuple[float, float, float, float]] = None,
    oversize: Optional[str] = None,
) -> _CellsReport:
    """Certified rows + annealed layout: (sample_rank [S], sample_micro [S], num_micro, report);
    the count meets `topo`'s pipeline rule."""

def micro_rule(pp: int, vpp: int) -> Tuple[int, int]:
    """Megatron's microbatch rule for pp stages of vpp chunks: (fewest per DP rank, multiple)."""

def lower_bound_micro(total_tokens: int, token_cap: int, dp: int, pp: int = 1, vpp: int = 1) -> int:
    """The fewest microbatches per DP rank: ceil(ceil(total / cap) / dp), raised to the rule."""

def order_microbatches(
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    phy2log: _I32,
    sample_rank: _I32,
    sample_micro: _I32,
    num_micro: int,
    evaluations: Optional[int] = None,
) -> Tuple[_I32, Dict[str, Any]]:
    """Each EP group's microbatches reordered to shorten its pipeline: (sample_micro [S], report
    {before, after, evaluations, groups_reordered})."""

def layout_proxy_cost(plan: Any, seq_lens: _I64, expert_tokens: _Counts, topo: Any, cost: Any) -> float:
    """The layout proxy's step time (max over EP groups of accumulated cost) of a plan's
    placement and layout (its replicas and migration are not read)."""

# ---- simulator (src/py_simulate.rs)
def simulate(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    ideal_micro: Optional[int] = None,
    token_cap: Optional[int] = None,
    plan_cap: Optional[int] = None,
    oversize: Optional[str] = None,
    replica_timing: Optional[str] = None,
    step_only: bool = False,
) -> Dict[str, Any]:
    """DESIGN.md's cost model; keys are the fields of routepack.SimResult. `ideal_micro`: the
    steps the ideal time assumes (None: the plan's own); `token_cap`: the cap the lower bound
    assumes (None: no cap); `plan_cap`: first validate the plan against this cap as
    `validate_plan` does (None: well-formedness only); `replica_timing`: the plan's
    ("prefetch" or "after_router": forward copies exposed); `step_only`: the step time and its
    parts only (`lower_bound_time` and `ideal_time` NaN)."""

def simulate_terms(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    ideal_micro: Optional[int] = None,
    token_cap: Optional[int] = None,
    oversize: Optional[str] = None,
    replica_timing: Optional[str] = None,
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """simulate's dict and each exchange's parts per rank: float64 attention_rank, expert_rank
    [G, M, L, ep]; attention, expert, all_to_all, hidden, replication, replica_forward,
    replica_backward [G, M, L]; int64 layer_stage [L]."""

def pipeline_makespan(
    pp: int,
    vpp: int,
    kind: str,
    fwd: npt.NDArray[np.float64],
    bwd: npt.NDArray[np.float64],
    p2p: npt.NDArray[np.float64],
) -> Tuple[float, npt.NDArray[np.float64]]:
    """(makespan, busy [pp]) of one run of the simulator's pipeline schedule ("1f1b", "forward"
    or "backward") on operation times fwd, bwd [M, pp*vpp] and sends p2p [M, pp*vpp - 1]."""

# ---- ingestion (src/py_ingest.rs)
def expert_tokens_from_routed(
    routed: np.ndarray, cu_seqlens: _I64, num_experts: int, moe_layers: Optional[Sequence[int]] = None
) -> Tuple[_I64, _Counts]:
    """(seq_lens [S], expert_tokens [S, L', E]) from top-k ids [T, L, k] (uint8/int16/int32/int64),
    counting the rows of the layer axis moe_layers lists (strictly increasing; None: all, L' = L);
    the counts in the narrowest of uint8, uint16, int32 that holds them."""

def check_expert_tokens(seq_lens: _I64, expert_tokens: _Counts, top_k: Optional[int] = None) -> int:
    """Raises RoutepackError unless the counts are possible for the lengths (and top_k);
    returns the largest count."""

# ---- token routing (src/py_flow.rs)
def route_cell(
    origin: _I64, phy2log: _I32, topo: Any, rep_expert: _I32, rep_dst: _I32, rep_share: _F32
) -> Tuple[_I32, _I32, _I32, _I32, _I32, _I64]:
    """Flow table of one exchange (EP group, step, layer) (flow::route_exchange):
    (origin_rank, dst_rank, dst_slot or -1, replica or -1, expert, count)."""

def rank_tokens(plan: Any, seq_lens: _I64, expert_tokens: _Counts, topo: Any) -> _I64:
    """int64 [G, M, L, ep]: tokens each EP rank receives under the plan (the simulator's tokens(p))."""

# ---- replication (src/py_replication.rs)
def replicate_hot_n(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    hot_experts: Optional[int] = None,
    block: Optional[Tuple[int, int]] = None,
) -> _ReplicaColumns:
    """MindSpeed's hot-expert broadcast for a plan's placement and layout (its replicas and
    migration are not read): N hot experts per exchange (EP group, microbatch, layer),
    copies on every other EP rank computing their own tokens. ``block`` ``(index, count)``:
    only that contiguous block of the flattened exchange index ``(g·M + m)·L + l``, the replicas
    the full run gives it, in order (None: every exchange; blocks 0..count tile the run)."""

def replicate_relibra(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    replication_slots: Optional[int] = None,
    block: Optional[Tuple[int, int]] = None,
) -> _ReplicaColumns:
    """ReLibra's intra-node replication for a plan's placement and layout, at most `replication_slots` copies per rank per exchange.
    ``block``: as in `replicate_hot_n`."""

def replicate_routepack(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    replication_slots: Optional[int] = None,
    candidate_experts: Optional[int] = None,
    candidate_dsts: Optional[int] = None,
    time_budget_s: Optional[float] = None,
    block: Optional[Tuple[int, int]] = None,
) -> _ReplicaColumns:
    """routepack's replication for a plan's placement and layout: per exchange, the replicas
    minimising the simulated layer time.
    ``block``: as in `replicate_hot_n`."""

def replicate_moonep(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    buffers: int,
    block: Optional[Tuple[int, int]] = None,
) -> _ReplicaColumns:
    """MoonEP's exact per-microbatch balance inside each NVLink domain, at most `buffers`
    distinct experts copied onto a rank. ``block``: as in `replicate_hot_n`."""

def replicate_ultraep(
    plan: Any,
    seq_lens: _I64,
    expert_tokens: _Counts,
    topo: Any,
    cost: Any,
    redundant: int,
    min_tokens: int,
    block: Optional[Tuple[int, int]] = None,
) -> _ReplicaColumns:
    """UltraEP's quota-driven exact-load balance inside each NVLink domain: at most `redundant`
    replicas a rank, each of at least `min_tokens` tokens. ``block``: as in `replicate_hot_n`."""

def relibra_placement(loads: _F64, topo: Any, previous: Optional[_I32] = None) -> _I32:
    """ReLibra's node-level expert reordering: phy2log [L, ep*slots_per_rank] from loads [L, E]."""

# ---- placement (src/py_placement.rs)
def rebalance_experts(
    weight: _F64, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Tuple[_I64, _I64, _I64]:
    """DeepSeek EPLB: (phy2log [L, R], log2phy [L, E, X], logcnt [L, E]) from weight [L, E] float64."""

def eplb_placement(loads: _F64, topo: Any, num_groups: int) -> _I32:
    """EPLB as a routepack placement: phy2log [L, ep*slots_per_rank]."""

def eplb_node_groups(num_experts: int, topo: Any) -> int:
    """Nodes per EP group when they divide E (EPLB's hierarchical policy), else 1 (global):
    the ``eplb_hierarchical`` configuration, not the default."""

def chunk_demand(seq_lens: _I64, expert_tokens: _Counts, num_chunks: int) -> _F64:
    """[L, E, B] tokens per expert in each of B consecutive-sample chunks."""

def routepack_placement(
    loads: _F64,
    chunks: _F64,
    topo: Any,
    cost: Any,
    previous: Optional[_I32] = None,
    cells: Optional[int] = None,
    slack: Optional[float] = None,
    explore: Optional[float] = None,
    fluct_evals: Optional[int] = None,
    migration_aware: Optional[bool] = None,
    time_budget_s: Optional[float] = None,
) -> Tuple[_I32, Dict[str, Any]]:
    """(phy2log [L, ep*slots_per_rank], report: choice, swaps, moves, predicted_s, predicted_keep_s,
    predicted_fresh_s [L] each, migration_s). `explore` None: the larger of the core's default
    room and `slack`."""

def aggregate_imbalance(phy2log: _I32, num_experts: int, slots_per_rank: int, loads: _F64) -> _F64:
    """[L] max / mean rank load over the window."""

def imbalance_lower_bound(loads: _F64, num_slots: int, ranks: int) -> _F64:
    """[L] lowest aggregate imbalance any placement can reach."""
