//! Bindings for intra-batch replication (hot_n, relibra, routepack) and ReLibra's
//! node-level expert reordering placement.

use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use routepack_core::budget;
use routepack_core::placement::relibra::relibra_placement as core_relibra_placement;
use routepack_core::replication::{self, routepack::Options, Block, Packed, Planner};

use crate::columns::{self, ReplicaColumns};
use crate::convert::{self, slice};
use crate::errors::{run, to_py};

/// Shared arguments of the three planners: window, placement, packing, topology, cost.
macro_rules! planner_args {
    ($seq_lens:ident, $expert_tokens:ident, $phy2log:ident, $sample_rank:ident, $sample_micro:ident, $topo:ident, $cost:ident) => {{
        let w = convert::window(&$seq_lens, &$expert_tokens)?;
        let t = convert::topology($topo)?;
        let c = convert::cost($cost)?;
        let p = convert::placement(&$phy2log, w.num_experts, t.slots_per_rank)?;
        let sr = slice(&$sample_rank, "sample_rank")?;
        let sm = slice(&$sample_micro, "sample_micro")?;
        (w, t, c, p, sr, sm)
    }};
}

/// MindSpeed's hot-expert broadcast: replica columns
/// `(micro, group, layer, expert, src_rank, dst_rank, share)`. `hot_experts` None: the
/// core's `hot_n::DEFAULT_HOT_EXPERTS`. `block` `(index, count)`: plan only that block of
/// the exchanges (`replication::Block`; None: all).
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, num_micro, topo, cost, hot_experts=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_hot_n<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    phy2log: PyReadonlyArray2<'py, i32>,
    sample_rank: PyReadonlyArray1<'py, i32>,
    sample_micro: PyReadonlyArray1<'py, i32>,
    num_micro: usize,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    hot_experts: Option<usize>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let (w, t, c, p, sr, sm) = planner_args!(seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, topo, cost);
    let packed = Packed { sample_rank: sr, sample_micro: sm, num_micro };
    let hot_experts = hot_experts.unwrap_or(replication::hot_n::DEFAULT_HOT_EXPERTS);
    let (planner, block) = (Planner::HotN(hot_experts), block_of(block)?);
    let rows = run(py, || replication::plan_block(&w, &t, &c, &p, packed, &planner, block))?;
    Ok(columns::replica_columns(py, &rows))
}

/// ReLibra's intra-node replication: replica columns. `replica_slots` None: the budget
/// routepack's replication gets by default (`replication::routepack::Options::default()`).
/// `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, num_micro, topo, cost, replica_slots=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_relibra<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    phy2log: PyReadonlyArray2<'py, i32>,
    sample_rank: PyReadonlyArray1<'py, i32>,
    sample_micro: PyReadonlyArray1<'py, i32>,
    num_micro: usize,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    replica_slots: Option<usize>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let (w, t, c, p, sr, sm) = planner_args!(seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, topo, cost);
    let packed = Packed { sample_rank: sr, sample_micro: sm, num_micro };
    let replica_slots = replica_slots.unwrap_or(Options::default().replica_slots);
    let (planner, block) = (Planner::Relibra(replica_slots), block_of(block)?);
    let rows = run(py, || replication::plan_block(&w, &t, &c, &p, packed, &planner, block))?;
    Ok(columns::replica_columns(py, &rows))
}

/// routepack's replication (per-exchange simulated time, `replica_slots` copies per rank):
/// replica columns. Options left None take the core's defaults
/// (`replication::routepack::Options::default()`). `time_budget_s`: a wall-clock cap in
/// seconds, exchanges not begun by then get no replicas (None or above
/// `budget::UNLIMITED_S`: none; 0: no exchange planned; negative or not finite: an error).
/// `block`: as in `replicate_hot_n`.
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, num_micro, topo, cost, replica_slots=None, candidate_experts=None, candidate_dsts=None, time_budget_s=None, block=None))]
#[allow(clippy::too_many_arguments)]
pub fn replicate_routepack<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    phy2log: PyReadonlyArray2<'py, i32>,
    sample_rank: PyReadonlyArray1<'py, i32>,
    sample_micro: PyReadonlyArray1<'py, i32>,
    num_micro: usize,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    replica_slots: Option<usize>,
    candidate_experts: Option<usize>,
    candidate_dsts: Option<usize>,
    time_budget_s: Option<f64>,
    block: Option<(usize, usize)>,
) -> PyResult<ReplicaColumns<'py>> {
    let (w, t, c, p, sr, sm) = planner_args!(seq_lens, expert_tokens, phy2log, sample_rank, sample_micro, topo, cost);
    let packed = Packed { sample_rank: sr, sample_micro: sm, num_micro };
    let d = Options::default();
    let opts = Options {
        replica_slots: replica_slots.unwrap_or(d.replica_slots),
        experts: candidate_experts.unwrap_or(d.experts),
        dsts: candidate_dsts.unwrap_or(d.dsts),
        time_budget: budget::from_secs("time_budget_s", time_budget_s).map_err(to_py)?,
    };
    let (planner, block) = (Planner::Routepack(opts), block_of(block)?);
    let rows = run(py, || replication::plan_block(&w, &t, &c, &p, packed, &planner, block))?;
    Ok(columns::replica_columns(py, &rows))
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
    m.add_function(wrap_pyfunction!(relibra_placement, m)?)?;
    Ok(())
}
