//! Bindings for packing: samples → (rank, microbatch) cells.

use numpy::{IntoPyArray, PyArray1, PyArray3, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use routepack_core::error::invalid;
use routepack_core::layout::order as layout_order;
use routepack_core::packing::cells::{Cells, Oversize};
use routepack_core::packing::kk::verl_kk_in;
use routepack_core::packing::routepack::{proxy_step_time, routepack_packing_in};
use routepack_core::packing::rows::certified::certified_rows;
use routepack_core::packing::sequential::sequential_in;
use routepack_core::packing::Packing;
use routepack_core::split::Pieces;
use routepack_core::topology::{MicroRule, DEFAULT_CP};

use crate::convert::{self, slice};
use crate::errors::{run, to_py};
use crate::py_options::{self, AnnealArgs};

type CellsReport<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>, usize, Bound<'py, PyDict>);

/// The cells a baseline packing fills: `dp` ranks, microbatch counts of at least `min_micro`
/// and in multiples of `micro_multiple` (a pipeline's rule; None: 1), `oversize` ("refuse",
/// None, "alone" or "split") and CP groups of `cp` ranks (None: 1, what "split" splits over).
fn cells(dp: usize, min_micro: Option<usize>, micro_multiple: Option<usize>, oversize: Option<&str>, cp: Option<usize>) -> PyResult<Cells> {
    let rule = MicroRule { min: min_micro.unwrap_or(1), multiple: micro_multiple.unwrap_or(1) };
    if rule.min == 0 || rule.multiple == 0 {
        return Err(to_py(invalid("min_micro", format!("min_micro = {} and micro_multiple = {} must be >= 1", rule.min, rule.multiple))));
    }
    let oversize = oversize.map(Oversize::parse).transpose().map_err(to_py)?.unwrap_or_default();
    Ok(Cells { dp, rule, oversize, cp: cp.unwrap_or(DEFAULT_CP) })
}

/// Arrival-order first fit: `(sample_rank [S], sample_micro [S], num_micro, report)`, the
/// report `{rows, fallback}` (fallback: first fit could not fill the cells, so the certified
/// rows were laid out). `min_micro`, `micro_multiple`: a pipeline's microbatch rule;
/// `oversize`: "alone" runs a sample over the cap in a row of its own, "split" splits it over
/// a context-parallel group of `cp` ranks (default: refused).
#[pyfunction]
#[pyo3(signature = (seq_lens, token_cap, dp, min_micro=None, micro_multiple=None, oversize=None, cp=None))]
#[allow(clippy::too_many_arguments)]
pub fn pack_sequential<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    token_cap: i64,
    dp: usize,
    min_micro: Option<usize>,
    micro_multiple: Option<usize>,
    oversize: Option<&str>,
    cp: Option<usize>,
) -> PyResult<CellsReport<'py>> {
    let lens = slice(&seq_lens, "seq_lens")?;
    let c = cells(dp, min_micro, micro_multiple, oversize, cp)?;
    let (p, r) = run(py, || sequential_in(lens, token_cap, &c))?;
    let d = PyDict::new(py);
    d.set_item("rows", r.rows)?;
    d.set_item("fallback", r.fallback)?;
    Ok((p.sample_rank.into_pyarray(py), p.sample_micro.into_pyarray(py), p.num_micro, d))
}

/// verl's Karmarkar–Karp balancing: `(sample_rank [S], sample_micro [S], num_micro, report)`;
/// `min_micro`, `micro_multiple`, `oversize`, `cp` as `pack_sequential`'s.
#[pyfunction]
#[pyo3(signature = (seq_lens, token_cap, dp, min_micro=None, micro_multiple=None, oversize=None, cp=None))]
#[allow(clippy::too_many_arguments)]
pub fn pack_kk<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    token_cap: i64,
    dp: usize,
    min_micro: Option<usize>,
    micro_multiple: Option<usize>,
    oversize: Option<&str>,
    cp: Option<usize>,
) -> PyResult<CellsReport<'py>> {
    let lens = slice(&seq_lens, "seq_lens")?;
    let c = cells(dp, min_micro, micro_multiple, oversize, cp)?;
    let (p, r) = run(py, || verl_kk_in(lens, token_cap, &c))?;
    let d = PyDict::new(py);
    d.set_item("rows", p.num_micro * dp)?;
    d.set_item("micro", r.micro)?;
    d.set_item("first_micro", r.first_micro)?;
    d.set_item("overflow_retries", r.retries)?;
    d.set_item("max_row_tokens", r.max_row_tokens)?;
    d.set_item("fallback", r.fallback)?;
    Ok((p.sample_rank.into_pyarray(py), p.sample_micro.into_pyarray(py), p.num_micro, d))
}

