//! routepack's placement, per MoE layer (layers in parallel, each deterministic):
//!
//! 1. replication: [`replicate`] (optimal for the largest per-replica load);
//! 2. node-aware packing: replicas onto the nodes of an EP group first (balancing node loads,
//!    hence the inter-node all-to-all each node receives), then each node's replicas onto its
//!    ranks; each level by [`Pack`]: greedy, min-max local search, then the fluctuation phase
//!    that lowers the chunk-by-chunk spread of loads (per-microbatch peaks) without lifting
//!    the balanced maximum by more than `slack`;
//! 3. migration awareness, when a placement is in force (`previous`): the fresh placement is
//!    relabelled (nodes, ranks within nodes, slots within ranks) to overlap the old one most;
//!    beside it, incremental candidates start from the old placement (counts adjusted,
//!    then the same local search, snapshotted after 1, 2, 4, ... swaps), and keeping the old
//!    placement is a candidate too. Every candidate's predicted time over the window (a proxy
//!    of the simulator's per-microbatch expert and all-to-all terms, from the chunk demand) is
//!    weighed against its exposed migration time (priced as `simulate::migration_time` does,
//!    over all layers together): layers are upgraded greedily by net saving until no upgrade
//!    pays for its moves.
//!
//! The parts live beside this file: `items` (replicas), `fresh` (node-then-rank packing),
//! `incremental` (candidates from the old placement), `predict` (the time proxy), `choose`
//! (the migration choice).

use rayon::prelude::*;

use super::choose::{accumulate, choose, Candidate, LayerPlan};
use super::demand::Demand;
use super::fresh::fresh_bins;
use super::incremental::incremental_bins;
use super::items::{as_experts, Items};
use super::predict::Predictor;
use super::relabel::{fill_slots, layout_layer};
use super::replicate::replicate;
use super::Placement;
use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::migration::diff_layer;
use crate::cost::links::LinkBytes;
use crate::topology::Topology;

/// Default microbatch-phase budget per layer ([`Options::fluct_evals`]). It keeps a placement
/// of DeepSeek-V3's size (58 layers × 256 experts, 288 slots on 32 ranks in 4 nodes) under
/// 5 ms on two cores. Larger budgets lower the per-microbatch peaks of the placement taken
/// alone (on `flash` with sequential packing, simulated step time 1.5% lower at 8000 for about
/// twice the time); behind the full routepack policy, whose packing, layout and replication
/// balance each microbatch again, the measured step time did not change.
pub const DEFAULT_FLUCT_EVALS: usize = 1_000;

/// Knobs of routepack's placement (Python: `plan_window(..., placement_<name>=...)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Cells the window will run as (EP groups × microbatches per rank): the granularity of
    /// the predicted-time proxy. 0 = one cell per chunk.
    pub cells: usize,
    /// How far above the balanced maximum (a fraction) the final placement may leave a bin's
    /// aggregate load.
    pub slack: f64,
    /// How far above it the first fluctuation pass may go before the tightening pass brings
    /// the maximum back to `slack` (a fraction, >= slack): room to reorganise. A fraction of a
    /// rank's load: the node level explores the same absolute band (`explore` / ranks per node).
    pub explore: f64,
    /// Candidate swaps the fluctuation phase prices per layer (its time budget, counted).
    pub fluct_evals: usize,
    /// With `previous`: weigh keeping and incremental candidates against migration time.
    /// false = always the fresh placement, relabelled against `previous`.
    pub migration_aware: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { cells: 0, slack: 5e-5, explore: 0.01, fluct_evals: DEFAULT_FLUCT_EVALS, migration_aware: true }
    }
}

impl Options {
    pub fn check(&self) -> Result<()> {
        if !(self.slack.is_finite() && (0.0..=1.0).contains(&self.slack)) {
            return Err(invalid("placement_slack", format!("must be in [0, 1], got {}", self.slack)));
        }
        if !(self.explore.is_finite() && (self.slack..=1.0).contains(&self.explore)) {
            return Err(invalid("placement_explore", format!("must be in [slack={}, 1], got {}", self.slack, self.explore)));
        }
        Ok(())
    }
}

