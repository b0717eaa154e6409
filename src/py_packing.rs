//! Bindings for packing: samples → (rank, step) cells.

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use routepack_core::packing::sequential::sequential;

use crate::convert::slice;
use crate::errors::run;

type Cells<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>, usize);

/// Arrival-order first fit: `(sample_rank [S], sample_micro [S], num_micro)`.
#[pyfunction]
pub fn pack_sequential<'py>(py: Python<'py>, seq_lens: PyReadonlyArray1<'py, i64>, token_cap: i64, dp: usize) -> PyResult<Cells<'py>> {
    let lens = slice(&seq_lens, "seq_lens")?;
    let p = run(py, || sequential(lens, token_cap, dp))?;
    Ok((p.sample_rank.into_pyarray(py), p.sample_micro.into_pyarray(py), p.num_micro))
}
