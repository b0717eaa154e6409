//! Bindings for token routing under a plan (`routepack-core/src/flow/`): the flow table of
//! one exchange (EP group, microbatch, layer), and the per-rank loads of a whole plan. The torch remapper builds its dispatch
//! from the first and is checked against the second.

use numpy::{IntoPyArray, PyArray1, PyArray4, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use routepack_core::error::invalid;
use routepack_core::flow::{check_exchange, rank_tokens as core_rank_tokens, route_exchange, Dest, ExchangeReplica};
use routepack_core::Placement;

use crate::convert::{self, slice};
use crate::errors::{run, to_py};

/// `(origin_rank, dst_rank, dst_slot or -1, replica or -1, expert, count)`.
pub type FlowColumns<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i64>>,
);

/// Flow table of one exchange (EP group, microbatch, layer) as columns
/// `(origin_rank, dst_rank, dst_slot or -1, replica or -1, expert, count)`.
///
/// * `origin` int64 `[ep, E]`: tokens of expert e from EP-local rank r.
/// * `phy2log` int32 `[ep*slots_per_rank]`: the layer's placement row.
/// * `rep_expert`, `rep_dst` int32 `[n]`, `rep_share` float32 `[n]`: the exchange's replicas
///   in table order; the `replica` column indexes them.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn route_cell<'py>(
    py: Python<'py>,
    origin: PyReadonlyArray2<'py, i64>,
    phy2log: PyReadonlyArray1<'py, i32>,
    topo: &Bound<'py, PyAny>,
    rep_expert: PyReadonlyArray1<'py, i32>,
    rep_dst: PyReadonlyArray1<'py, i32>,
    rep_share: PyReadonlyArray1<'py, f32>,
) -> PyResult<FlowColumns<'py>> {
    let t = convert::topology(topo)?;
    let sh = origin.shape().to_vec();
    if sh[0] != t.ep {
        return Err(to_py(invalid("origin", format!("has {} rows, expected ep={}", sh[0], t.ep))));
    }
    let e_n = sh[1];
    let row = slice(&phy2log, "phy2log")?;
    if row.len() != t.num_slots() {
        return Err(to_py(invalid("phy2log", format!("has {} slots, expected ep*slots_per_rank = {}", row.len(), t.num_slots()))));
    }
    let (re, rd, rs) = (slice(&rep_expert, "rep_expert")?, slice(&rep_dst, "rep_dst")?, slice(&rep_share, "rep_share")?);
    if rd.len() != re.len() || rs.len() != re.len() {
        return Err(to_py(invalid(
            "replicas",
            format!("columns differ in length: expert {}, dst {}, share {}", re.len(), rd.len(), rs.len()),
        )));
    }
    if let Some(i) = (0..re.len()).find(|&i| re[i] < 0 || rd[i] < 0) {
        return Err(to_py(invalid("replicas", format!("row {i}: negative expert {} or dst_rank {}", re[i], rd[i]))));
    }
    let reps: Vec<ExchangeReplica> = (0..re.len()).map(|i| (re[i] as usize, rd[i] as usize, rs[i])).collect();
    let origin = slice(&origin, "origin")?;
    let row = row.to_vec();
    let flows = run(py, || {
        let p = Placement::new(row, 1, e_n, t.slots_per_rank)?;
        let (so, sl) = p.replicas_of_layer(0);
        check_exchange(origin, e_n, &so, &reps, &t)?;
        let mut flows = Vec::new();
        route_exchange(origin, e_n, &so, &sl, &reps, &t, &mut flows);
        Ok(flows)
    })?;
    let col = |f: &dyn Fn(&routepack_core::flow::Flow) -> i32| flows.iter().map(f).collect::<Vec<i32>>().into_pyarray(py);
    Ok((
        col(&|f| f.origin as i32),
        col(&|f| f.dst_rank as i32),
        col(&|f| if let Dest::Slot(p) = f.dest { p as i32 } else { -1 }),
        col(&|f| if let Dest::Replica { index, .. } = f.dest { index as i32 } else { -1 }),
        col(&|f| f.expert as i32),
        flows.iter().map(|f| f.count).collect::<Vec<i64>>().into_pyarray(py),
    ))
}

/// int64 `[G, M, L, ep]`: tokens every EP rank receives under `plan` (what the simulator
/// prices as `tokens(p)`).
#[pyfunction]
pub fn rank_tokens<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray4<i64>>> {
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let v = run(py, || core_rank_tokens(&plan, &w, &t))?;
    let shape = (t.num_groups(), plan.num_micro, w.num_layers, t.ep);
    Ok(numpy::ndarray::Array4::from_shape_vec(shape, v).expect("shape").into_pyarray(py))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(route_cell, m)?)?;
    m.add_function(wrap_pyfunction!(rank_tokens, m)?)?;
    Ok(())
}
