//! Bindings for placement: the EPLB baseline (also in EPLB's own calling convention),
//! routepack's placement, chunk demand and the balance figures.

use numpy::ndarray::{Array1, Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use routepack_core::placement::demand::{chunk_demand as core_chunks, Demand};
use routepack_core::placement::routepack::{routepack_placement as core_routepack, Choice};
use routepack_core::placement::{eplb, quality};

use crate::convert;
use crate::errors::run;
use crate::py_options;

type I64_2<'py> = Bound<'py, PyArray2<i64>>;

/// DeepSeek EPLB's `rebalance_experts(weight [L, E] f64, num_replicas, num_groups, num_nodes,
/// num_gpus)` → `(phy2log [L, R], log2phy [L, E, X], logcnt [L, E])`, int64.
#[pyfunction]
pub fn rebalance_experts<'py>(
    py: Python<'py>,
    weight: PyReadonlyArray2<'py, f64>,
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> PyResult<(I64_2<'py>, Bound<'py, PyArray3<i64>>, I64_2<'py>)> {
    let (l, e) = (weight.shape()[0], weight.shape()[1]);
    let w = convert::slice(&weight, "weight")?;
    let t = run(py, || eplb::rebalance_experts(w, l, e, num_replicas, num_groups, num_nodes, num_gpus))?;
    Ok((
        Array2::from_shape_vec((l, num_replicas), t.phy2log).expect("shape").into_pyarray(py),
        Array3::from_shape_vec((l, e, t.max_count), t.log2phy).expect("shape").into_pyarray(py),
        Array2::from_shape_vec((l, e), t.logcnt).expect("shape").into_pyarray(py),
    ))
}

/// EPLB as a routepack placement: phy2log `[L, ep*slots_per_rank]` int32.
#[pyfunction]
pub fn eplb_placement<'py>(
    py: Python<'py>,
    loads: PyReadonlyArray2<'py, f64>,
    topo: &Bound<'py, PyAny>,
    num_groups: usize,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let (l, e) = (loads.shape()[0], loads.shape()[1]);
    let w = convert::slice(&loads, "loads")?;
    let t = convert::topology(topo)?;
    let p = run(py, || eplb::eplb_placement(w, l, e, &t, num_groups))?;
    Ok(Array2::from_shape_vec((p.num_layers, p.num_slots), p.phy2log).expect("shape").into_pyarray(py))
}

/// One EPLB expert group per node of an EP group when they divide the experts, else 1
/// (`eplb::node_groups`: the `eplb_hierarchical` configuration, not the default).
#[pyfunction]
pub fn eplb_node_groups(num_experts: usize, topo: &Bound<'_, PyAny>) -> PyResult<usize> {
    Ok(eplb::node_groups(num_experts, &convert::topology(topo)?))
}

/// `[L, E, B]` float64 tokens per expert in each of `num_chunks` consecutive-sample chunks.
#[pyfunction]
pub fn chunk_demand<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    num_chunks: usize,
) -> PyResult<Bound<'py, PyArray3<f64>>> {
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let (l, e) = (w.num_layers, w.num_experts);
    let c = run(py, || core_chunks(&w, num_chunks))?;
    Ok(Array3::from_shape_vec((l, e, num_chunks), c).expect("shape").into_pyarray(py))
}

