//! Every option the bindings read, parsed in one place, and the defaults Python reads from
//! the same place (`defaults()`, `cost_defaults()`): the cost model from a
//! `routepack.CostModel` (its fields listed once, in `cost_fields!`), and each stage's options
//! struct from a binding's arguments, an argument left None taking the core's `Default`. No
//! default is written here: they are the core's `Default` impls and constants.
//!
//! Adding a cost model option: the core's `CostModel` field (its default in
//! `CostModel::default()`), its name in `cost_fields!` below, and the Python class.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use routepack_core::budget;
use routepack_core::cost::{Overlap, Pass};
use routepack_core::layout::chain::MoveMix;
use routepack_core::packing::routepack::{default_moves, Options as PackingOptions, DEFAULT_MOVES, DEFAULT_MOVES_ACROSS_NODES};
use routepack_core::placement::demand::DEFAULT_CHUNKS;
use routepack_core::placement::routepack::{Options as PlacementOptions, DEFAULT_EXPLORE};
use routepack_core::replication::hot_n::DEFAULT_HOT_EXPERTS;
use routepack_core::replication::routepack::Options as ReplicationOptions;
use routepack_core::topology::{DEFAULT_CP, DEFAULT_PP, DEFAULT_REPLICA_SLOTS, DEFAULT_VPP};
use routepack_core::{CostModel, Topology};

use crate::convert::attr;
use crate::errors::to_py;

/// One field of the cost model as Python holds it: read from the `routepack.CostModel`
/// attribute of its name (an error names the attribute), and reported in the same form.
trait CostField: Sized {
    /// The attribute `name` of `obj`.
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self>;
    /// The value as Python holds it.
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>>;
}

impl CostField for f64 {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        attr(obj, name)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
}

impl CostField for bool {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        attr(obj, name)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.into_pyobject(py)?.to_owned().into_any())
    }
}

impl CostField for Vec<f64> {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        attr(obj, name)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.into_pyobject(py)
    }
}

impl CostField for Vec<(f64, f64)> {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        attr(obj, name)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.into_pyobject(py)
    }
}

/// By name (`Overlap::name`; an unknown one is an error naming `cost.overlap`).
impl CostField for Overlap {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        Overlap::parse(&attr::<String>(obj, name)?).map_err(to_py)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.name().into_pyobject(py)?.into_any())
    }
}

/// By their names (`Pass::name`; an unknown one is an error naming `cost.passes[i]`).
impl CostField for Vec<Pass> {
    fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let names: Vec<String> = attr(obj, name)?;
        names.iter().enumerate().map(|(i, n)| Pass::parse(i, n)).collect::<Result<Vec<_>, _>>().map_err(to_py)
    }
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.iter().map(|p| p.name()).collect::<Vec<_>>().into_pyobject(py)
    }
}

/// The cost model's fields, each named once: the coefficients every model sets, then the
/// options (whose defaults `cost_defaults()` reports from `CostModel::default()`). The
/// struct literal in `cost` names every field, so a field the core adds and this list lacks
/// does not compile.
macro_rules! cost_fields {
    (required: $($r:ident),* ; options: $($o:ident),* $(,)?) => {
        /// A `routepack.CostModel` → the core's `CostModel` (not checked here: every core
        /// entry point checks it against its window, naming the field).
        pub fn cost(obj: &Bound<'_, PyAny>) -> PyResult<CostModel> {
            Ok(CostModel { $($r: CostField::read(obj, stringify!($r))?,)* $($o: CostField::read(obj, stringify!($o))?,)* })
        }

        /// `{option: default}` of every cost model option, from `CostModel::default()`.
        fn cost_option_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
            let d = CostModel::default();
            let out = PyDict::new(py);
            $(out.set_item(stringify!($o), d.$o.report(py)?)?;)*
            Ok(out)
        }
    };
}

