//! routepack's placement, per MoE layer (layers in parallel, each deterministic):
//!
//! 1. replica counts: [`count_replicas`] (optimal for the largest per-replica load);
//! 2. node-aware packing: replicas onto the nodes of an EP group first (balancing node loads,
//!    hence the inter-node all-to-all each node receives), then each node's replicas onto its
//!    ranks. A replica weighs what it costs its rank, not its tokens (`copy_cost`): its share
//!    of the expert's compute plus the all-to-all it receives over each link under node-first
//!    feeding, so a copy of an expert with copies on every node (which receives almost nothing
//!    across nodes) weighs less than a lone copy of the same tokens (measured on `flash`, window
//!    1, aggregate loads, median over layers: the slowest rank's receiving link time went from
//!    1.119 to 1.059 of the mean, its tokens from 1.0002 to 1.089; the step fell 2.6% over
//!    windows 1-3); each level by [`binpack::Pack`]: greedy, min-max local search, then the
//!    fluctuation phase that lowers the chunk-by-chunk spread of loads (per-microbatch peaks)
//!    without lifting the balanced maximum by more than `slack`;
//! 3. migration awareness, when a placement is in force (`previous`): the fresh placement is
//!    relabelled (nodes, ranks within nodes, slots within ranks) to overlap the old one most;
//!    beside it, incremental candidates start from the old placement (counts adjusted,
//!    then the same local search, snapshotted after 1, 2, 4, ... swaps), and keeping the old
//!    placement is a candidate too. Every candidate's predicted time over the window (a proxy
//!    of the simulator's per-exchange expert and all-to-all terms, from the chunk demand) is
//!    weighed against its exposed migration time (priced as `simulate::migration_time` does,
//!    over all layers together): layers are upgraded greedily by net saving until no upgrade
//!    pays for its moves;
//! 4. node spread: the packings over all ranks at once (incremental candidates, the fresh
//!    placement's flat alternative) get each expert's copies spread over nodes (`spread`), as
//!    the node-level packing keeps them: `flow` feeds copies node first, so copies on distinct
//!    nodes keep more tokens inside their node.
//!
//! This file is the entry point ([`routepack_placement`], its [`Outcome`] and [`LayerReport`]);
//! the parts live beside it, none importing this file: `options` ([`Options`] and every
//! default), `items` (one layer's replicas), `binpack` (bin packing of replicas onto nodes and
//! ranks, by search phase), `copy_cost` (a replica's weight), `fresh` (node-then-rank packing), `incremental` (candidates from
//! the old placement), `spread` (copies onto distinct nodes), `predict` (the time proxy) and
//! `choose` (the migration choice, and [`Choice`]).

use std::time::Instant;

use rayon::prelude::*;

pub mod binpack;
mod choose;
mod copy_cost;
mod fresh;
mod incremental;
mod items;
mod options;
mod predict;
mod spread;
#[cfg(test)]
mod test_windows;
#[cfg(test)]
mod tests;

pub use choose::Choice;
pub use options::{Options, DEFAULT_EXCHANGES, DEFAULT_EXPLORE, DEFAULT_FLUCT_EVALS, DEFAULT_MIGRATION_AWARE, DEFAULT_SLACK};

use choose::{accumulate, choose, Candidate, LayerPlan};
use copy_cost::copy_shares;
use fresh::fresh_bins;
use incremental::incremental_bins;
use items::{as_experts, Items};
use predict::Predictor;
use spread::spread_copies;

use crate::budget;
use crate::cost::links::LinkBytes;
use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::migration::diff_layer;
use crate::placement::demand::Demand;
use crate::placement::relabel::{fill_slots, layout_layer};
use crate::placement::replica_counts::count_replicas;
use crate::placement::Placement;
use crate::topology::Topology;

/// What the stage did with one layer, and the predicted times it weighed.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    /// The kind of candidate the layer took.
    pub choice: Choice,
    /// Local-search swaps of an incremental choice (0 otherwise).
    pub swaps: usize,
    /// Experts copied over the network for this layer (migration moves with bytes > 0).
    pub moves: usize,
    /// Predicted expert + all-to-all seconds of the chosen placement over the window.
    pub predicted: f64,
    /// The same for the placement in force (NaN without one) ...
    pub predicted_keep: f64,
    /// ... and for the fresh placement.
    pub predicted_fresh: f64,
}

