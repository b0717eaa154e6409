//! routepack's packing: the fewest token-capped rows with a certificate (`super::rows`), which
//! fixes M = rows / dp microbatches per DP rank; then the layout search (`crate::layout`) places the
//! samples on the dp × M grid of cells, minimising the slowest EP group's accumulated cost
//! under the layout proxy. The annealer moves samples between rows too, so the certified rows
//! fix the count, not the membership.
//!
//! [`Options::default`] holds every default of this stage (the bindings and `_core.defaults()`
//! read them from there).

use std::time::{Duration, Instant};

use super::cells::{Cells, Oversize};
use super::rows::certified::{certified_rows_from, RowCertificate};
use super::rows::exact::DEFAULT_NODE_LIMIT;
use super::Packing;
use crate::cost::CostModel;
use crate::error::{bad_plan, invalid, Result};
use crate::layout::chain::MoveMix;
use crate::layout::{anneal, init, AnnealParams, AnnealResult, Proxy};
use crate::plan::Placement;
use crate::request::PlanRequest;
use crate::split::{self, Pieces};
use crate::topology::Topology;
use crate::window::WindowView;

/// The layout search's default budget in proposed moves over all chains, where an EP group
/// fits in one node (see [`default_moves`] for groups that span nodes). Deterministic, unlike
/// a wall-clock budget. The anneal runs at about 0.4-1M moves per CPU-second on the 2-core
/// reference machine (`cargo run -p routepack-core --release --example anneal_rate`); `tiny`
/// gains 0.9% of its predicted step from it (median over 8 windows, against none).
/// Quality rises slowly with more (benches/packing_quality.py prints the curve).
pub const DEFAULT_MOVES: u64 = 300_000;

/// The default budget where an EP group spans nodes: no annealing, the starting layout
/// (`layout::init`) as it is. There the layout proxy prices the all-to-all before
/// replication and splits a replicated expert's tokens evenly over its copies, while the
/// placement puts hot experts' copies on several nodes and `flow` feeds them node first: on
/// `flash` the proxy's step is 8% above `simulate`'s for the same unreplicated layout
/// (118.2 s vs 109.6 s, window 1), and what the anneal gains under it does not survive
/// replication. Over flash windows 0-7 (seed 0) the annealed plans (300 000 moves) were
/// median 0.3% slower than the starting layout's (from 1.2% slower to 0.3% faster) and took
/// 0.6 s more, a third of the plan. `anneal_moves` still sets any budget.
pub const DEFAULT_MOVES_ACROSS_NODES: u64 = 0;

/// The default layout-search budget for `topo`: [`DEFAULT_MOVES`] where an EP group fits in
/// one node, [`DEFAULT_MOVES_ACROSS_NODES`] where it spans several.
pub fn default_moves(topo: &Topology) -> u64 {
    if topo.nodes_per_group() > 1 {
        DEFAULT_MOVES_ACROSS_NODES
    } else {
        DEFAULT_MOVES
    }
}

/// Settings of routepack's packing.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The layout search (population annealing).
    pub anneal: AnnealParams,
    /// Node limit of the exact row search (per target count).
    pub exact_nodes: u64,
    /// Weight of the mean group cost in the annealer's energy (see `layout::proxy`).
    pub lambda: f64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            anneal: AnnealParams {
                seed: 0,
                moves: DEFAULT_MOVES,
                // two chains: one per core on the 2-core reference machine
                chains: 2,
                steps: 24,
                start_accept: 0.1,
                cooling: 1e-3,
                time_budget: None,
                mix: MoveMix { shift: 0.25, swap: 0.0, near: 0.65, cells: 0.1 },
            },
            exact_nodes: DEFAULT_NODE_LIMIT,
            lambda: 0.1,
        }
    }
}

/// The rows' count and certificate (the rows themselves are the layout's to place).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowsReport {
    /// How many rows (dp · M).
    pub num_rows: usize,
    /// Microbatches per DP rank (M).
    pub micro: usize,
    /// How far `num_rows` is from optimal.
    pub certificate: RowCertificate,
}

/// What routepack's packing did.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The certified rows.
    pub rows: RowsReport,
    /// The layout the search started from: "worst_fit" or "rows" (see `layout::init`).
    pub init: &'static str,
    /// The layout search.
    pub anneal: AnnealResult,
    /// Wall seconds of the parts: rows, proxy (projections), init, anneal.
    pub seconds: [f64; 4],
}

/// routepack's packing: certified rows, then the annealed layout. `placement` is the one the
/// plan will use (expert loads on EP ranks are projected through it). The arguments are checked
/// once, as a [`PlanRequest`] (samples over the cap refused), then [`routepack_packing_in`].
pub fn routepack_packing(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    token_cap: i64,
    opts: &Options,
) -> Result<(Packing, Report)> {
    routepack_packing_in(&PlanRequest::new(*w, topo, cost, token_cap, Oversize::Refuse)?, placement, opts)
}