/// The fewest rows in multiples of `step` with their certificate (no layout): a dict with
/// rows, bins, l1, l2, lower_bound, certified, gap, method, nodes. `node_limit` bounds the
/// exact search (None: the packing stage's `exact_nodes` default).
#[pyfunction]
#[pyo3(signature = (seq_lens, token_cap, step, node_limit=None))]
pub fn pack_rows<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    token_cap: i64,
    step: usize,
    node_limit: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let lens = slice(&seq_lens, "seq_lens")?;
    let node_limit = py_options::exact_nodes(node_limit);
    let c = run(py, || certified_rows(lens, token_cap, step, node_limit, None))?;
    let d = PyDict::new(py);
    d.set_item("rows", c.rows.len())?;
    d.set_item("bins", c.certificate.bins)?;
    d.set_item("l1", c.certificate.l1)?;
    d.set_item("l2", c.certificate.l2)?;
    d.set_item("lower_bound", c.certificate.lower_bound)?;
    d.set_item("certified", c.certificate.certified)?;
    d.set_item("gap", c.certificate.gap)?;
    d.set_item("method", c.certificate.method)?;
    d.set_item("nodes", c.certificate.nodes)?;
    Ok(d)
}

/// routepack's packing: certified rows, then the layout by population annealing.
/// Returns `(sample_rank [S], sample_micro [S], num_micro, report)`. The microbatch count meets
/// `topo`'s pipeline rule; `oversize` as `pack_sequential`'s (split over `topo.cp`). Every option left None
/// takes the core's default (`packing::routepack::Options::default()`, parsed by
/// `py_options::packing`); `time_budget_s`: a wall-clock cap
/// of the stage in seconds (None or above `budget::UNLIMITED_S`: none; 0: the least search;
/// negative or not finite: an error).
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, topo, cost, phy2log, token_cap, seed=None, anneal_moves=None,
    time_budget_s=None, chains=None, steps=None, exact_nodes=None, lambda_=None, start_accept=None, cooling=None,
    mix=None, oversize=None))]
#[allow(clippy::too_many_arguments)]
pub fn pack_routepack<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    phy2log: PyReadonlyArray2<'py, i32>,
    token_cap: i64,
    seed: Option<u64>,
    anneal_moves: Option<u64>,
    time_budget_s: Option<f64>,
    chains: Option<usize>,
    steps: Option<usize>,
    exact_nodes: Option<u64>,
    lambda_: Option<f64>,
    start_accept: Option<f64>,
    cooling: Option<f64>,
    mix: Option<(f64, f64, f64, f64)>,
    oversize: Option<&str>,
) -> PyResult<CellsReport<'py>> {
    let oversize = oversize.map(Oversize::parse).transpose().map_err(to_py)?.unwrap_or_default();
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = py_options::cost(cost)?;
    let pl = convert::placement(&phy2log, w.num_experts, t.slots_per_rank)?;
    let anneal = AnnealArgs { seed, moves: anneal_moves, chains, steps, start_accept, cooling, mix };
    let opts = py_options::packing(&t, anneal, exact_nodes, lambda_, time_budget_s)?;
    let (p, r) = run(py, || routepack_packing_in(&w, &t, &c, &pl, token_cap, &opts, oversize))?;
    let d = PyDict::new(py);
    let rows = &r.rows;
    d.set_item("rows", rows.num_rows)?;
    d.set_item("micro", rows.micro)?;
    let lb = PyDict::new(py);
    lb.set_item("L1", rows.certificate.l1)?;
    lb.set_item("L2", rows.certificate.l2)?;
    lb.set_item("rows", rows.certificate.lower_bound)?;
    d.set_item("rows_lower_bound", lb)?;
    d.set_item("certified", rows.certificate.certified)?;
    d.set_item("gap", rows.certificate.gap)?;
    d.set_item("rows_method", rows.certificate.method)?;
    d.set_item("bins", rows.certificate.bins)?;
    d.set_item("exact_nodes", rows.certificate.nodes)?;
    d.set_item("layout_init", r.init)?;
    let a = &r.anneal;
    d.set_item("initial_cost", a.initial_cost)?;
    d.set_item("annealed_cost", a.best_cost)?;
    d.set_item("initial_energy", a.initial_energy)?;
    d.set_item("annealed_energy", a.best_energy)?;
    d.set_item("start_temperature", a.start_temperature)?;
    d.set_item("moves", a.moves_done)?;
    d.set_item("moves_evaluated", a.evaluated)?;
    d.set_item("moves_accepted", a.accepted)?;
    d.set_item("chains", a.chains)?;
    d.set_item("steps", a.steps)?;
    d.set_item("stopped_by_time", a.stopped_by_time)?;
    let h = PyDict::new(py);
    h.set_item("temperature", a.history.iter().map(|x| x.temperature).collect::<Vec<_>>())?;
    h.set_item("best_cost", a.history.iter().map(|x| x.best_cost).collect::<Vec<_>>())?;
    h.set_item("best_energy", a.history.iter().map(|x| x.best_energy).collect::<Vec<_>>())?;
    h.set_item("mean_energy", a.history.iter().map(|x| x.mean_energy).collect::<Vec<_>>())?;
    h.set_item("accept_rate", a.history.iter().map(|x| x.accept_rate).collect::<Vec<_>>())?;
    h.set_item("moves", a.history.iter().map(|x| x.moves).collect::<Vec<_>>())?;
    d.set_item("anneal_history", h)?;
    let t = PyDict::new(py);
    for (k, v) in ["rows", "proxy", "init", "anneal"].iter().zip(r.seconds) {
        t.set_item(k, v)?;
    }
    d.set_item("seconds", t)?;
    Ok((p.sample_rank.into_pyarray(py), p.sample_micro.into_pyarray(py), p.num_micro, d))
}

