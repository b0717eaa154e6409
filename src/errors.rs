//! The exception hierarchy, defined once: every core error becomes one of these, and a Rust
//! panic becomes `RoutepackInternalError` instead of crossing the FFI.
//!
//! ```text
//! ValueError
//! └── RoutepackError               every input error (names the argument and the value)
//!     ├── RoutepackTypeError       an argument of the wrong type (also a TypeError)
//!     ├── InvalidPlanError         a plan breaks an invariant
//!     └── InfeasibleError          no plan can satisfy the inputs
//! RuntimeError
//! └── RoutepackInternalError       a bug: a Rust panic caught at the boundary
//! ```
//!
//! Python code raises the same classes (`routepack.errors`), so `except rp.RoutepackError`
//! catches every input error wherever it was found, and `except ValueError` / `except
//! TypeError` keep working.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use routepack_core::Error;

create_exception!(routepack, RoutepackError, PyValueError, "Base of routepack's errors (a ValueError).");
create_exception!(routepack, InvalidPlanError, RoutepackError, "A plan breaks an invariant of DESIGN.md.");
create_exception!(routepack, InfeasibleError, RoutepackError, "No plan can satisfy the inputs (e.g. a sample longer than the cap).");
create_exception!(routepack, RoutepackInternalError, PyRuntimeError, "A bug in routepack (a Rust panic caught at the boundary).");

/// A core error → the exception class of its kind.
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

/// Adds the exception classes to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RoutepackError", py.get_type::<RoutepackError>())?;
    // a RoutepackError that is also a TypeError: two bases, which `create_exception!` cannot
    // express, so the class is built by `type()` once at import
    let bases = pyo3::types::PyTuple::new(py, [py.get_type::<RoutepackError>().into_any(), py.get_type::<PyTypeError>().into_any()])?;
    let ns = pyo3::types::PyDict::new(py);
    ns.set_item("__doc__", "An argument of the wrong type (a RoutepackError and a TypeError).")?;
    ns.set_item("__module__", "routepack")?;
    let type_error = py.get_type::<pyo3::types::PyType>().call1(("RoutepackTypeError", bases, ns))?;
    m.add("RoutepackTypeError", type_error)?;
    m.add("InvalidPlanError", py.get_type::<InvalidPlanError>())?;
    m.add("InfeasibleError", py.get_type::<InfeasibleError>())?;
    m.add("RoutepackInternalError", py.get_type::<RoutepackInternalError>())?;
    Ok(())
}
