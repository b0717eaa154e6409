//! Bindings for placement tables and plan validation.

use numpy::{IntoPyArray, PyArray2, PyArray3, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;
use routepack_core::error::bad_plan;
use routepack_core::packing::cells::Oversize;
use routepack_core::placement::static_placement as core_static;
use routepack_core::validate::{validate_placement_tables, validate_plan_in as core_validate};

use crate::columns::{self, MigrationColumns};
use crate::convert;
use crate::errors::{run, to_py};

/// Megatron's default placement `[L, ep*slots_per_rank]` int32.
#[pyfunction]
pub fn static_placement<'py>(
    py: Python<'py>,
    num_layers: usize,
    num_experts: usize,
    topo: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let t = convert::topology(topo)?;
    let p = run(py, || core_static(num_layers, num_experts, &t))?;
    Ok(numpy::ndarray::Array2::from_shape_vec((p.num_layers, p.num_slots), p.phy2log).expect("shape").into_pyarray(py))
}

/// `(logcnt [L, E], log2phy [L, E, R])`.
type PlacementTables<'py> = (Bound<'py, PyArray2<i32>>, Bound<'py, PyArray3<i32>>);

/// `(logcnt [L, E], log2phy [L, E, R])` of a phy2log table; checks it on the way.
#[pyfunction]
pub fn placement_tables<'py>(
    py: Python<'py>,
    phy2log: PyReadonlyArray2<'py, i32>,
    num_experts: usize,
    slots_per_rank: usize,
) -> PyResult<PlacementTables<'py>> {
    let p = convert::placement(&phy2log, num_experts, slots_per_rank)?;
    let (l, e) = (p.num_layers, p.num_experts);
    let (cnt, (l2p, r)) = run(py, || Ok((p.logcnt(), p.log2phy()?)))?;
    Ok((
        numpy::ndarray::Array2::from_shape_vec((l, e), cnt).expect("shape").into_pyarray(py),
        numpy::ndarray::Array3::from_shape_vec((l, e, r), l2p).expect("shape").into_pyarray(py),
    ))
}

/// Raises `InvalidPlanError` with the first broken invariant. Where the plan's placement
/// carries `logcnt` / `log2phy` (tables derived from `phy2log`, which can be edited apart from
/// it), they must be what `phy2log` gives. `oversize` "alone": a cell over the cap may hold
/// one sample (default "refuse": none may).
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, token_cap, oversize=None))]
pub fn validate_plan<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    token_cap: i64,
    oversize: Option<&str>,
) -> PyResult<()> {
    let oversize = oversize.map(Oversize::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let tables = derived_tables(&plan.getattr("placement")?)?;
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    run(py, || {
        core_validate(&plan, &w, &t, token_cap, oversize)?;
        check_tables(&plan, &tables)
    })
}

/// The derived tables of a plan's Python placement, read before the GIL is released
/// (`derived_tables`), checked after the plan's own invariants (`check_tables`): `validate_plan`
/// and `simulate` both call them, so an edited `logcnt` / `log2phy` is refused by either.
pub(crate) fn plan_tables(plan: &Bound<'_, PyAny>) -> PyResult<Option<DerivedTables>> {
    derived_tables(&plan.getattr("placement")?)
}

/// See [`plan_tables`].
pub(crate) fn check_tables(plan: &routepack_core::plan::Plan, tables: &Option<DerivedTables>) -> routepack_core::error::Result<()> {
    match tables {
        Some((cnt, l2p, r)) => validate_placement_tables(&plan.placement, cnt, l2p, *r),
        None => Ok(()),
    }
}

/// `(logcnt [L·E], log2phy [L·E·R], R)`, copied from a Python placement.
pub(crate) type DerivedTables = (Vec<i32>, Vec<i32>, usize);

/// The derived tables of a Python placement when it has both attributes; an attribute of
/// another type or shape is an `InvalidPlanError` naming it.
fn derived_tables(placement: &Bound<'_, PyAny>) -> PyResult<Option<DerivedTables>> {
    if !placement.hasattr("logcnt")? || !placement.hasattr("log2phy")? {
        return Ok(None);
    }
    let wrong = |name: &str, want: &str| to_py(bad_plan(format!("placement.{name}: expected a C-contiguous int32 {want} array")));
    let cnt: PyReadonlyArray2<i32> = placement.getattr("logcnt")?.extract().map_err(|_| wrong("logcnt", "[L, E]"))?;
    let l2p: PyReadonlyArray3<i32> = placement.getattr("log2phy")?.extract().map_err(|_| wrong("log2phy", "[L, E, R]"))?;
    let r = l2p.shape()[2];
    let cnt = cnt.as_slice().map_err(|_| wrong("logcnt", "[L, E]"))?.to_vec();
    let l2p = l2p.as_slice().map_err(|_| wrong("log2phy", "[L, E, R]"))?.to_vec();
    Ok(Some((cnt, l2p, r)))
}

/// Moves from `previous` to `next` as migration columns
/// `(layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)`; `ranks_per_node` (EP
/// ranks per node) lets sources on the destination's node be preferred. None: the core's
/// `migration::diff`, where every rank counts as its own node.
#[pyfunction]
#[pyo3(signature = (previous, next, num_experts, slots_per_rank, bytes_per_expert, ranks_per_node=None))]
pub fn migration_diff<'py>(
    py: Python<'py>,
    previous: PyReadonlyArray2<'py, i32>,
    next: PyReadonlyArray2<'py, i32>,
    num_experts: usize,
    slots_per_rank: usize,
    bytes_per_expert: f64,
    ranks_per_node: Option<usize>,
) -> PyResult<MigrationColumns<'py>> {
    let a = convert::placement(&previous, num_experts, slots_per_rank)?;
    let b = convert::placement(&next, num_experts, slots_per_rank)?;
    let moves = run(py, || match ranks_per_node {
        Some(n) => routepack_core::migration::diff_nodes(&a, &b, n, bytes_per_expert),
        None => routepack_core::migration::diff(&a, &b, bytes_per_expert),
    })?;
    Ok(columns::migration_columns(py, &moves))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(static_placement, m)?)?;
    m.add_function(wrap_pyfunction!(placement_tables, m)?)?;
    m.add_function(wrap_pyfunction!(validate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(migration_diff, m)?)?;
    Ok(())
}
