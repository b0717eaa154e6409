//! Bindings for intra-batch replication (hot_n, relibra, routepack, moonep, ultraep) and ReLibra's
//! node-level expert reordering placement.

use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use routepack_core::placement::relibra::relibra_placement as core_relibra_placement;
use routepack_core::replication::{self, Block, Packed, Planner};
use routepack_core::Replica;

use crate::columns::{self, ReplicaColumns};
use crate::convert::{self, slice};
use crate::errors::{run, to_py};
use crate::py_options;

/// What the three planners share: the plan's placement and layout (its replicas and migration
/// are not read: the planners replace them), its window, topology and cost, each read by the
/// one extractor of its kind; then `planner` runs on `block` with the GIL released.
#[allow(clippy::too_many_arguments)]
fn replicate<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    planner: Planner,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = py_options::cost(cost)?;
    let block = block_of(block)?;
    let packed = Packed { sample_rank: &plan.sample_rank, sample_micro: &plan.sample_micro, num_micro: plan.num_micro };
    let replicas: Vec<Replica> = run(py, || replication::plan_block(&w, &t, &c, &plan.placement, packed, &planner, block))?;
    Ok(columns::replica_columns(py, &replicas))
}

/// MindSpeed's hot-expert broadcast for a plan's placement and layout: replica columns
/// `(micro, group, layer, expert, src_rank, dst_rank, share)`. `hot_experts` None: the
/// core's `hot_n::DEFAULT_HOT_EXPERTS`. `block` `(index, count)`: plan only that block of
/// the exchanges (`replication::Block`; None: all).
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, hot_experts=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_hot_n<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    hot_experts: Option<usize>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let planner = Planner::HotN(py_options::hot_experts(hot_experts));
    replicate(py, plan, seq_lens, expert_tokens, topo, cost, planner, block)
}

/// ReLibra's intra-node replication for a plan's placement and layout: replica columns.
/// `replication_slots` None: the budget routepack's replication gets by default
/// (`replication::routepack::Options::default()`). `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, replication_slots=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_relibra<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    replication_slots: Option<usize>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let planner = Planner::Relibra(py_options::relibra_slots(replication_slots));
    replicate(py, plan, seq_lens, expert_tokens, topo, cost, planner, block)
}

/// routepack's replication (per-exchange simulated time, `replication_slots` copies per rank)
/// for a plan's placement and layout: replica columns. Options left None take the core's
/// defaults (`replication::routepack::Options::default()`, parsed by
/// `py_options::replication`). `time_budget_s`: a wall-clock cap in seconds, exchanges not
/// begun by then get no replicas (None or above `budget::UNLIMITED_S`: none; 0: no exchange
/// planned; negative or not finite: an error). `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, replication_slots=None, candidate_experts=None, candidate_dsts=None, time_budget_s=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_routepack<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    replication_slots: Option<usize>,
    candidate_experts: Option<usize>,
    candidate_dsts: Option<usize>,
    time_budget_s: Option<f64>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let opts = py_options::replication(replication_slots, candidate_experts, candidate_dsts, time_budget_s)?;
    replicate(py, plan, seq_lens, expert_tokens, topo, cost, Planner::Routepack(opts), block)
}

/// MoonEP's per-microbatch exact balance (`replication::moonep`) for a plan's placement and
/// layout: replica columns. `buffers`: prefetch buffers a rank (MoonEP's `E / R`; capped by
/// `topo.replica_slots`). `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, buffers, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_moonep<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    buffers: usize,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    replicate(py, plan, seq_lens, expert_tokens, topo, cost, Planner::MoonEp(buffers), block)
}

/// UltraEP's quota-driven balance (`replication::ultraep`) for a plan's placement and layout:
/// replica columns. `redundant`: spare slots a rank (capped by `topo.replica_slots`);
/// `min_tokens`: the least tokens a replica takes (>= 1). `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, redundant, min_tokens, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_ultraep<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    redundant: usize,
    min_tokens: i64,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    replicate(py, plan, seq_lens, expert_tokens, topo, cost, Planner::UltraEp(redundant, min_tokens), block)
}

/// ReLibra's per-window node-level expert reordering: phy2log `[L, ep*slots_per_rank]`.
/// `loads` float64 `[L, E]`; `previous` the phy2log in force (or None: static).
#[pyfunction]
#[pyo3(signature = (loads, topo, previous=None))]
pub fn relibra_placement<'py>(
    py: Python<'py>,
    loads: PyReadonlyArray2<'py, f64>,
    topo: &Bound<'py, PyAny>,
    previous: Option<PyReadonlyArray2<'py, i32>>,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let t = convert::topology(topo)?;
    let (l, e) = (loads.shape()[0], loads.shape()[1]);
    let ld = slice(&loads, "loads")?;
    let prev = previous.as_ref().map(|p| convert::placement(p, e, t.slots_per_rank)).transpose()?;
    let p = run(py, || core_relibra_placement(ld, l, e, &t, prev.as_ref()))?;
    Ok(numpy::ndarray::Array2::from_shape_vec((p.num_layers, p.num_slots), p.phy2log).expect("shape").into_pyarray(py))
}

/// `block` as the core's `Block` (None: every exchange); a bad pair is an error naming `block`.
fn block_of(block: Option<(usize, usize)>) -> PyResult<Block> {
    block.map_or(Ok(Block::ALL), |(i, n)| Block::new(i, n)).map_err(to_py)
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(replicate_hot_n, m)?)?;
    m.add_function(wrap_pyfunction!(replicate_relibra, m)?)?;
    m.add_function(wrap_pyfunction!(replicate_routepack, m)?)?;
    m.add_function(wrap_pyfunction!(replicate_moonep, m)?)?;
    m.add_function(wrap_pyfunction!(replicate_ultraep, m)?)?;
    m.add_function(wrap_pyfunction!(relibra_placement, m)?)?;
    Ok(())
}
