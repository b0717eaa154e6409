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

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use routepack_core::Error;

create_exception!(routepack, RoutepackError, PyValueError, "Base of routepack's errors (a ValueError).");
create_exception!(routepack, InvalidPlanError, RoutepackError, "A plan breaks an invariant of docs/design.md.");
create_exception!(routepack, InfeasibleError, RoutepackError, "No plan can satisfy the inputs (e.g. a sample longer than the cap).");
create_exception!(routepack, RoutepackInternalError, PyRuntimeError, "A bug in routepack (a Rust panic caught at the boundary).");

/// A `RoutepackTypeError` (the class `register` builds) carrying `msg`; a plain `TypeError`
/// should the class be missing.
pub fn type_error(py: Python<'_>, msg: String) -> PyErr {
    let made = py.import("routepack._core").and_then(|m| m.getattr("RoutepackTypeError")).and_then(|c| c.call1((msg.clone(),)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(_) => PyTypeError::new_err(msg),
    }
}

/// A core error → the exception class of its kind.
pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument { .. } => RoutepackError::new_err(e.to_string()),
        Error::InvalidPlan(_) => InvalidPlanError::new_err(e.to_string()),
        Error::Infeasible(_) => InfeasibleError::new_err(e.to_string()),
    }
}

thread_local! {
    /// Set while this thread runs a core call inside `run`'s catch_unwind.
    static IN_RUN: Cell<bool> = const { Cell::new(false) };
    /// "message at file:line:col" of the last panic caught on this thread inside `run`.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Core calls in progress on any thread. A panic on a rayon worker thread (the core's
/// parallel loops) happens while one is in progress; rayon hands its payload to the caller,
/// whose catch_unwind turns it into `RoutepackInternalError`.
static ACTIVE_RUNS: AtomicUsize = AtomicUsize::new(0);
/// Location of the last panic seen on a thread outside `run` while a run was in progress
/// (a rayon worker's): read by the caller that catches it.
static WORKER_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Installs, once per process, a panic hook that stays silent for panics `run` catches (the
/// error it raises carries the message and location instead of stderr). This hook belongs to
/// this extension's own copy of std, so it sees only this extension's panics; panics while no
/// core call is in progress (the binding glue's, which pyo3 turns into PanicException) keep
/// the default hook. A glue panic on another Python thread while a core call runs is also
/// silenced; its message still reaches Python in the PanicException.
fn install_quiet_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let here = IN_RUN.with(Cell::get);
            if !here && ACTIVE_RUNS.load(Ordering::SeqCst) == 0 {
                return default(info);
            }
            let text = format!(
                "{} at {}",
                payload_text(info.payload()),
                info.location().map_or_else(|| "an unknown location".into(), |l| l.to_string())
            );
            if here {
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
            } else if let Ok(mut slot) = WORKER_PANIC.lock() {
                *slot = Some(text);
            }
        }));
    });
}

/// The text of a panic payload (a `&str` or a `String`; anything else is "unknown panic").
fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Marks this thread as inside `run` for its lifetime, also when unwinding.
struct InRun;

impl InRun {
    fn enter() -> Self {
        ACTIVE_RUNS.fetch_add(1, Ordering::SeqCst);
        IN_RUN.with(|f| f.set(true));
        LAST_PANIC.with(|p| p.borrow_mut().take());
        InRun
    }
}

impl Drop for InRun {
    fn drop(&mut self) {
        IN_RUN.with(|f| f.set(false));
        ACTIVE_RUNS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `f` without the GIL; maps core errors and catches panics (silently: the message and
/// location go into the `RoutepackInternalError`, not to stderr).
pub fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> routepack_core::Result<T> + Send) -> PyResult<T> {
    install_quiet_hook();
    let out = py.detach(|| {
        let _in_run = InRun::enter();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
            let located = LAST_PANIC.with(|p| p.borrow_mut().take()).or_else(|| WORKER_PANIC.lock().ok().and_then(|mut slot| slot.take()));
            located.unwrap_or_else(|| payload_text(payload.as_ref()))
        })
    });
    match out {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(e)),
        Err(msg) => Err(RoutepackInternalError::new_err(format!("internal error (please report): {msg}"))),
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