/// What the stage decided for a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The placement in force, unchanged.
    Keep,
    /// Placed from scratch, relabelled against the old placement.
    Fresh,
    /// The old placement adjusted by `swaps` local-search swaps.
    Incremental,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    pub choice: Choice,
    /// Local-search swaps of an incremental choice (0 otherwise).
    pub swaps: usize,
    /// Experts copied over the network for this layer (migration rows with bytes > 0).
    pub moves: usize,
    /// Predicted expert + all-to-all seconds of the chosen placement over the window.
    pub predicted: f64,
    /// The same for the placement in force (NaN without one) and the fresh placement.
    pub predicted_keep: f64,
    pub predicted_fresh: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub placement: Placement,
    pub layers: Vec<LayerReport>,
    /// Predicted exposed migration seconds of the chosen moves (0 without `previous`).
    pub migration_time: f64,
}

fn plan_layer(l: usize, demand: &Demand, topo: &Topology, cost: &CostModel, previous: Option<&Placement>, opts: &Options) -> Result<LayerPlan> {
    let (e_n, dim) = (demand.num_experts, demand.num_chunks);
    let loads = demand.layer_loads(l);
    let chunks = demand.layer_chunks(l);
    let counts = replicate(loads, topo.num_slots())?;
    let items = Items::new(loads, chunks, dim, &counts);
    let predictor = Predictor::new(loads, chunks, dim, opts, cost, topo);
    let (bins, top) = fresh_bins(&items, e_n, topo, opts);
    let rpn = topo.ranks_per_group_node();
    let old = previous.map(|p| p.layer(l));
    let fresh_layer = layout_layer(&as_experts(&items, &bins), old, topo.slots_per_rank, rpn);
    let moves_of = |layer: &[i32]| {
        let mut rows = Vec::new();
        if let Some(old) = old {
            diff_layer(l, old, layer, topo.slots_per_rank, rpn, cost.expert_state_bytes, &mut rows);
        }
        rows
    };
    let mut candidates = Vec::new();
    if let (Some(old), true) = (old, opts.migration_aware) {
        candidates.push(Candidate { layer: old.to_vec(), time: predictor.time(old), moves: Vec::new(), choice: Choice::Keep, swaps: 0 });
        for (swaps, b) in incremental_bins(&items, e_n, old, topo, top, opts) {
            let ex = as_experts(&items, &b);
            let layer: Vec<i32> = (0..topo.ep)
                .flat_map(|r| fill_slots(&ex[r], &old[r * topo.slots_per_rank..(r + 1) * topo.slots_per_rank]))
                .collect();
            let moves = moves_of(&layer);
            candidates.push(Candidate { time: predictor.time(&layer), moves, layer, choice: Choice::Incremental, swaps });
        }
    }
    let fresh = candidates.len();
    let moves = moves_of(&fresh_layer);
    candidates.push(Candidate { time: predictor.time(&fresh_layer), moves, layer: fresh_layer, choice: Choice::Fresh, swaps: 0 });
    Ok(LayerPlan { candidates, fresh })
}

