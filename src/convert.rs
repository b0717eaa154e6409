//! numpy/Python objects → core types (the way back, core tables → numpy, is `columns`).
//! Arrays are borrowed (zero copy) where the core takes views; small tables (plans) are copied. Python-side classes guarantee dtypes and
//! contiguity, so failures here are programming errors reported as TypeError/ValueError.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use routepack_core::{sizes, Counts, ExpertMove, Placement, Plan, Replica, Topology, WindowView};

use crate::errors::{to_py, type_error};

/// Contiguous slice of a readonly array, or a clear error.
pub fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("{name}: must be C-contiguous")))
}

/// A window's `expert_tokens [S, L, E]` as the caller stores it: int32, uint16 or uint8,
/// borrowed without a copy (every binding taking `expert_tokens` extracts it as this type;
/// anything else is refused with `RoutepackTypeError` naming `expert_tokens` and its dtype).
pub enum CountsArray<'py> {
    /// int32 counts.
    I32(PyReadonlyArray3<'py, i32>),
    /// uint16 counts.
    U16(PyReadonlyArray3<'py, u16>),
    /// uint8 counts.
    U8(PyReadonlyArray3<'py, u8>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for CountsArray<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray3<'py, i32>>() {
            return Ok(Self::I32(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray3<'py, u16>>() {
            return Ok(Self::U16(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray3<'py, u8>>() {
            return Ok(Self::U8(a));
        }
        let what = match (obj.getattr("dtype"), obj.getattr("ndim")) {
            (Ok(d), Ok(n)) => format!("an array of dtype {d} with {n} dimensions"),
            _ => format!("a {}", obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())),
        };
        Err(type_error(obj.py(), format!("expert_tokens: expected a 3-D int32, uint16 or uint8 array [S, L, E], got {what}")))
    }
}

impl CountsArray<'_> {
    /// `[S, L, E]`.
    pub fn shape(&self) -> &[usize] {
        match self {
            Self::I32(a) => a.shape(),
            Self::U16(a) => a.shape(),
            Self::U8(a) => a.shape(),
        }
    }

    /// The counts as the core borrows them (C-contiguous, else an error).
    pub fn counts(&self) -> PyResult<Counts<'_>> {
        Ok(match self {
            Self::I32(a) => Counts::I32(slice(a, "expert_tokens")?),
            Self::U16(a) => Counts::U16(slice(a, "expert_tokens")?),
            Self::U8(a) => Counts::U8(slice(a, "expert_tokens")?),
        })
    }
}

/// Window arrays → view. `expert_tokens` is `[S, L, E]` (int32, uint16 or uint8), `seq_lens`
/// `[S]` int64.
pub fn window<'a>(seq_lens: &'a PyReadonlyArray1<'_, i64>, expert_tokens: &'a CountsArray<'_>) -> PyResult<WindowView<'a>> {
    let sh = expert_tokens.shape();
    if sh[0] != seq_lens.len() {
        return Err(to_py(routepack_core::error::invalid(
            "expert_tokens",
            format!("has {} samples but seq_lens has {}", sh[0], seq_lens.len()),
        )));
    }
    WindowView::new(slice(seq_lens, "seq_lens")?, expert_tokens.counts()?, sh[1], sh[2]).map_err(to_py)
}

/// Attribute `name` of a Python object, extracted; the error names the attribute.
pub fn attr<'py, T>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
    for<'a> <T as FromPyObject<'a, 'py>>::Error: Into<PyErr>,
{
    obj.getattr(name)?.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyValueError::new_err(format!("{name}: {e}"))
    })
}

/// A `routepack.Topology` → the core's (checked) `Topology`: the one place its fields are read.
pub fn topology(obj: &Bound<'_, PyAny>) -> PyResult<Topology> {
    let replica_slots: usize = attr(obj, "replica_slots")?;
    let (pp, vpp, cp): (usize, usize, usize) = (attr(obj, "pp")?, attr(obj, "vpp")?, attr(obj, "cp")?);
    let layers_per_stage: Option<Vec<usize>> = attr(obj, "layers_per_stage")?;
    let gpus_per_node: usize = attr(obj, "gpus_per_node")?;
    // None: a node is an NVLink domain
    let nvlink_domain: Option<usize> = attr(obj, "nvlink_domain")?;
    Topology::new(attr(obj, "dp")?, attr(obj, "ep")?, gpus_per_node, attr(obj, "slots_per_rank")?)
        .and_then(|t| t.with_nvlink_domain(nvlink_domain.unwrap_or(gpus_per_node)))
        .and_then(|t| t.with_replica_slots(replica_slots))
        .and_then(|t| t.with_pipeline(pp, vpp, layers_per_stage))
        .and_then(|t| t.with_cp(cp))
        .map_err(to_py)
}