/// The placement of every layer with its per-layer report.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The chosen placement, all layers.
    pub placement: Placement,
    /// `[L]` what each layer took.
    pub layers: Vec<LayerReport>,
    /// Predicted exposed migration seconds of the chosen moves (0 without `previous`).
    pub migration_time: f64,
}

/// Layer l's candidates: the fresh placement (relabelled against the one in force), and with
/// a placement in force and `migration_aware`, keeping it and the incremental candidates
/// (these only while `deadline` has not passed).
fn plan_layer(
    l: usize,
    demand: &Demand,
    topo: &Topology,
    cost: &CostModel,
    previous: Option<&Placement>,
    opts: &Options,
    deadline: Option<Instant>,
) -> Result<LayerPlan> {
    let (e_n, dim) = (demand.num_experts, demand.num_chunks);
    let loads = demand.layer_loads(l);
    let chunks = demand.layer_chunks(l);
    let counts = count_replicas(loads, topo.num_slots())?;
    let predictor = Predictor::new(loads, chunks, dim, opts.exchanges, cost, topo);
    let shares = copy_shares(counts.iter().copied().max().unwrap_or(0) as usize, topo, cost, predictor.line());
    let items = Items::weighted(loads, chunks, dim, &counts, &shares);
    let (bins, top) = fresh_bins(&items, e_n, topo, opts, deadline);
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
        let incremental = if budget::passed(deadline) { Vec::new() } else { incremental_bins(&items, e_n, old, topo, top, opts) };
        for (swaps, mut b) in incremental {
            spread_copies(&items, e_n, &mut b, topo);
            let ex = as_experts(&items, &b);
            let layer: Vec<i32> =
                (0..topo.ep).flat_map(|r| fill_slots(&ex[r], &old[r * topo.slots_per_rank..(r + 1) * topo.slots_per_rank])).collect();
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
/// force, or None for a first placement. With `opts.time_budget`, layers stop improving once
/// it has passed (see [`Options::time_budget`]); the placement is valid either way.
pub fn routepack_placement(
    demand: &Demand,
    topo: &Topology,
    cost: &CostModel,
    previous: Option<&Placement>,
    opts: &Options,
) -> Result<Outcome> {
    let deadline = budget::deadline(Instant::now(), opts.time_budget);
    opts.check()?;
    topo.check_experts(demand.num_experts)?;
    cost.check(demand.num_layers)?;
    // every layer's candidates are kept until the migration choice: about four layers of
    // slots each, with their moves (40 bytes a slot), the packer's items and bins; then the
    // placement's tables
    Placement::check_policy_call("routepack's placement", demand.num_layers, topo.num_slots(), demand.num_experts, 4 * (4 + 40) + 64)?;
    if let Some(p) = previous {
        p.check_topology(topo)?;
        if p.num_layers != demand.num_layers || p.num_experts != demand.num_experts {
            return Err(invalid(
                "previous",
                format!(
                    "placement has L={}, E={} but the loads have L={}, E={}",
                    p.num_layers, p.num_experts, demand.num_layers, demand.num_experts
                ),
            ));
        }
    }
    let plans: Vec<LayerPlan> = (0..demand.num_layers)
        .into_par_iter()
        .map(|l| plan_layer(l, demand, topo, cost, previous, opts, deadline))
        .collect::<Result<_>>()?;
    let (pick, migration_time) = match previous {
        Some(_) if opts.migration_aware => choose(&plans, topo, cost),
        Some(_) => {
            let pick: Vec<usize> = plans.iter().map(|p| p.fresh).collect();
            let mut links = vec![LinkBytes::default(); topo.ep];
            for (lp, &c) in plans.iter().zip(&pick) {
                accumulate(&mut links, &lp.candidates[c].moves, topo, cost);
            }
            let t = cost.migration_time(&links);
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
