//! Core plan tables → numpy columns, the direction opposite to `convert`. The Python side
//! assembles the structured arrays (`REPLICA_DTYPE`, `MIGRATION_DTYPE`) from these tuples, so
//! the column order here is the field order there.

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use routepack_core::{ExpertMove, Replica};

/// `(layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)`.
pub type MigrationColumns<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<f64>>,
);

/// `(micro, group, layer, expert, src_rank, dst_rank, share)`.
pub type ReplicaColumns<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<f32>>,
);

/// Expert moves → [`MigrationColumns`].
pub fn migration_columns<'py>(py: Python<'py>, moves: &[ExpertMove]) -> MigrationColumns<'py> {
    let col = |f: fn(&ExpertMove) -> i32| moves.iter().map(f).collect::<Vec<i32>>().into_pyarray(py);
    (
        col(|r| r.layer),
        col(|r| r.expert),
        col(|r| r.src_rank),
        col(|r| r.dst_rank),
        col(|r| r.src_slot),
        col(|r| r.dst_slot),
        moves.iter().map(|r| r.bytes).collect::<Vec<f64>>().into_pyarray(py),
    )
}

/// Replicas → [`ReplicaColumns`].
pub fn replica_columns<'py>(py: Python<'py>, replicas: &[Replica]) -> ReplicaColumns<'py> {
    let col = |f: fn(&Replica) -> i32| replicas.iter().map(f).collect::<Vec<i32>>().into_pyarray(py);
    (
        col(|r| r.micro),
        col(|r| r.group),
        col(|r| r.layer),
        col(|r| r.expert),
        col(|r| r.src_rank),
        col(|r| r.dst_rank),
        replicas.iter().map(|r| r.share).collect::<Vec<f32>>().into_pyarray(py),
    )
}