/// routepack's placement of every layer (see the module docs). `previous`: the placement in
/// force, or None for a first placement.
pub fn routepack_placement(demand: &Demand, topo: &Topology, cost: &CostModel, previous: Option<&Placement>, opts: &Options) -> Result<Outcome> {
    opts.check()?;
    topo.check_experts(demand.num_experts)?;
    cost.check(demand.num_layers)?;
    if let Some(p) = previous {
        p.check_topology(topo)?;
        if p.num_layers != demand.num_layers || p.num_experts != demand.num_experts {
            return Err(invalid(
                "previous",
                format!("placement has L={}, E={} but the loads have L={}, E={}", p.num_layers, p.num_experts, demand.num_layers, demand.num_experts),
            ));
        }
    }
    let plans: Vec<LayerPlan> = (0..demand.num_layers)
        .into_par_iter()
        .map(|l| plan_layer(l, demand, topo, cost, previous, opts))
        .collect::<Result<_>>()?;
    let (pick, migration_time) = match previous {
        Some(_) if opts.migration_aware => choose(&plans, topo, cost),
        Some(_) => {
            let pick: Vec<usize> = plans.iter().map(|p| p.fresh).collect();
            let mut links = vec![LinkBytes::default(); topo.ep];
            for (lp, &c) in plans.iter().zip(&pick) {
                accumulate(&mut links, &lp.candidates[c].moves, topo);
            }
            let t = LinkBytes::time(&links, cost);
            (pick, t)
        }
        None => (plans.iter().map(|p| p.fresh).collect(), 0.0),
    };
    let mut phy2log = Vec::with_capacity(demand.num_layers * topo.num_slots());
    let mut layers = Vec::with_capacity(demand.num_layers);
    for (lp, &c) in plans.iter().zip(&pick) {
        let cand = &lp.candidates[c];
        phy2log.extend_from_slice(&cand.layer);
        let keep = lp.candidates.iter().find(|x| x.choice == Choice::Keep).map_or(f64::NAN, |x| x.time);
        layers.push(LayerReport {
            choice: cand.choice,
            swaps: cand.swaps,
            moves: cand.moves.iter().filter(|m| m.bytes > 0.0).count(),
            predicted: cand.time,
            predicted_keep: keep,
            predicted_fresh: lp.candidates[lp.fresh].time,
        });
    }
    let placement = Placement::new(phy2log, demand.num_layers, demand.num_experts, topo.slots_per_rank)?;
    Ok(Outcome { placement, layers, migration_time })
}

