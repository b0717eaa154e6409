//! A fresh placement of one layer's replicas: nodes first (their loads set the inter-node
//! all-to-all), then the ranks of each node, each level packed by [`Pack`] and settled by the
//! microbatch-fluctuation phases. Past the stage's deadline each search phase not yet begun is
//! skipped (the greedy packing stands: valid, only less balanced).

use std::time::Instant;

use super::binpack::{with_capacities, Pack, Problem};
use super::items::Items;
use super::options::Options;
use super::spread::spread_copies;
use crate::budget::passed;
use crate::topology::Topology;

/// The fluctuation phases of one packing whose min-max search reached `balanced`: a pass
/// allowed up to `explore` above it, then tightening back to `slack` at the least cost in
/// fluctuation. (A further pass within `slack` was measured to add nothing on `flash`.)
///
/// Should tightening fail to reach `slack` (few items per bin, or items too coarse to fill
/// the gap), the packing goes back to its balanced state and explores within `slack` only,
/// so the result never ends more than `slack` above `balanced`.
pub(crate) fn settle(s: &mut Pack, balanced: f64, opts: &Options, budget: usize) {
    if budget == 0 {
        return;
    }
    let target = balanced * (1.0 + opts.slack);
    let start = s.clone();
    // the budget is shared: exploring up to half, tightening up to three quarters, and a
    // fallback gets what is left (at least a quarter)
    let mut evals = 0;
    s.improve_fluct(balanced * (1.0 + opts.explore()), usize::MAX, &mut evals, budget / 2);
    s.tighten(target, usize::MAX, &mut evals, budget - budget / 4);
    if s.max_load() > target {
        *s = start;
        s.improve_fluct(target.max(s.max_load()), usize::MAX, &mut evals, budget);
    }
}

/// Fresh node-then-rank packing of one layer's replicas. Returns `[ep]` item lists and the
/// largest rank load. `deadline` (the stage's, None without a budget): once passed, the
/// min-max searches, fluctuation phases and the flat alternative not yet begun are skipped.
pub(crate) fn fresh_bins(
    items: &Items,
    num_experts: usize,
    topo: &Topology,
    opts: &Options,
    deadline: Option<Instant>,
) -> (Vec<Vec<usize>>, f64) {
    let (nodes, rpn, spr) = (topo.nodes_per_group(), topo.ranks_per_group_node(), topo.slots_per_rank);
    let n = items.weight.len();
    // an eighth of the budget for nodes: measured on `flash`, rank-level swaps lower the
    // per-microbatch peaks more per priced candidate (node-level swaps still help a little)
    let (node_budget, rank_budget) =
        if nodes > 1 { (opts.fluct_evals / 8, opts.fluct_evals - opts.fluct_evals / 8) } else { (0, opts.fluct_evals) };
    // the node level explores the same absolute band of load as the rank level (`explore`
    // of a rank's load, a node holding `rpn` ranks): a node's many replicas leave room enough,
    // and a wider band makes tightening back fall to the min-max search far more often
    let node_opts = Options { explore: Some((opts.explore() / rpn as f64).max(opts.slack)), ..opts.clone() };
    let node_of: Vec<usize> = if nodes > 1 {
        let p = items.problem(num_experts, nodes, rpn * spr);
        let mut s = Pack::lpt(&p);
        if !passed(deadline) {
            s.improve_max(f64::NEG_INFINITY, usize::MAX, 0);
        }
        let balanced = s.max_load();
        if !passed(deadline) {
            settle(&mut s, balanced, &node_opts, node_budget);
        }
        s.into_assignment()
    } else {
        vec![0; n]
    };
    let (members, subs) = items.split(&node_of, nodes);
    let probs: Vec<Problem> = subs.iter().map(|s| s.problem(num_experts, rpn, spr)).collect();
    let mut packs: Vec<Pack> = probs.iter().map(Pack::lpt).collect();
    // The heaviest rank of the layer sets the balanced level the fluctuation phases work
    // under, so the node whose greedy packing is heaviest is searched first, in full, and
    // each other node only until its heaviest rank is no heavier than the level so far
    // (searching it further would only be undone by the fluctuation phase's exploring).
    let mut by_load: Vec<usize> = (0..nodes).collect();
    by_load.sort_by(|&x, &y| packs[y].max_load().total_cmp(&packs[x].max_load()).then(x.cmp(&y)));
    let mut balanced = f64::NEG_INFINITY;
    for k in by_load {
        if !passed(deadline) {
            packs[k].improve_max(balanced, usize::MAX, 0);
        }
        balanced = balanced.max(packs[k].max_load());
    }
    // Nodes first can cost rank balance when ranks hold few replicas (the node split fixes
    // which replicas may pair up). Far from the bound, pack ranks directly too and go on with
    // whichever balances the heaviest rank better. (Searching across nodes from the node-first
    // packing instead of a fresh greedy one was cheaper, but often ended above what the greedy
    // packing alone reaches, EPLB's packing: 26 layers in 15,207 random cases trailed EPLB
    // against 2 from the greedy start.)
    let mean = items.weight.iter().sum::<f64>() / topo.ep as f64;
    let bound = mean.max(items.weight.iter().copied().fold(0.0, f64::max));
    if nodes > 1 && balanced > bound * (1.0 + 1e-3) && !passed(deadline) {
        let p = items.problem(num_experts, topo.ep, spr);
        let mut s = Pack::lpt(&p);
        s.improve_max(f64::NEG_INFINITY, usize::MAX, 0);
        let flat_balanced = s.max_load();
        if flat_balanced < balanced * (1.0 - 1e-12) {
            settle(&mut s, flat_balanced, opts, rank_budget);
            let mut flat = with_capacities(topo.ep, spr);
            for (i, &b) in s.bin_of.iter().enumerate() {
                flat[b].push(i);
            }
            // the flat packing limits copies per rank only: spread them over nodes, where that
            // costs no balance (this packing was taken for its balance)
            let mut spread = flat.clone();
            if spread_copies(items, num_experts, &mut spread, topo) > 0 {
                let top = spread.iter().map(|b| b.iter().map(|&i| items.weight[i]).sum::<f64>()).fold(f64::NEG_INFINITY, f64::max);
                if top <= s.max_load() {
                    return (spread, top);
                }
            }
            return (flat, s.max_load());
        }
    }
    for s in packs.iter_mut() {
        if !passed(deadline) {
            settle(s, balanced, opts, rank_budget / nodes);
        }
    }
    let mut bins = with_capacities(topo.ep, spr);
    let mut top = f64::NEG_INFINITY;
    for (k, s) in packs.iter().enumerate() {
        top = top.max(s.max_load());
        for (local, &b) in s.bin_of.iter().enumerate() {
            bins[k * rpn + b].push(members[k][local]);
        }
    }
    (bins, top)
}