cost_fields! {
    required: a_lin, a_quad, c_tok, c_exp, token_bytes, bw_intra, bw_inter, expert_weight_bytes, expert_grad_bytes,
        expert_state_bytes;
    options: c_weights, c_gemm, expert_table, c_call, a2a_latency, bw_reduce, reduce_latency, replica_prefetch, c_replica,
        c_migrate, migration_latency, overlap, passes,
}

/// routepack's placement options from `routepack_placement`'s arguments (None: the core's
/// default; `explore` None: the core's rule, `Options::explore`). `cells` is the core's
/// `exchanges`.
pub fn placement(
    cells: Option<usize>,
    slack: Option<f64>,
    explore: Option<f64>,
    fluct_evals: Option<usize>,
    migration_aware: Option<bool>,
    time_budget_s: Option<f64>,
) -> PyResult<PlacementOptions> {
    let d = PlacementOptions::default();
    Ok(PlacementOptions {
        exchanges: cells.unwrap_or(d.exchanges),
        slack: slack.unwrap_or(d.slack),
        explore: explore.or(d.explore),
        fluct_evals: fluct_evals.unwrap_or(d.fluct_evals),
        migration_aware: migration_aware.unwrap_or(d.migration_aware),
        time_budget: budget::from_secs("time_budget_s", time_budget_s).map_err(to_py)?,
    })
}

/// The annealer's knobs `pack_routepack` takes (each None: the core's default).
pub struct AnnealArgs {
    /// The chains' random seed.
    pub seed: Option<u64>,
    /// Proposed moves in all (None: `default_moves` of the topology).
    pub moves: Option<u64>,
    /// Chains of the population.
    pub chains: Option<usize>,
    /// Temperature steps.
    pub steps: Option<usize>,
    /// Acceptance rate the start temperature aims at.
    pub start_accept: Option<f64>,
    /// Cooling factor per temperature step.
    pub cooling: Option<f64>,
    /// Move kinds' weights (shift, swap, near, cells).
    pub mix: Option<(f64, f64, f64, f64)>,
}

/// routepack's packing options from `pack_routepack`'s arguments (None: the core's default).
pub fn packing(
    t: &Topology,
    a: AnnealArgs,
    exact_nodes: Option<u64>,
    lambda: Option<f64>,
    time_budget_s: Option<f64>,
) -> PyResult<PackingOptions> {
    let mut opts = PackingOptions::default();
    opts.exact_nodes = exact_nodes.unwrap_or(opts.exact_nodes);
    opts.lambda = lambda.unwrap_or(opts.lambda);
    let o = &mut opts.anneal;
    o.seed = a.seed.unwrap_or(o.seed);
    o.moves = a.moves.unwrap_or_else(|| default_moves(t));
    o.chains = a.chains.unwrap_or(o.chains);
    o.steps = a.steps.unwrap_or(o.steps);
    o.start_accept = a.start_accept.unwrap_or(o.start_accept);
    o.cooling = a.cooling.unwrap_or(o.cooling);
    o.time_budget = budget::from_secs("time_budget_s", time_budget_s).map_err(to_py)?;
    if let Some((shift, swap, near, cells)) = a.mix {
        o.mix = MoveMix { shift, swap, near, cells };
    }
    Ok(opts)
}

/// `pack_rows`'s node limit (None: the packing stage's `exact_nodes`).
pub fn exact_nodes(node_limit: Option<u64>) -> u64 {
    node_limit.unwrap_or_else(|| PackingOptions::default().exact_nodes)
}

/// routepack's replication options from `replicate_routepack`'s arguments (None: the core's
/// default).
pub fn replication(
    replication_slots: Option<usize>,
    candidate_experts: Option<usize>,
    candidate_dsts: Option<usize>,
    time_budget_s: Option<f64>,
) -> PyResult<ReplicationOptions> {
    let d = ReplicationOptions::default();
    Ok(ReplicationOptions {
        replication_slots: replication_slots.unwrap_or(d.replication_slots),
        experts: candidate_experts.unwrap_or(d.experts),
        dsts: candidate_dsts.unwrap_or(d.dsts),
        time_budget: budget::from_secs("time_budget_s", time_budget_s).map_err(to_py)?,
    })
}