/// [`routepack_packing`] of a checked request (its window, topology, cost model and cap read,
/// not checked again; `placement` and `opts` checked here), with its `oversize` for samples
/// over the cap: with `Oversize::Alone` the
/// rows are certified on lengths where such a sample counts as the cap (`Cells::row_lens`),
/// and the layout places every sample at its real length (the annealer's moves keep a cell
/// over the cap to its one sample). With `Oversize::Split` the window's pieces (`crate::split`)
/// are packed, each piece of a split sample counted as the cap and its routed tokens split in
/// proportion (the layout's proxy prices such a piece as a full row; `simulate` prices the
/// ring), then aligned onto a CP group (`split::align`). The row count meets the topology's
/// pipeline rule (`Topology::micro_rule`).
pub fn routepack_packing_in(req: &PlanRequest, placement: &Placement, opts: &Options) -> Result<(Packing, Report)> {
    let (w, topo, cost, token_cap, oversize) = (req.window(), req.topo(), req.cost(), req.token_cap(), req.oversize());
    if oversize == Oversize::Split {
        let pieces = Pieces::of_checked(w.seq_lens, token_cap, topo.cp);
        let (lens, counts) = (pieces.row_lens(token_cap), pieces.counts(w)?);
        let wp = WindowView::new(&lens, &counts, w.num_layers, w.num_experts)?;
        let (mut p, report) = routepack_packing_in(&req.derived(wp, Oversize::Refuse), placement, opts)?;
        split::align(&mut p.sample_rank, &mut p.sample_micro, p.num_micro, &pieces, topo.dp);
        let (sample_rank, sample_micro) = pieces.collapse(&p.sample_rank, &p.sample_micro);
        return Ok((Packing { sample_rank, sample_micro, num_micro: p.num_micro }, report));
    }
    let a = &opts.anneal;
    if a.chains == 0 {
        return Err(invalid("anneal_chains", "must be >= 1, got 0"));
    }
    if a.steps == 0 {
        return Err(invalid("anneal_steps", "must be >= 1, got 0"));
    }
    if !(a.start_accept > 0.0 && a.start_accept < 1.0) {
        return Err(invalid("anneal_start_accept", format!("must be in (0, 1), got {}", a.start_accept)));
    }
    if a.mix.thresholds().is_none() {
        return Err(invalid("anneal_mix", format!("weights must be finite, >= 0 and not all 0, got {:?}", a.mix)));
    }
    if !(a.cooling > 0.0 && a.cooling <= 1.0) {
        return Err(invalid("anneal_cooling", format!("must be in (0, 1], got {}", a.cooling)));
    }
    anneal::check_sizes(a)?;
    let start = Instant::now();
    // the exact search may use a quarter of a wall-clock budget
    let exact_deadline = crate::budget::deadline(start, a.time_budget.map(|b| b / 4));
    let cells = Cells::of(topo, oversize);
    let row_lens = cells.row_lens(w.seq_lens, token_cap);
    let rows = certified_rows_from(&row_lens, token_cap, cells.step(), cells.min_rows(), opts.exact_nodes, exact_deadline)?;
    let t_rows = start.elapsed().as_secs_f64();
    let micro = rows.rows.len() / topo.dp;
    let px = Proxy::new(w, topo, cost, placement, token_cap, micro, opts.lambda)?;
    let t_proxy = start.elapsed().as_secs_f64();
    let (init, how) = match init::worst_fit(&px) {
        Some(c) => (c, "worst_fit"),
        None => (init::from_rows(&px, &rows.rows), "rows"),
    };
    let t_init = start.elapsed().as_secs_f64();
    let mut params = a.clone();
    params.time_budget = a.time_budget.map(|b| b.saturating_sub(start.elapsed()).max(Duration::from_millis(1)));
    let result = anneal::anneal(&px, &init, &params)?;
    let t_anneal = start.elapsed().as_secs_f64();
    let packing = to_packing(&result.cell_of, micro);
    let report = Report {
        rows: RowsReport { num_rows: rows.rows.len(), micro, certificate: rows.certificate },
        init: how,
        anneal: result,
        seconds: [t_rows, t_proxy - t_rows, t_init - t_proxy, t_anneal - t_init],
    };
    Ok((packing, report))
}

/// A layout's cells d·M + m → (sample_rank, sample_micro).
pub fn to_packing(cell_of: &[u32], micro: usize) -> Packing {
    Packing {
        sample_rank: cell_of.iter().map(|&c| (c as usize / micro) as i32).collect(),
        sample_micro: cell_of.iter().map(|&c| (c as usize % micro) as i32).collect(),
        num_micro: micro,
    }
}

/// The layout proxy's step time (max_g C_g, see `layout::proxy`) of any packing: to check
/// that the proxy tracks `simulate`. The packing's ranks and microbatches must be in range; the
/// topology and cost model are checked here, once (`Proxy::new` takes them checked).
pub fn proxy_step_time(w: &WindowView, topo: &Topology, cost: &CostModel, placement: &Placement, packing: &Packing) -> Result<f64> {
    let m_n = packing.num_micro;
    if packing.sample_rank.len() != w.num_samples || packing.sample_micro.len() != w.num_samples {
        return Err(bad_plan(format!(
            "sample_rank has {} and sample_micro {} entries; the window has {} samples",
            packing.sample_rank.len(),
            packing.sample_micro.len(),
            w.num_samples
        )));
    }
    let mut cell_of = Vec::with_capacity(w.num_samples);
    for (s, (&d, &m)) in packing.sample_rank.iter().zip(&packing.sample_micro).enumerate() {
        if d < 0 || d as usize >= topo.dp || m < 0 || m as usize >= m_n {
            return Err(bad_plan(format!("sample {s} is at (rank {d}, micro {m}), outside {}x{m_n}", topo.dp)));
        }
        cell_of.push((d as usize * m_n + m as usize) as u32);
    }
    topo.check_experts(w.num_experts)?;
    cost.check(w.num_layers)?;
    let px = Proxy::new(w, topo, cost, placement, i64::MAX, m_n, 0.0)?;
    Ok(px.step_time(&px.build(&cell_of)))
}

#[cfg(test)]
mod tests;
