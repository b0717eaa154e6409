//! Layout (DESIGN.md stage 3) and routepack's packing policy.
//!
//! routepack packs in two steps: the fewest token-capped rows with a certificate
//! (`packing::certified`), which fixes M = rows / dp microbatches per DP rank; then a layout of
//! the samples on the dp × M grid of cells that minimises the slowest EDP shard's accumulated
//! cost (`cost`), searched by parallel population annealing (`anneal`, `chain`) from a
//! worst-fit start (`init`). The annealer moves samples between rows too, so "rows" fixes the
//! count, not the membership.
//!
//! * [`cost`]    the objective and its O(L·ep) incremental evaluation
//! * [`kernel`]  the per-layer hot loop (plain and AVX2, bit-identical)
//! * [`detmath`] exp and ln that give the same bits on every machine
//! * [`init`]    the starting layout
//! * [`chain`]   one Metropolis chain and its invariant-keeping moves
//! * [`anneal`]  the population, temperature schedule and resampling

pub mod anneal;
pub mod chain;
pub mod cost;
pub mod detmath;
pub mod init;
pub mod kernel;

use std::time::{Duration, Instant};

use crate::cost::CostModel;
use crate::error::{bad_plan, invalid, Result};
use crate::packing::certified::certified_rows;
use crate::packing::Packing;
use crate::placement::Placement;
use crate::topology::Topology;
use crate::window::WindowView;

pub use anneal::{AnnealParams, AnnealResult, StepRecord};
pub use cost::Proxy;

/// Settings of routepack's packing.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutOptions {
    pub anneal: AnnealParams,
    /// Node limit of the exact row search (per target count).
    pub exact_nodes: u64,
    /// Weight of the mean group cost in the energy (see `cost`).
    pub lambda: f64,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        Self { anneal: AnnealParams::default(), exact_nodes: 200_000, lambda: 0.1 }
    }
}

/// Row certificate, copied out of `CertifiedRows` (without the rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowsReport {
    pub rows: usize,
    pub micro: usize,
    pub l1: usize,
    pub l2: usize,
    pub lower_bound: usize,
    pub certified: bool,
    pub gap: usize,
    pub method: &'static str,
    pub bins: usize,
    pub nodes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayoutReport {
    pub rows: RowsReport,
    /// "worst_fit" or "rows" (see `init`).
    pub init: &'static str,
    pub anneal: AnnealResult,
    /// Wall seconds of the parts: rows, proxy (projections), init, anneal.
    pub seconds: [f64; 4],
}

/// routepack's packing: certified rows, then the annealed layout. `placement` is the one the
/// plan will use (expert loads on EP ranks are projected through it).
pub fn routepack_packing(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    token_cap: i64,
    opts: &LayoutOptions,
) -> Result<(Packing, LayoutReport)> {
    let a = &opts.anneal;
    if a.chains == 0 {
        return Err(invalid("anneal_chains", "must be >= 1, got 0"));
    }
    if a.steps == 0 {
        return Err(invalid("anneal_steps", "must be >= 1, got 0"));
    }
    if !(a.start_accept > 0.0 && a.start_accept < 1.0) {
        return Err(invalid("start_accept", format!("must be in (0, 1), got {}", a.start_accept)));
    }
    if a.mix.thresholds().is_none() {
        return Err(invalid("anneal_mix", format!("weights must be finite, >= 0 and not all 0, got {:?}", a.mix)));
    }
    if !(a.cooling > 0.0 && a.cooling <= 1.0) {
        return Err(invalid("cooling", format!("must be in (0, 1], got {}", a.cooling)));
    }
    topo.check_experts(w.num_experts)?;
    let start = Instant::now();
    // the exact search may use a quarter of a wall-clock budget
    let exact_deadline = a.time_budget.map(|b| start + b / 4);
    let rows = certified_rows(w.seq_lens, token_cap, topo.dp, opts.exact_nodes, exact_deadline)?;
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
    let result = anneal::anneal(&px, &init, &params);
    let t_anneal = start.elapsed().as_secs_f64();
    let packing = to_packing(&result.cell_of, micro);
    let report = LayoutReport {
        rows: RowsReport {
            rows: rows.rows.len(),
            micro,
            l1: rows.l1,
            l2: rows.l2,
            lower_bound: rows.lower_bound,
            certified: rows.certified,
            gap: rows.gap,
            method: rows.method,
            bins: rows.bins,
            nodes: rows.nodes,
        },
        init: how,
        anneal: result,
        seconds: [t_rows, t_proxy - t_rows, t_init - t_proxy, t_anneal - t_init],
    };
    Ok((packing, report))
}

/// Cells d·M + m → (sample_rank, sample_micro).
pub fn to_packing(cell_of: &[u32], micro: usize) -> Packing {
    Packing {
        sample_rank: cell_of.iter().map(|&c| (c as usize / micro) as i32).collect(),
        sample_micro: cell_of.iter().map(|&c| (c as usize % micro) as i32).collect(),
        num_micro: micro,
    }
}

