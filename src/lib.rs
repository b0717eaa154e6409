//! routepack._core: thin PyO3 bindings over `routepack-core`.
//!
//! Each `py_*.rs` file binds one stage; `convert` turns numpy arrays into core views without
//! copying; `errors` maps core errors to the exception hierarchy and keeps panics inside.

use pyo3::prelude::*;

mod convert;
mod errors;
mod py_defaults;
mod py_flow;
mod py_ingest;
mod py_packing;
mod py_placement;
mod py_plan;
mod py_replication;
mod py_simulate;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(py_defaults::defaults, m)?)?;
    m.add_function(wrap_pyfunction!(py_plan::static_placement, m)?)?;
    m.add_function(wrap_pyfunction!(py_plan::placement_tables, m)?)?;
    m.add_function(wrap_pyfunction!(py_plan::validate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(py_plan::migration_diff, m)?)?;
    m.add_function(wrap_pyfunction!(py_packing::pack_sequential, m)?)?;
    m.add_function(wrap_pyfunction!(py_packing::pack_kk, m)?)?;
    m.add_function(wrap_pyfunction!(py_packing::pack_rows, m)?)?;
    m.add_function(wrap_pyfunction!(py_packing::pack_routepack, m)?)?;
    m.add_function(wrap_pyfunction!(py_packing::layout_proxy_cost, m)?)?;
    m.add_function(wrap_pyfunction!(py_simulate::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(py_ingest::expert_tokens_from_routed, m)?)?;
    m.add_function(wrap_pyfunction!(py_flow::route_cell, m)?)?;
    m.add_function(wrap_pyfunction!(py_flow::rank_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(py_replication::replicate_hot_n, m)?)?;
    m.add_function(wrap_pyfunction!(py_replication::replicate_relibra, m)?)?;
    m.add_function(wrap_pyfunction!(py_replication::replicate_routepack, m)?)?;
    m.add_function(wrap_pyfunction!(py_replication::relibra_placement, m)?)?;
    py_placement::register(m)?;
    Ok(())
}