/// A phy2log table `[L, P]` → a checked core `Placement`.
pub fn placement(phy2log: &PyReadonlyArray2<'_, i32>, num_experts: usize, slots_per_rank: usize) -> PyResult<Placement> {
    let l = phy2log.shape()[0];
    Placement::from_slice(slice(phy2log, "placement.phy2log")?, l, num_experts, slots_per_rank).map_err(to_py)
}

/// A `routepack.Plan` → the core's `Plan`: the one extractor of a plan's arrays, for every
/// binding that reads a plan (`simulate`, `validate_plan`, `rank_tokens`, the replication
/// planners, `layout_proxy_cost`). It reads the tuple `Plan._to_core()` builds on the Python side:
/// `(phy2log [L, P] i32, num_experts, slots_per_rank, sample_rank [S] i32, sample_micro [S] i32,
///   num_micro, replica columns (micro, group, layer, expert, src_rank, dst_rank: i32, share: f32),
///   migration columns (layer, expert, src_rank, dst_rank, src_slot, dst_slot: i32, bytes: f64))`.
pub fn plan(obj: &Bound<'_, PyAny>) -> PyResult<Plan> {
    let t = obj.call_method0("_to_core")?;
    let phy2log: PyReadonlyArray2<i32> = t.get_item(0)?.extract()?;
    let num_experts: usize = t.get_item(1)?.extract()?;
    let slots_per_rank: usize = t.get_item(2)?.extract()?;
    let sample_rank: PyReadonlyArray1<i32> = t.get_item(3)?.extract()?;
    let sample_micro: PyReadonlyArray1<i32> = t.get_item(4)?.extract()?;
    let num_micro: usize = t.get_item(5)?.extract()?;
    let rep = t.get_item(6)?;
    let mig = t.get_item(7)?;
    let (rep_ids, mig_ids) = (id_columns(&rep)?, id_columns(&mig)?);
    let rshare: PyReadonlyArray1<f32> = rep.get_item(6)?.extract()?;
    let mbytes: PyReadonlyArray1<f64> = mig.get_item(6)?.extract()?;
    let (r, rshare) = (id_slices(&rep_ids, "replicas")?, slice(&rshare, "replicas.share")?);
    let (m, mbytes) = (id_slices(&mig_ids, "migration")?, slice(&mbytes, "migration.bytes")?);
    check_lengths(&r, rshare.len(), "replicas")?;
    check_lengths(&m, mbytes.len(), "migration")?;
    // the plan's tables, copied fallibly (every binding that reads a plan holds this copy)
    let mut replicas = sizes::with_capacity("plan.replicas", "the plan's replicas", rshare.len()).map_err(to_py)?;
    replicas.extend((0..rshare.len()).map(|i| Replica {
        micro: r[0][i],
        group: r[1][i],
        layer: r[2][i],
        expert: r[3][i],
        src_rank: r[4][i],
        dst_rank: r[5][i],
        share: rshare[i],
    }));
    let mut migration = sizes::with_capacity("plan.migration", "the plan's migration", mbytes.len()).map_err(to_py)?;
    migration.extend((0..mbytes.len()).map(|i| ExpertMove {
        layer: m[0][i],
        expert: m[1][i],
        src_rank: m[2][i],
        dst_rank: m[3][i],
        src_slot: m[4][i],
        dst_slot: m[5][i],
        bytes: mbytes[i],
    }));
    let sample_rank = sizes::copied("sample_rank", "a copy of sample_rank", slice(&sample_rank, "sample_rank")?).map_err(to_py)?;
    let sample_micro = sizes::copied("sample_micro", "a copy of sample_micro", slice(&sample_micro, "sample_micro")?).map_err(to_py)?;
    Ok(Plan { placement: placement(&phy2log, num_experts, slots_per_rank)?, sample_rank, sample_micro, num_micro, replicas, migration })
}

/// The six int32 id columns of a plan table (replicas or migration), borrowed.
fn id_columns<'py>(table: &Bound<'py, PyAny>) -> PyResult<Vec<PyReadonlyArray1<'py, i32>>> {
    (0..6).map(|i| table.get_item(i)?.extract()).collect()
}

/// The columns' slices (C-contiguous, else an error naming the table).
fn id_slices<'a>(columns: &'a [PyReadonlyArray1<'_, i32>], table: &str) -> PyResult<Vec<&'a [i32]>> {
    columns.iter().map(|c| slice(c, table)).collect()
}

/// Every column of a plan table as long as its last (`n` entries), else an error naming it.
fn check_lengths(columns: &[&[i32]], n: usize, table: &str) -> PyResult<()> {
    match columns.iter().position(|c| c.len() != n) {
        Some(i) => Err(PyValueError::new_err(format!("{table}: column {i} has {} entries, the table has {n}", columns[i].len()))),
        None => Ok(()),
    }
}
