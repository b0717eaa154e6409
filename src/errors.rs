//! The exception hierarchy, defined once: every core error becomes one of these, and a Rust
//! panic becomes `RoutepackInternalError` instead of crossing the FFI.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use routepack_core::Error;

create_exception!(routepack, RoutepackError, PyValueError, "Base of routepack's errors (a ValueError).");
create_exception!(routepack, InvalidPlanError, RoutepackError, "A plan breaks an invariant of DESIGN.md.");
create_exception!(routepack, InfeasibleError, RoutepackError, "No plan can satisfy the inputs (e.g. a sample longer than the cap).");
create_exception!(routepack, RoutepackInternalError, PyRuntimeError, "A bug in routepack (a Rust panic caught at the boundary).");

pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument { .. } => RoutepackError::new_err(e.to_string()),
        Error::InvalidPlan(_) => InvalidPlanError::new_err(e.to_string()),
        Error::Infeasible(_) => InfeasibleError::new_err(e.to_string()),
    }
}

/// Runs `f` without the GIL; maps core errors and catches panics.
pub fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> routepack_core::Result<T> + Send) -> PyResult<T> {
    let out = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    match out {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(e)),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(RoutepackInternalError::new_err(format!("internal error (please report): {msg}")))
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RoutepackError", py.get_type::<RoutepackError>())?;
    m.add("InvalidPlanError", py.get_type::<InvalidPlanError>())?;
    m.add("InfeasibleError", py.get_type::<InfeasibleError>())?;
    m.add("RoutepackInternalError", py.get_type::<RoutepackInternalError>())?;
    Ok(())
}