/// Each EP group's microbatches reordered to shorten its pipeline under `topo`
/// (`layout::order::order_microbatches`): `(sample_micro [S], report {before, after, evaluations,
/// groups_reordered})`; the layout itself without a pipeline. `evaluations`: the search's
/// budget per group (None: the core's default).
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, topo, cost, phy2log, sample_rank, sample_micro, num_micro, evaluations=None))]
#[allow(clippy::too_many_arguments)]
pub fn order_microbatches<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
    phy2log: PyReadonlyArray2<'py, i32>,
    sample_rank: PyReadonlyArray1<'py, i32>,
    sample_micro: PyReadonlyArray1<'py, i32>,
    num_micro: usize,
    evaluations: Option<usize>,
) -> PyResult<(Bound<'py, PyArray1<i32>>, Bound<'py, PyDict>)> {
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = py_options::cost(cost)?;
    let pl = convert::placement(&phy2log, w.num_experts, t.slots_per_rank)?;
    let p = Packing {
        sample_rank: slice(&sample_rank, "sample_rank")?.to_vec(),
        sample_micro: slice(&sample_micro, "sample_micro")?.to_vec(),
        num_micro,
    };
    let budget = evaluations.unwrap_or(layout_order::DEFAULT_EVALUATIONS);
    let (out, r) = run(py, || {
        proxy_step_time(&w, &t, &c, &pl, &p)?; // the layout checked against the window and topology
        layout_order::order_microbatches(&w, &t, &c, &pl, &p.sample_rank, &p.sample_micro, num_micro, budget)
    })?;
    let d = PyDict::new(py);
    d.set_item("before", r.before)?;
    d.set_item("after", r.after)?;
    d.set_item("evaluations", r.evaluations)?;
    d.set_item("groups_reordered", r.groups_reordered)?;
    Ok((out.into_pyarray(py), d))
}

/// The layout proxy's step time (max over EP groups of the accumulated cost) of a plan's
/// placement and layout (its replicas and migration are not read), to compare with `simulate`.
#[pyfunction]
pub fn layout_proxy_cost<'py>(
    py: Python<'py>,
    plan: &Bound<'py, PyAny>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    topo: &Bound<'py, PyAny>,
    cost: &Bound<'py, PyAny>,
) -> PyResult<f64> {
    let plan = convert::plan(plan)?;
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let t = convert::topology(topo)?;
    let c = py_options::cost(cost)?;
    let p = Packing { sample_rank: plan.sample_rank, sample_micro: plan.sample_micro, num_micro: plan.num_micro };
    run(py, || proxy_step_time(&w, &t, &c, &plan.placement, &p))
}