/// `replicate_relibra`'s copies per rank (None: the budget routepack's replication gets).
pub fn relibra_slots(replication_slots: Option<usize>) -> usize {
    replication_slots.unwrap_or(ReplicationOptions::default().replication_slots)
}

/// `replicate_hot_n`'s hot experts per exchange (None: the core's `DEFAULT_HOT_EXPERTS`).
pub fn hot_experts(hot_experts: Option<usize>) -> usize {
    hot_experts.unwrap_or(DEFAULT_HOT_EXPERTS)
}

/// `{stage: {option name: default}}` with the option names `plan_window` takes.
/// `placement_explore` is the core's `DEFAULT_EXPLORE`, what an unset explore is unless the
/// slack is larger (`Options::explore`).
#[pyfunction]
pub fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);

    let p = PlacementOptions::default();
    let placement = PyDict::new(py);
    placement.set_item("placement_chunks", DEFAULT_CHUNKS)?;
    placement.set_item("placement_slack", p.slack)?;
    placement.set_item("placement_explore", DEFAULT_EXPLORE)?;
    placement.set_item("placement_fluct_evals", p.fluct_evals)?;
    placement.set_item("placement_migration_aware", p.migration_aware)?;
    out.set_item("placement", placement)?;

    let l = PackingOptions::default();
    let a = &l.anneal;
    let packing = PyDict::new(py);
    packing.set_item("anneal_moves", DEFAULT_MOVES)?;
    packing.set_item("anneal_moves_across_nodes", DEFAULT_MOVES_ACROSS_NODES)?;
    packing.set_item("anneal_chains", a.chains)?;
    packing.set_item("anneal_steps", a.steps)?;
    packing.set_item("anneal_lambda", l.lambda)?;
    packing.set_item("anneal_start_accept", a.start_accept)?;
    packing.set_item("anneal_cooling", a.cooling)?;
    packing.set_item("anneal_mix", (a.mix.shift, a.mix.swap, a.mix.near, a.mix.cells))?;
    packing.set_item("packing_exact_nodes", l.exact_nodes)?;
    out.set_item("packing", packing)?;

    let r = ReplicationOptions::default();
    let replication = PyDict::new(py);
    replication.set_item("replication_hot_experts", DEFAULT_HOT_EXPERTS)?;
    replication.set_item("replication_slots", r.replication_slots)?;
    replication.set_item("replication_candidates", r.experts)?;
    replication.set_item("replication_min_tokens", routepack_core::replication::ultraep::DEFAULT_MIN_TOKENS)?;
    out.set_item("replication", replication)?;
    Ok(out)
}

/// `{field: default}` of the cost model's options (`c_weights`, `c_gemm`, `expert_table`,
/// `c_call`, `a2a_latency`, `bw_reduce`, `reduce_latency`, `replica_prefetch`, `c_replica`, `c_migrate`,
/// `migration_latency`, `overlap`, `passes`): `CostModel::default()`'s, the values that price
/// every plan as before the options existed.
#[pyfunction]
pub fn cost_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    cost_option_defaults(py)
}

/// `{field: default}` of the topology's optional fields (`replica_slots`, `pp`, `vpp`, `cp`:
/// the core's `DEFAULT_REPLICA_SLOTS`, `DEFAULT_PP`, `DEFAULT_VPP`, `DEFAULT_CP`;
/// `layers_per_stage`: None, the even split; `nvlink_domain`: None, a node is a domain).
#[pyfunction]
pub fn topology_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("replica_slots", DEFAULT_REPLICA_SLOTS)?;
    out.set_item("pp", DEFAULT_PP)?;
    out.set_item("vpp", DEFAULT_VPP)?;
    out.set_item("cp", DEFAULT_CP)?;
    out.set_item("layers_per_stage", py.None())?;
    out.set_item("nvlink_domain", py.None())?;
    Ok(out)
}

/// Adds this file's functions to `routepack._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(defaults, m)?)?;
    m.add_function(wrap_pyfunction!(cost_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(topology_defaults, m)?)?;
    Ok(())
}
