//! `defaults()`: every stage option's default, read from the core's `Default` impls and
//! constants, so Python never writes a default of its own (one source for every number).

use pyo3::prelude::*;
use pyo3::types::PyDict;
use routepack_core::cost::{Overlap, DEFAULT_PASSES};
use routepack_core::packing::routepack::{Options as PackingOptions, DEFAULT_MOVES, DEFAULT_MOVES_ACROSS_NODES};
use routepack_core::placement::demand::DEFAULT_CHUNKS;
use routepack_core::placement::routepack::Options as PlacementOptions;
use routepack_core::replication::hot_n::DEFAULT_HOT_EXPERTS;
use routepack_core::replication::routepack::Options as ReplicationOptions;

/// `{stage: {option name: default}}` with the option names `plan_window` takes.
#[pyfunction]
pub fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);

    let p = PlacementOptions::default();
    let placement = PyDict::new(py);
    placement.set_item("placement_chunks", DEFAULT_CHUNKS)?;
    placement.set_item("placement_slack", p.slack)?;
    placement.set_item("placement_explore", p.explore)?;
    placement.set_item("placement_fluct_evals", p.fluct_evals)?;
    placement.set_item("placement_migration_aware", p.migration_aware)?;
    out.set_item("placement", placement)?;

    let l = PackingOptions::default();
    let a = &l.anneal;
    let packing = PyDict::new(py);
    packing.set_item("anneal_moves", DEFAULT_MOVES)?;
    packing.set_item("anneal_moves_across_nodes", DEFAULT_MOVES_ACROSS_NODES)?;
    packing.set_item("anneal_chains", a.chains)?;
    packing.set_item("anneal_steps", a.steps)?;
    packing.set_item("anneal_lambda", l.lambda)?;
    packing.set_item("anneal_start_accept", a.start_accept)?;
    packing.set_item("anneal_cooling", a.cooling)?;
    packing.set_item("anneal_mix", (a.mix.shift, a.mix.swap, a.mix.near, a.mix.cells))?;
    packing.set_item("packing_exact_nodes", l.exact_nodes)?;
    out.set_item("packing", packing)?;

    let r = ReplicationOptions::default();
    let replication = PyDict::new(py);
    replication.set_item("replication_hot_experts", DEFAULT_HOT_EXPERTS)?;
    replication.set_item("replication_slots", r.replica_slots)?;
    replication.set_item("replication_candidates", r.experts)?;
    out.set_item("replication", replication)?;
    Ok(out)
}

/// `{field: default}` of the cost model's options (`c_weights`, `c_gemm`, `expert_table`, `c_call`,
/// `a2a_latency`, `bw_reduce`, `overlap`, `passes`): the values that price every plan as before the options existed.
#[pyfunction]
pub fn cost_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let cost = PyDict::new(py);
    cost.set_item("c_weights", 0.0)?;
    cost.set_item("c_gemm", 0.0)?;
    cost.set_item("expert_table", Vec::<(f64, f64)>::new())?;
    cost.set_item("c_call", 0.0)?;
    cost.set_item("a2a_latency", 0.0)?;
    cost.set_item("bw_reduce", 0.0)?;
    cost.set_item("overlap", Overlap::default().name())?;
    cost.set_item("passes", DEFAULT_PASSES.iter().map(|p| p.name()).collect::<Vec<_>>())?;
    Ok(cost)
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(defaults, m)?)?;
    m.add_function(wrap_pyfunction!(cost_defaults, m)?)?;
    Ok(())
}
