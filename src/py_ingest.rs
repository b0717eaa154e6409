//! Binding for routing-replay ingestion: dispatches on the id dtype, reads without a copy.

use numpy::{IntoPyArray, PyArray1, PyArray3, PyReadonlyArray1, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use routepack_core::ingest::{check_expert_tokens as core_check, expert_tokens_from_routed as core_ingest, ExpertId};

use crate::convert::slice;
use crate::errors::run;

type Out<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray3<i32>>);

fn count<'py, T: ExpertId + numpy::Element>(
    py: Python<'py>,
    routed: PyReadonlyArray3<'py, T>,
    cu: &[i64],
    num_experts: usize,
) -> PyResult<Out<'py>> {
    let sh = routed.shape().to_vec();
    let ids = slice(&routed, "routed")?;
    let (lens, counts) = run(py, || core_ingest(ids, sh[1], sh[2], cu, num_experts))?;
    let s = lens.len();
    let arr = numpy::ndarray::Array3::from_shape_vec((s, sh[1], num_experts), counts).expect("shape");
    Ok((lens.into_pyarray(py), arr.into_pyarray(py)))
}

/// `(seq_lens [S], expert_tokens [S, L, E])` from `routed [T, L, k]` and `cu_seqlens [S+1]`.
#[pyfunction]
pub fn expert_tokens_from_routed<'py>(
    py: Python<'py>,
    routed: &Bound<'py, PyAny>,
    cu_seqlens: PyReadonlyArray1<'py, i64>,
    num_experts: usize,
) -> PyResult<Out<'py>> {
    let cu = slice(&cu_seqlens, "cu_seqlens")?;
    if let Ok(a) = routed.extract::<PyReadonlyArray3<u8>>() {
        return count(py, a, cu, num_experts);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i16>>() {
        return count(py, a, cu, num_experts);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i32>>() {
        return count(py, a, cu, num_experts);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i64>>() {
        return count(py, a, cu, num_experts);
    }
    Err(PyTypeError::new_err("routed: expected a 3-D array of uint8, int16, int32 or int64 ids [T, L, k]"))
}

/// Raises `RoutepackError` unless `expert_tokens [S, L, E]` is possible for `seq_lens [S]`
/// (and `top_k`, when given): `ingest::check_expert_tokens`.
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, top_k=None))]
pub fn check_expert_tokens<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: PyReadonlyArray3<'py, i32>,
    top_k: Option<usize>,
) -> PyResult<()> {
    let sh = expert_tokens.shape().to_vec();
    let (lens, counts) = (slice(&seq_lens, "seq_lens")?, slice(&expert_tokens, "expert_tokens")?);
    // a sample count that differs from seq_lens' fails the core's S*L*E size check
    run(py, || core_check(lens, counts, sh[1], sh[2], top_k))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(expert_tokens_from_routed, m)?)?;
    m.add_function(wrap_pyfunction!(check_expert_tokens, m)?)?;
    Ok(())
}
