//! The one error type of the core. Every message names the argument and the offending value,
//! so the Python user can fix the call without reading Rust.

use thiserror::Error;

/// Every error of the core. The bindings map `InvalidArgument` to Python's `RoutepackError`,
/// `InvalidPlan` and `Infeasible` to its subclasses `InvalidPlanError` and `InfeasibleError`.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// An argument has the wrong shape, a value out of range, or is inconsistent with another.
    #[error("{arg}: {msg}")]
    InvalidArgument {
        /// The argument as the caller spells it, e.g. `seq_lens` or `topo.ep`.
        arg: String,
        /// What is wrong with it, naming the offending value.
        msg: String,
    },
    /// A plan breaks one of docs/design.md's invariants.
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// The problem has no feasible answer (e.g. a sample longer than the token cap).
    #[error("infeasible: {0}")]
    Infeasible(String),
}

/// The core's result type: every fallible function returns [`enum@Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for `Error::InvalidArgument`.
pub fn invalid(arg: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::InvalidArgument { arg: arg.into(), msg: msg.into() }
}

/// Shorthand for `Error::InvalidPlan`.
pub fn bad_plan(msg: impl Into<String>) -> Error {
    Error::InvalidPlan(msg.into())
}