/// The proxy's step time (max_g C_g, see `cost`) of any layout: to check that the proxy
/// tracks `simulate`. The layout's ranks and steps must be in range.
pub fn proxy_step_time(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    packing: &Packing,
) -> Result<f64> {
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
    let px = Proxy::new(w, topo, cost, placement, i64::MAX, m_n, 0.0)?;
    Ok(px.step_time(&px.build(&cell_of)))
}

#[cfg(test)]
mod tests {
    use super::chain::Chain;
    use super::*;
    use crate::placement::static_placement;
    use crate::plan::Plan;
    use crate::simulate::simulate;
    use crate::validate::validate_plan;
    use rand::SeedableRng;

    fn window(s_n: usize, l_n: usize, e_n: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
        use rand::RngExt;
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(20..1500i64)).collect();
        let mut tok = vec![0i32; s_n * l_n * e_n];
        for s in 0..s_n {
            let hot = rng.random_range(0..e_n);
            for l in 0..l_n {
                for _ in 0..lens[s] * 2 {
                    let e = if rng.random_range(0..3) == 0 { hot } else { rng.random_range(0..e_n) };
                    tok[(s * l_n + l) * e_n + e] += 1;
                }
            }
        }
        (lens, tok)
    }

    fn setup(s_n: usize) -> (Vec<i64>, Vec<i32>, Topology, CostModel) {
        let (lens, tok) = window(s_n, 4, 16, 11);
        (lens, tok, Topology::new(8, 4, 2, 5).unwrap(), CostModel::for_tests(4))
    }

    #[test]
    fn chain_state_stays_exact_and_feasible() {
        let (lens, tok, topo, cost) = setup(96);
        let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
        let pl = static_placement(4, 16, &topo).unwrap();
        let rows = certified_rows(&lens, 3000, 8, 1000, None).unwrap();
        let m_n = rows.rows.len() / 8;
        let px = Proxy::new(&w, &topo, &cost, &pl, 3000, m_n, 0.1).unwrap();
        let init = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
        let mut c = Chain::new(&px, &init, rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1), chain::MoveMix::default());
        for round in 0..5 {
            c.run(&px, 2000, if round < 4 { 1e-4 } else { 0.0 }, None);
            assert!(c.consistent(&px), "incremental state drifted from a rebuild");
            let p = to_packing(&c.cell_of, m_n);
            let plan = Plan { placement: pl.clone(), sample_rank: p.sample_rank, sample_micro: p.sample_micro, num_micro: m_n, replicas: vec![], migration: vec![] };
            validate_plan(&plan, &w, &topo, 3000).unwrap();
        }
        assert!(c.accepted > 0 && c.evaluated > c.accepted);
    }

    #[test]
    fn annealing_improves_and_the_proxy_tracks_simulate() {
        let (lens, tok, topo, cost) = setup(128);
        let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
        let pl = static_placement(4, 16, &topo).unwrap();
        let mut opts = LayoutOptions::default();
        opts.anneal.moves = 40_000;
        let (p, rep) = routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap();
        assert!(rep.anneal.best_cost < rep.anneal.initial_cost);
        assert_eq!(rep.anneal.history.len(), rep.anneal.steps);
        let plan = Plan { placement: pl.clone(), sample_rank: p.sample_rank.clone(), sample_micro: p.sample_micro.clone(), num_micro: p.num_micro, replicas: vec![], migration: vec![] };
        validate_plan(&plan, &w, &topo, 4096).unwrap();
        let sim = simulate(&plan, &w, &topo, &cost, None).unwrap();
        let proxy = proxy_step_time(&w, &topo, &cost, &pl, &p).unwrap();
        assert!((sim.step_time - proxy).abs() / sim.step_time < 1e-3, "simulate {} proxy {proxy}", sim.step_time);
    }

    #[test]
    fn same_plan_on_one_and_two_threads() {
        let (lens, tok, topo, cost) = setup(128);
        let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
        let pl = static_placement(4, 16, &topo).unwrap();
        let mut opts = LayoutOptions::default();
        opts.anneal.moves = 20_000;
        opts.anneal.seed = 5;
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap())
        };
        let (a, ra) = run(1);
        let (b, rb) = run(2);
        assert_eq!(a, b);
        assert_eq!(ra.anneal.history, rb.anneal.history);
        opts.anneal.seed = 6;
        let (c, _) = pool_free(&w, &topo, &cost, &pl, &opts);
        assert_ne!(a, c, "another seed should give another layout");
    }

    fn pool_free(w: &WindowView, topo: &Topology, cost: &CostModel, pl: &Placement, opts: &LayoutOptions) -> (Packing, LayoutReport) {
        routepack_packing(w, topo, cost, pl, 4096, opts).unwrap()
    }
}
