//! routepack._core: thin PyO3 bindings over `routepack-core`.
//!
//! Each `py_*.rs` file binds one stage and registers its own functions; `convert` turns
//! numpy arrays and Python objects into core views (without copying where the core takes
//! views); `columns` turns core plan tables back into numpy columns; `errors` maps core
//! errors to the exception hierarchy and keeps panics inside; `py_options` parses the cost
//! model and every stage's options struct (one place each), an option without a value taking
//! the core's `Default` impls and constants, so no default is written here.

#![deny(missing_docs)]

use pyo3::prelude::*;

mod columns;
mod convert;
mod errors;
mod py_flow;
mod py_ingest;
mod py_options;
mod py_packing;
mod py_placement;
mod py_plan;
mod py_replication;
mod py_simulate;

/// The module: each file adds its own functions (one `register` per file), so a binding
/// is declared and registered in one place.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    py_options::register(m)?;
    py_plan::register(m)?;
    py_packing::register(m)?;
    py_simulate::register(m)?;
    py_ingest::register(m)?;
    py_flow::register(m)?;
    py_replication::register(m)?;
    py_placement::register(m)?;
    Ok(())
}
