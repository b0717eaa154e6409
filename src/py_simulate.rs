//! Binding for the simulator.

use numpy::ndarray::{Array3, Array4};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use routepack_core::error::invalid;
use routepack_core::packing::cells::Oversize;
use routepack_core::plan::ReplicaTiming;
use routepack_core::simulate::pipeline::{run_makespan, OpTimes, Pipeline, RunKind};
use routepack_core::simulate::{simulate_in, simulate_terms as simulate_terms_in, ExchangeTerms, Scoring, SimReport};

use crate::convert::{self, slice};
use crate::errors::{run, to_py};
use crate::py_plan::{check_tables, plan_tables};

/// docs/design.md's cost model → dict with the fields of `routepack.SimResult`. `token_cap`: the
/// cap the lower bound assumes (None: no cap). `plan_cap`: first validate the plan against
/// this cap as `validate_plan` does (None: well-formedness only, no cap), with `oversize` as
/// `validate_plan`'s. `replica_timing`: `Plan.replica_timing` ("prefetch", the default, or
/// "after_router": the copies' forward weights are exposed, `plan::ReplicaTiming`). `step_only`:
/// the step time and its parts only (`lower_bound_time`, `ideal_time` NaN; `Scoring::step_only`).
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, ideal_micro=None, token_cap=None, plan_cap=None, oversize=None, replica_timing=None, step_only=false))]
#[allow(clippy::too_many_arguments)]
pub fn simulate<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    plan_cap: Option<i64>,
    oversize: Option<&str>,
    replica_timing: Option<&str>,
    step_only: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let oversize = oversize.map(Oversize::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let timing = replica_timing.map(ReplicaTiming::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let tables = plan_tables(plan)?;
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = crate::py_options::cost(cost)?;
    let r = run(py, || {
        // simulate validates the plan first, so its own faults are named before the tables'
        let r = simulate_in(&plan, &w, &t, &c, &Scoring { ideal_micro, token_cap, plan_cap, oversize, timing, step_only })?;
        check_tables(&plan, &tables)?;
        Ok(r)
    })?;
    report_dict(py, r, (t.num_groups(), plan.num_micro, w.num_layers))
}

/// `simulate` and each exchange's parts per rank (`simulate::ExchangeTerms`), what
/// `routepack.timeline` draws a step per rank from: `(report, terms)`, the report `simulate`'s
/// dict; `terms` float64 arrays `attention_rank`, `expert_rank` `[G, M, L, ep]` (each EP rank's
/// attention and expert seconds, all passes), `attention`, `expert`, `all_to_all`, `hidden`,
/// `replication`, `replica_forward`, `replica_backward` `[G, M, L]` (each exchange's parts,
/// `LayerCost`'s), and int64 `layer_stage` `[L]` (the pipeline stage holding each layer).
#[pyfunction]
#[pyo3(signature = (plan, seq_lens, expert_tokens, topo, cost, ideal_micro=None, token_cap=None, oversize=None, replica_timing=None))]
#[allow(clippy::too_many_arguments)]
pub fn simulate_terms<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    oversize: Option<&str>,
    replica_timing: Option<&str>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let oversize = oversize.map(Oversize::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let timing = replica_timing.map(ReplicaTiming::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = crate::py_options::cost(cost)?;
    let scoring = Scoring { ideal_micro, token_cap, plan_cap: None, oversize, timing, step_only: false };
    let (r, x, stages) = run(py, || {
        let (r, x) = simulate_terms_in(&plan, &w, &t, &c, &scoring)?;
        let pipe = Pipeline::new(&t, &c, w.num_layers)?;
        let stages: Vec<i64> = (0..w.num_layers).map(|l| pipe.stage_of_layer(l) as i64).collect();
        Ok((r, x, stages))
    })?;
    let report = report_dict(py, r, (t.num_groups(), plan.num_micro, w.num_layers))?;
    Ok((report, terms_dict(py, x, stages)?))
}

/// `ExchangeTerms` as `simulate_terms`' dict of arrays.
fn terms_dict(py: Python<'_>, x: ExchangeTerms, stages: Vec<i64>) -> PyResult<Bound<'_, PyDict>> {
    let (g, m, l, ep) = x.shape;
    let d = PyDict::new(py);
    let per_rank = |v: Vec<f64>| Array4::from_shape_vec((g, m, l, ep), v).expect("shape");
    d.set_item("attention_rank", per_rank(x.attention).into_pyarray(py))?;
    d.set_item("expert_rank", per_rank(x.expert).into_pyarray(py))?;
    let per_exchange = |f: &dyn Fn(usize) -> f64| Array3::from_shape_fn((g, m, l), |(a, b, c)| f((a * m + b) * l + c));
    d.set_item("attention", per_exchange(&|i| x.layer[i].attention).into_pyarray(py))?;
    d.set_item("expert", per_exchange(&|i| x.layer[i].expert).into_pyarray(py))?;
    d.set_item("all_to_all", per_exchange(&|i| x.layer[i].all_to_all).into_pyarray(py))?;
    d.set_item("hidden", per_exchange(&|i| x.layer[i].hidden).into_pyarray(py))?;
    d.set_item("replication", per_exchange(&|i| x.layer[i].replication).into_pyarray(py))?;
    d.set_item("replica_forward", per_exchange(&|i| x.replication_parts[i].0).into_pyarray(py))?;
    d.set_item("replica_backward", per_exchange(&|i| x.replication_parts[i].1).into_pyarray(py))?;
    d.set_item("layer_stage", stages.into_pyarray(py))?;
    Ok(d)
}

/// A `SimReport` as the dict of `routepack.SimResult`'s fields; `shape` (G, M, L) of its imbalance.
fn report_dict(py: Python<'_>, r: SimReport, shape: (usize, usize, usize)) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step_time", r.step_time)?;
    d.set_item("ideal_time", r.ideal_time)?;
    d.set_item("lower_bound_time", r.lower_bound_time)?;
    d.set_item("throughput", r.throughput)?;
    d.set_item("ideal_throughput", r.ideal_throughput)?;
    d.set_item("attention", r.attention)?;
    d.set_item("expert", r.expert)?;
    d.set_item("all_to_all", r.all_to_all)?;
    d.set_item("hidden", r.hidden)?;
    d.set_item("replication", r.replication)?;
    d.set_item("migration", r.migration)?;
    d.set_item("redundant_grads", r.redundant_grads)?;
    d.set_item("pipeline_bubble", r.pipeline_bubble)?;
    d.set_item("critical_group", r.critical_group)?;
    d.set_item("group_times", r.group_times.into_pyarray(py))?;
    let imb = Array3::from_shape_vec(shape, r.imbalance).expect("shape");
    d.set_item("imbalance", imb.into_pyarray(py))?;
    d.set_item("mean_imbalance", r.mean_imbalance)?;
    d.set_item("intra_node_bytes", r.intra_node_bytes)?;
    d.set_item("cross_node_bytes", r.cross_node_bytes)?;
    d.set_item("cross_node_bytes_per_token", r.cross_node_bytes_per_token)?;
    Ok(d)
}

/// One run of the pipeline schedule the simulator prices (`simulate::pipeline`), on given
/// operation times: `(makespan, busy [pp])`. `kind`: "1f1b", "forward" or "backward"; `fwd`,
/// `bwd` `[M, pp·vpp]` seconds of each (microbatch, model chunk); `p2p` `[M, pp·vpp − 1]` of
/// one send across the boundary after each chunk. What the independent pipeline simulator of
/// the tests is checked against.
#[pyfunction]
pub fn pipeline_makespan<'py>(
    py: Python<'py>,
    pp: usize,
    vpp: usize,
    kind: &str,
    fwd: PyReadonlyArray2<'py, f64>,
    bwd: PyReadonlyArray2<'py, f64>,
    p2p: PyReadonlyArray2<'py, f64>,
) -> PyResult<(f64, Bound<'py, PyArray1<f64>>)> {
    let kind = match kind {
        "1f1b" => RunKind::OneFOneB,
        "forward" => RunKind::Forward,
        "backward" => RunKind::Backward,
        _ => return Err(to_py(invalid("kind", format!("{kind:?} is not one of \"1f1b\", \"forward\", \"backward\"")))),
    };
    if pp == 0 || vpp == 0 || (vpp > 1 && pp < 2) {
        return Err(to_py(invalid("pp", format!("pp = {pp}, vpp = {vpp}: need pp >= 1, vpp >= 1 and pp >= 2 where vpp > 1"))));
    }
    let (m, c) = (fwd.shape()[0], fwd.shape()[1]);
    if c != pp * vpp || bwd.shape() != fwd.shape() || p2p.shape() != [m, c - 1] {
        return Err(to_py(invalid(
            "fwd",
            format!(
                "fwd {:?}, bwd {:?}, p2p {:?}: expected [M, pp*vpp = {}] twice and [M, pp*vpp - 1]",
                fwd.shape(),
                bwd.shape(),
                p2p.shape(),
                pp * vpp
            ),
        )));
    }
    let (f, b, s) = (slice(&fwd, "fwd")?, slice(&bwd, "bwd")?, slice(&p2p, "p2p")?);
    let mut busy = vec![0.0; pp];
    let t = run(py, || run_makespan(pp, vpp, m, kind, &OpTimes { fwd: f, bwd: b, p2p: s }, &mut busy))?;
    Ok((t, busy.into_pyarray(py)))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulate_terms, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline_makespan, m)?)?;
    Ok(())
}