/// The pieces of a window whose samples over `token_cap` are split over CP groups of `cp`
/// ranks (`routepack_core::split`): `(seq_lens [S'], expert_tokens [S', L, E] int32,
/// sample_rank [S'], sample_micro [S'])`, each piece where a plan's `sample_rank`,
/// `sample_micro` `[S]` put it (piece j of a split sample on its rank + j).
#[pyfunction]
#[pyo3(signature = (seq_lens, expert_tokens, token_cap, cp, sample_rank, sample_micro))]
#[allow(clippy::type_complexity)]
pub fn split_pieces<'py>(
    py: Python<'py>,
    seq_lens: PyReadonlyArray1<'py, i64>,
    expert_tokens: convert::CountsArray<'py>,
    token_cap: i64,
    cp: usize,
    sample_rank: PyReadonlyArray1<'py, i32>,
    sample_micro: PyReadonlyArray1<'py, i32>,
) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray3<i32>>, Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>)> {
    let w = convert::window(&seq_lens, &expert_tokens)?;
    let (rank, micro) = (slice(&sample_rank, "sample_rank")?, slice(&sample_micro, "sample_micro")?);
    if rank.len() != w.num_samples || micro.len() != w.num_samples {
        let msg =
            format!("sample_rank has {} and sample_micro {} entries; the window has {} samples", rank.len(), micro.len(), w.num_samples);
        return Err(to_py(invalid("sample_rank", msg)));
    }
    let (p, counts, (r, m)) = run(py, || {
        let p = Pieces::new(w.seq_lens, token_cap, cp)?;
        let counts = p.counts(&w)?;
        let rm = p.expand(rank, micro);
        Ok((p, counts, rm))
    })?;
    let shape = (p.lens.len(), w.num_layers, w.num_experts);
    let counts = numpy::ndarray::Array3::from_shape_vec(shape, counts).expect("shape").into_pyarray(py);
    Ok((p.lens.into_pyarray(py), counts, r.into_pyarray(py), m.into_pyarray(py)))
}

/// Megatron's microbatch rule for `pp` pipeline stages of `vpp` model chunks each
/// (`topology::MicroRule::of_pipeline`): `(min, multiple)`, the fewest microbatches per DP rank
/// and the multiple they come in; `(1, 1)` without a pipeline.
#[pyfunction]
pub fn micro_rule(pp: usize, vpp: usize) -> PyResult<(usize, usize)> {
    let r = pipeline_rule(pp, vpp)?;
    Ok((r.min, r.multiple))
}

/// The fewest microbatches per DP rank any plan of `total_tokens` tokens in rows of at most
/// `token_cap` tokens on `dp` ranks can run under the rule of `pp` stages of `vpp` chunks
/// (`topology::MicroRule::fewest`): ⌈⌈total / cap⌉ / dp⌉, at least 1, raised to the rule.
#[pyfunction]
#[pyo3(signature = (total_tokens, token_cap, dp, pp=1, vpp=1))]
pub fn lower_bound_micro(total_tokens: u64, token_cap: u64, dp: usize, pp: usize, vpp: usize) -> PyResult<usize> {
    if token_cap == 0 || dp == 0 {
        return Err(to_py(invalid("token_cap", format!("token_cap = {token_cap} and dp = {dp} must be >= 1"))));
    }
    Ok(pipeline_rule(pp, vpp)?.fewest(total_tokens, token_cap, dp))
}

/// `MicroRule::of_pipeline(pp, vpp)`, the counts checked (>= 1) first.
fn pipeline_rule(pp: usize, vpp: usize) -> PyResult<MicroRule> {
    if pp == 0 || vpp == 0 {
        return Err(to_py(invalid("topo.pp", format!("pp = {pp} and vpp = {vpp} must be >= 1"))));
    }
    Ok(MicroRule::of_pipeline(pp, vpp))
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(pack_sequential, m)?)?;
    m.add_function(wrap_pyfunction!(split_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(pack_kk, m)?)?;
    m.add_function(wrap_pyfunction!(pack_rows, m)?)?;
    m.add_function(wrap_pyfunction!(pack_routepack, m)?)?;
    m.add_function(wrap_pyfunction!(layout_proxy_cost, m)?)?;
    m.add_function(wrap_pyfunction!(order_microbatches, m)?)?;
    m.add_function(wrap_pyfunction!(micro_rule, m)?)?;
    m.add_function(wrap_pyfunction!(lower_bound_micro, m)?)?;
    Ok(())
}
