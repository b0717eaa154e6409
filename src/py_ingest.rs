//! Binding for routing-replay ingestion: dispatches on the id dtype, reads without a copy.

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use routepack_core::ingest::{check_expert_tokens as core_check, expert_tokens_from_routed as core_ingest, ExpertId};
use routepack_core::OwnedCounts;

use crate::convert::{slice, CountsArray};
use crate::errors::run;

/// `(seq_lens [S] int64, expert_tokens [S, L, E])`, the counts a uint8, uint16 or int32 array.
type Out<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyAny>);

/// `[S, L, E]` counts as a numpy array of their own type (moved, not copied).
fn counts_array<'py>(py: Python<'py>, shape: (usize, usize, usize), counts: OwnedCounts) -> Bound<'py, PyAny> {
    use numpy::ndarray::Array3;
    match counts {
        OwnedCounts::I32(v) => Array3::from_shape_vec(shape, v).expect("shape").into_pyarray(py).into_any(),
        OwnedCounts::U16(v) => Array3::from_shape_vec(shape, v).expect("shape").into_pyarray(py).into_any(),
        OwnedCounts::U8(v) => Array3::from_shape_vec(shape, v).expect("shape").into_pyarray(py).into_any(),
    }
}

fn count<'py, T: ExpertId + numpy::Element>(
    py: Python<'py>,
    routed: PyReadonlyArray3<'py, T>,
    cu: &[i64],
    num_experts: usize,
    moe_layers: Option<&[usize]>,
) -> PyResult<Out<'py>> {
    let sh = routed.shape().to_vec();
    let ids = slice(&routed, "routed")?;
    let (lens, counts) = run(py, || core_ingest(ids, sh[1], sh[2], cu, num_experts, moe_layers))?;
    let shape = (lens.len(), moe_layers.map_or(sh[1], <[usize]>::len), num_experts);
    Ok((lens.into_pyarray(py), counts_array(py, shape, counts)))
}

/// `(seq_lens [S], expert_tokens [S, L', E])` from `routed [T, L, k]` and `cu_seqlens [S+1]`,
/// counting the rows `moe_layers` lists (None: all, L' = L); the counts in the narrowest of
/// uint8, uint16, int32 that holds them.
#[pyfunction]
#[pyo3(signature = (routed, cu_seqlens, num_experts, moe_layers=None))]
pub fn expert_tokens_from_routed<'py>(
    py: Python<'py>,
    routed: &Bound<'py, PyAny>,
    cu_seqlens: PyReadonlyArray1<'py, i64>,
    num_experts: usize,
    moe_layers: Option<Vec<usize>>,
) -> PyResult<Out<'py>> {
    let cu = slice(&cu_seqlens, "cu_seqlens")?;
    let moe_layers = moe_layers.as_deref();
    if let Ok(a) = routed.extract::<PyReadonlyArray3<u8>>() {
        return count(py, a, cu, num_experts, moe_layers);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i16>>() {
        return count(py, a, cu, num_experts, moe_layers);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i32>>() {
        return count(py, a, cu, num_experts, moe_layers);
    }
    if let Ok(a) = routed.extract::<PyReadonlyArray3<i64>>() {
        return count(py, a, cu, num_experts, moe_layers);
    }
    Err(PyTypeError::new_err("routed: expected a 3-D array of uint8, int16, int32 or int64 ids [T, L, k]"))
}

/// Raises `RoutepackError` unless `expert_tokens [S, L, E]` (int32, uint16 or uint8) is
/// possible for `seq_lens [S]` (and `top_k`, when given): `ingest::check_expert_tokens`.
/// Returns the largest count (what picks the narrowest type that holds them).
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, top_k=None))]
pub fn check_expert_tokens<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: CountsArray<'py>,
    top_k: Option<usize>,
) -> PyResult<i64> {
    let sh = expert_tokens.shape().to_vec();
    let (lens, counts) = (slice(&seq_lens, "seq_lens")?, expert_tokens.counts()?);
    // a sample count that differs from seq_lens' fails the core's S*L*E size check
    run(py, || core_check(lens, counts, sh[1], sh[2], top_k))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(expert_tokens_from_routed, m)?)?;
    m.add_function(wrap_pyfunction!(check_expert_tokens, m)?)?;
    Ok(())
}