/// routepack's placement → `(phy2log [L, ep*slots_per_rank] int32, report dict)`.
/// `loads [L, E]`, `chunks [L, E, B]` float64; `previous` the phy2log in force or None.
/// Options left None take the core's defaults (`placement::routepack::Options::default()`,
/// parsed by `py_options::placement`; `explore` None: the larger of the core's default room
/// and `slack`, `Options::explore`).
/// `time_budget_s`: a wall-clock cap of the search in seconds (None or above
/// `budget::UNLIMITED_S`: none; 0: greedy packing only; negative or not finite: an error).
#[pyfunction]
#[pyo3(signature = (loads, chunks, topo, cost, previous=None, cells=None, slack=None, explore=None, fluct_evals=None, migration_aware=None, time_budget_s=None))]
#[allow(clippy::too_many_arguments)]
pub fn routepack_placement<'py>(
    py: Python<'py>,
    loads: PyReadonlyArray2<'py, f64>,
    chunks: PyReadonlyArray3<'py, f64>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    previous: Option<PyReadonlyArray2<'py, i32>>,
    cells: Option<usize>,
    slack: Option<f64>,
    explore: Option<f64>,
    fluct_evals: Option<usize>,
    migration_aware: Option<bool>,
    time_budget_s: Option<f64>,
) -> PyResult<(Bound<'py, PyArray2<i32>>, Bound<'py, PyDict>)> {
    let (l, e) = (loads.shape()[0], loads.shape()[1]);
    let b = chunks.shape()[2];
    let t = convert::topology(topo)?;
    let c = py_options::cost(cost)?;
    let prev = match &previous {
        Some(p) => Some(convert::placement(p, e, t.slots_per_rank)?),
        None => None,
    };
    let (lw, cw) = (convert::slice(&loads, "loads")?, convert::slice(&chunks, "chunks")?);
    let opts = py_options::placement(cells, slack, explore, fluct_evals, migration_aware, time_budget_s)?;
    let out = run(py, || {
        let d = Demand::new(lw, cw, l, e, b)?;
        core_routepack(&d, &t, &c, prev.as_ref(), &opts)
    })?;
    let rep = PyDict::new(py);
    let col = |f: &dyn Fn(&routepack_core::placement::routepack::LayerReport) -> f64| -> Bound<'py, PyArray1<f64>> {
        Array1::from_iter(out.layers.iter().map(f)).into_pyarray(py)
    };
    let choice: Vec<&str> = out
        .layers
        .iter()
        .map(|r| match r.choice {
            Choice::Keep => "keep",
            Choice::Fresh => "fresh",
            Choice::Incremental => "incremental",
        })
        .collect();
    rep.set_item("choice", choice)?;
    rep.set_item("swaps", Array1::from_iter(out.layers.iter().map(|r| r.swaps as i64)).into_pyarray(py))?;
    rep.set_item("moves", Array1::from_iter(out.layers.iter().map(|r| r.moves as i64)).into_pyarray(py))?;
    rep.set_item("predicted_s", col(&|r| r.predicted))?;
    rep.set_item("predicted_keep_s", col(&|r| r.predicted_keep))?;
    rep.set_item("predicted_fresh_s", col(&|r| r.predicted_fresh))?;
    rep.set_item("migration_s", out.migration_time)?;
    let p = out.placement;
    Ok((Array2::from_shape_vec((p.num_layers, p.num_slots), p.phy2log).expect("shape").into_pyarray(py), rep))
}

/// `[L]` max / mean rank load of a placement over `loads [L, E]`.
#[pyfunction]
pub fn aggregate_imbalance<'py>(
    py: Python<'py>,
    phy2log: PyReadonlyArray2<'py, i32>,
    num_experts: usize,
    slots_per_rank: usize,
    loads: PyReadonlyArray2<'py, f64>,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let p = convert::placement(&phy2log, num_experts, slots_per_rank)?;
    let w = convert::slice(&loads, "loads")?;
    let v = run(py, || quality::aggregate_imbalance(&p, w))?;
    Ok(v.into_pyarray(py))
}

/// `[L]` lowest aggregate imbalance any placement can reach (optimal replication bound).
#[pyfunction]
pub fn imbalance_lower_bound<'py>(
    py: Python<'py>,
    loads: PyReadonlyArray2<'py, f64>,
    num_slots: usize,
    ranks: usize,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let (l, e) = (loads.shape()[0], loads.shape()[1]);
    let w = convert::slice(&loads, "loads")?;
    let v = run(py, || quality::imbalance_lower_bound(w, l, e, num_slots, ranks))?;
    Ok(v.into_pyarray(py))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rebalance_experts, m)?)?;
    m.add_function(wrap_pyfunction!(eplb_placement, m)?)?;
    m.add_function(wrap_pyfunction!(eplb_node_groups, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_demand, m)?)?;
    m.add_function(wrap_pyfunction!(routepack_placement, m)?)?;
    m.add_function(wrap_pyfunction!(aggregate_imbalance, m)?)?;
    m.add_function(wrap_pyfunction!(imbalance_lower_bound, m)?)?;
    Ok(())
}