#[cfg(test)]
mod tests_support {
    use rand::{RngExt, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;
    /// A window of `s` samples with topic structure: each sample prefers a few experts.
    pub fn window_data(s: usize, l: usize, e: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let lens: Vec<i64> = (0..s).map(|_| rng.random_range(1..200)).collect();
        let mut x = vec![0i32; s * l * e];
        for si in 0..s {
            let hot: Vec<usize> = (0..3).map(|_| rng.random_range(0..e)).collect();
            for li in 0..l {
                for _ in 0..lens[si] * 2 {
                    let ex = if rng.random::<f64>() < 0.5 { hot[rng.random_range(0..3)] } else { rng.random_range(0..e) };
                    x[(si * l + li) * e + ex] += 1;
                }
            }
        }
        (lens, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::diff_nodes;
    use crate::packing::sequential::sequential;
    use crate::placement::demand::{chunk_demand, window_loads};
    use crate::placement::eplb::eplb_placement;
    use crate::placement::quality::{aggregate_imbalance, imbalance_lower_bound};
    use crate::plan::{MigrationRow, Plan};
    use crate::validate::validate_plan;
    use crate::window::WindowView;
    use proptest::prelude::*;

    /// Does some rank hold more copies of an expert than ceil(copies / ranks), the fewest any
    /// arrangement can manage (so two copies share a rank only when unavoidable)?
    fn avoidable_duplicate(p: &Placement, l: usize) -> bool {
        let cnt = p.logcnt();
        let (spr, ranks) = (p.slots_per_rank, p.num_ranks());
        (0..ranks).any(|r| {
            let on = &p.layer(l)[r * spr..(r + 1) * spr];
            on.iter().filter(|&&e| e >= 0).any(|&e| {
                let here = on.iter().filter(|&&x| x == e).count();
                here > (cnt[l * p.num_experts + e as usize] as usize).div_ceil(ranks)
            })
        })
    }

    use super::tests_support::window_data;

    fn plan_with(p: Placement, w: &WindowView, topo: &Topology, cap: i64, migration: Vec<MigrationRow>) -> Plan {
        let pk = sequential(w.seq_lens, cap, topo.dp).unwrap();
        Plan { placement: p, sample_rank: pk.sample_rank, sample_micro: pk.sample_micro, num_micro: pk.num_micro, replicas: vec![], migration }
    }

    fn place(w: &WindowView, topo: &Topology, prev: Option<&Placement>, chunks: usize) -> Outcome {
        let loads = window_loads(w);
        let ch = chunk_demand(w, chunks).unwrap();
        let d = Demand::new(&loads, &ch, w.num_layers, w.num_experts, chunks).unwrap();
        routepack_placement(&d, topo, &CostModel::for_tests(w.num_layers), prev, &Options::default()).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Random loads, slot counts and node shapes: every plan validates, fills every slot,
        /// never puts two copies of an expert on one rank when avoidable, and is at least as
        /// balanced over the window as EPLB given the same loads (within float noise) wherever
        /// EPLB's own layout keeps copies apart.
        #[test]
        fn plans_validate_and_beat_eplb(
            ep_pow in 0u32..4, gpn_pow in 0u32..4, extra in 0usize..5, e in 2usize..40,
            seed in 0u64..1000, chunks in 0usize..6,
        ) {
            let (ep, gpn) = (1usize << ep_pow, 1usize << gpn_pow);
            let spr = e.div_ceil(ep) + extra;
            let topo = Topology::new(ep * 2, ep, gpn, spr).unwrap();
            let (lens, x) = window_data(24, 2, e, seed);
            let w = WindowView::new(&lens, &x, 2, e).unwrap();
            let out = place(&w, &topo, None, chunks);
            let p = out.placement.clone();
            prop_assert!(p.phy2log.iter().all(|&x| x >= 0), "every slot is filled");
            for l in 0..2 {
                prop_assert!(!avoidable_duplicate(&p, l), "layer {l}: two copies of an expert share a rank");
            }
            validate_plan(&plan_with(p.clone(), &w, &topo, 400, vec![]), &w, &topo, 400).unwrap();
            let loads = window_loads(&w);
            let ours = aggregate_imbalance(&p, &loads).unwrap();
            let lb = imbalance_lower_bound(&loads, 2, e, topo.num_slots(), ep).unwrap();
            let base = eplb_placement(&loads, 2, e, &topo, 1).unwrap();
            let theirs = aggregate_imbalance(&base, &loads).unwrap();
            for l in 0..2 {
                prop_assert!(ours[l] >= lb[l] - 1e-9);
                // EPLB may buy balance with duplicates on one rank (its known defect), which
                // routepack refuses; compare where EPLB's layout is a legal one for us
                if !avoidable_duplicate(&base, l) {
                    prop_assert!(ours[l] <= theirs[l] * (1.0 + 1e-9), "layer {l}: {} > eplb {}", ours[l], theirs[l]);
                }
            }
        }

        /// With a placement in force: moves validate against the plan, unchanged loads move
        /// nothing, and the result is deterministic.
        #[test]
        fn migration_is_consistent(ep_pow in 1u32..4, gpn_pow in 0u32..3, e in 4usize..40, seed in 0u64..1000) {
            let (ep, gpn) = (1usize << ep_pow, 1usize << gpn_pow);
            let spr = e.div_ceil(ep) + 1;
            let topo = Topology::new(ep, ep, gpn, spr).unwrap();
            let (lens, x) = window_data(24, 2, e, seed);
            let w = WindowView::new(&lens, &x, 2, e).unwrap();
            let first = place(&w, &topo, None, 4).placement;
            let again = place(&w, &topo, Some(&first), 4);
            prop_assert_eq!(&again.placement, &first, "unchanged loads keep the placement");
            prop_assert_eq!(again.migration_time, 0.0);
            let (lens2, x2) = window_data(24, 2, e, seed + 1);
            let w2 = WindowView::new(&lens2, &x2, 2, e).unwrap();
            let next = place(&w2, &topo, Some(&first), 4);
            prop_assert_eq!(&next.placement, &place(&w2, &topo, Some(&first), 4).placement);
            let moves = diff_nodes(&first, &next.placement, topo.ranks_per_group_node(), 1.0).unwrap();
            validate_plan(&plan_with(next.placement.clone(), &w2, &topo, 400, moves.clone()), &w2, &topo, 400).unwrap();
            let reported: usize = next.layers.iter().map(|r| r.moves).sum();
            prop_assert_eq!(reported, moves.iter().filter(|m| m.bytes > 0.0).count());
        }
    }

    #[test]
    fn costly_migration_keeps_the_old_placement() {
        let topo = Topology::new(8, 8, 4, 3).unwrap();
        let (lens, x) = window_data(32, 3, 16, 1);
        let w = WindowView::new(&lens, &x, 3, 16).unwrap();
        let (lens2, x2) = window_data(32, 3, 16, 2);
        let w2 = WindowView::new(&lens2, &x2, 3, 16).unwrap();
        let first = place(&w, &topo, None, 4).placement;
        let loads = window_loads(&w2);
        let ch = chunk_demand(&w2, 4).unwrap();
        let d = Demand::new(&loads, &ch, 3, 16, 4).unwrap();
        let mut cost = CostModel::for_tests(3);
        cost.expert_state_bytes = 1e15; // moving anything costs hours
        let out = routepack_placement(&d, &topo, &cost, Some(&first), &Options::default()).unwrap();
        assert_eq!(out.placement, first);
        assert!(out.layers.iter().all(|r| r.choice == Choice::Keep));
        cost.expert_state_bytes = 0.0; // free moves: every layer takes its best candidate
        let out = routepack_placement(&d, &topo, &cost, Some(&first), &Options::default()).unwrap();
        for r in &out.layers {
            assert!(r.predicted <= r.predicted_keep && r.predicted <= r.predicted_fresh + 1e-12, "{r:?}");
        }
    }

    #[test]
    fn layers_without_load_still_place_every_expert() {
        let topo = Topology::new(4, 4, 2, 3).unwrap();
        let loads = vec![0.0; 2 * 10];
        let chunks = vec![0.0; 2 * 10 * 3];
        let d = Demand::new(&loads, &chunks, 2, 10, 3).unwrap();
        let out = routepack_placement(&d, &topo, &CostModel::for_tests(2), None, &Options::default()).unwrap();
        assert!(out.placement.logcnt().iter().all(|&c| c >= 1));
        assert!(out.placement.phy2log.iter().all(|&e| e >= 0));
        let again = routepack_placement(&d, &topo, &CostModel::for_tests(2), Some(&out.placement), &Options::default()).unwrap();
        assert_eq!(again.placement, out.placement);
    }

    #[test]
    fn bad_options_and_shapes_are_named() {
        let topo = Topology::new(2, 2, 2, 2).unwrap();
        let loads = vec![1.0; 4];
        let d = Demand::new(&loads, &[], 1, 4, 0).unwrap();
        let cost = CostModel::for_tests(1);
        let bad = Options { slack: -1.0, ..Options::default() };
        assert!(routepack_placement(&d, &topo, &cost, None, &bad).unwrap_err().to_string().contains("placement_slack"));
        let prev = Placement::new(vec![0, 1, 2, 3, 0, 1, 2, 3], 2, 4, 2).unwrap();
        let e = routepack_placement(&d, &topo, &cost, Some(&prev), &Options::default()).unwrap_err();
        assert!(e.to_string().contains("previous"), "{e}");
        assert!(Demand::new(&[1.0, f64::NAN], &[], 1, 2, 0).unwrap_err().to_string().contains("loads"));
    }
}
