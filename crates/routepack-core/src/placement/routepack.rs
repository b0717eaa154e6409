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

use rayon::prelude::*;

use super::demand::Demand;
use super::pack::{Pack, Problem};
use super::relabel::{fill_slots, layout_layer};
use super::replicate::replicate;
use super::Placement;
use crate::cost::{CostModel, COMM_PASSES, COMPUTE_PASSES};
use crate::error::{invalid, Result};
use crate::migration::diff_layer;
use crate::plan::MigrationRow;
use crate::simulate::LinkBytes;
use crate::topology::Topology;

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
    /// the maximum back to `slack` (a fraction, >= slack): room to reorganise.
    pub explore: f64,
    /// Candidate swaps the fluctuation phase prices per layer (its time budget, counted).
    pub fluct_evals: usize,
    /// With `previous`: weigh keeping and incremental candidates against migration time.
    /// false = always the fresh placement, relabelled against `previous`.
    pub migration_aware: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { cells: 0, slack: 5e-5, explore: 0.01, fluct_evals: 8_000, migration_aware: true }
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

/// Replicas of one layer: weight, expert and chunk vector of each.
struct Items {
    weight: Vec<f64>,
    expert: Vec<u32>,
    vecs: Vec<f32>,
    dim: usize,
}

impl Items {
    fn new(loads: &[f64], chunks: &[f64], dim: usize, counts: &[u32]) -> Self {
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        let mut it = Items { weight: Vec::with_capacity(n), expert: Vec::with_capacity(n), vecs: Vec::with_capacity(n * dim), dim };
        for (e, &c) in counts.iter().enumerate() {
            let share = 1.0 / c as f64;
            for _ in 0..c {
                it.weight.push(loads[e] * share);
                it.expert.push(e as u32);
                it.vecs.extend(chunks[e * dim..(e + 1) * dim].iter().map(|x| (x * share) as f32));
            }
        }
        it
    }

    fn subset(&self, idx: &[usize]) -> Items {
        let d = self.dim;
        Items {
            weight: idx.iter().map(|&i| self.weight[i]).collect(),
            expert: idx.iter().map(|&i| self.expert[i]).collect(),
            vecs: idx.iter().flat_map(|&i| self.vecs[i * d..(i + 1) * d].iter().copied()).collect(),
            dim: d,
        }
    }

    fn problem(&self, num_experts: usize, bins: usize, cap: usize) -> Problem<'_> {
        Problem { weight: &self.weight, expert: &self.expert, num_experts, vecs: &self.vecs, dim: self.dim, bins, cap }
    }
}

/// The fluctuation phases of one packing whose min-max search reached `balanced`: a pass
/// allowed up to `explore` above it, then tightening back to `slack` at the least cost in
/// fluctuation. (A further pass within `slack` was measured to add nothing on `flash`.)
///
/// Should tightening fail to reach `slack` (few items per bin, or items too coarse to fill
/// the gap), the packing goes back to its balanced state and explores within `slack` only,
/// so the result never ends more than `slack` above `balanced`.
fn settle(s: &mut Pack, balanced: f64, opts: &Options, budget: usize) {
    if budget == 0 {
        return;
    }
    let target = balanced * (1.0 + opts.slack);
    let start = s.clone();
    // the budget is shared: exploring up to half, tightening up to three quarters, and a
    // fallback gets what is left (at least a quarter)
    let mut evals = 0;
    s.improve_fluct(balanced * (1.0 + opts.explore), usize::MAX, &mut evals, budget / 2);
    s.tighten(target, usize::MAX, &mut evals, budget - budget / 4);
    if s.max_load() > target {
        *s = start;
        s.improve_fluct(target.max(s.max_load()), usize::MAX, &mut evals, budget);
    }
}

/// Fresh node-then-rank packing of one layer's replicas. Returns `[ep]` item lists and the
/// largest rank load.
fn fresh_bins(items: &Items, num_experts: usize, topo: &Topology, opts: &Options) -> (Vec<Vec<usize>>, f64) {
    let (nodes, rpn, spr) = (topo.nodes_per_group(), topo.ranks_per_group_node(), topo.slots_per_rank);
    let n = items.weight.len();
    // an eighth of the budget for nodes: measured on `flash`, rank-level swaps lower the
    // per-microbatch peaks more per priced candidate (node-level swaps still help a little)
    let (node_budget, rank_budget) = if nodes > 1 { (opts.fluct_evals / 8, opts.fluct_evals - opts.fluct_evals / 8) } else { (0, opts.fluct_evals) };
    let node_of: Vec<usize> = if nodes > 1 {
        let p = items.problem(num_experts, nodes, rpn * spr);
        let mut s = Pack::lpt(&p);
        s.improve_max(f64::NEG_INFINITY, usize::MAX);
        let balanced = s.max_load();
        settle(&mut s, balanced, opts, node_budget);
        s.into_assignment()
    } else {
        vec![0; n]
    };
    let mut members: Vec<Vec<usize>> = vec![Vec::with_capacity(rpn * spr); nodes];
    for (i, &k) in node_of.iter().enumerate() {
        members[k].push(i);
    }
    let subs: Vec<Items> = members.iter().map(|m| items.subset(m)).collect();
    let probs: Vec<Problem> = subs.iter().map(|s| s.problem(num_experts, rpn, spr)).collect();
    let mut packs: Vec<Pack> = probs
        .iter()
        .map(|p| {
            let mut s = Pack::lpt(p);
            s.improve_max(f64::NEG_INFINITY, usize::MAX);
            s
        })
        .collect();
    let balanced = packs.iter().map(|s| s.max_load()).fold(f64::NEG_INFINITY, f64::max);
    // Nodes first can cost rank balance when ranks hold few replicas (the node split fixes
    // which replicas may pair up). Far from the bound, pack ranks directly too and go on with
    // whichever balances the heaviest rank better.
    let mean = items.weight.iter().sum::<f64>() / topo.ep as f64;
    let bound = mean.max(items.weight.iter().copied().fold(0.0, f64::max));
    if nodes > 1 && balanced > bound * (1.0 + 1e-3) {
        let p = items.problem(num_experts, topo.ep, spr);
        let mut s = Pack::lpt(&p);
        s.improve_max(f64::NEG_INFINITY, usize::MAX);
        let flat_balanced = s.max_load();
        if flat_balanced < balanced * (1.0 - 1e-12) {
            settle(&mut s, flat_balanced, opts, rank_budget);
            let mut flat = vec![Vec::with_capacity(spr); topo.ep];
            for (i, &b) in s.bin_of.iter().enumerate() {
                flat[b].push(i);
            }
            return (flat, s.max_load());
        }
    }
    for s in packs.iter_mut() {
        settle(s, balanced, opts, rank_budget / nodes);
    }
    let mut bins = vec![Vec::with_capacity(spr); topo.ep];
    let mut top = f64::NEG_INFINITY;
    for (k, s) in packs.iter().enumerate() {
        top = top.max(s.max_load());
        for (local, &b) in s.bin_of.iter().enumerate() {
            bins[k * rpn + b].push(members[k][local]);
        }
    }
    (bins, top)
}

/// Starting assignment from the old layer: replicas stay on ranks that hold their expert;
/// where the new count is lower, copies leave the ranks that are heaviest under the new
/// weights; added copies go heaviest first to the lightest rank with a free slot.
fn inherit(items: &Items, num_experts: usize, old: &[i32], topo: &Topology) -> Vec<usize> {
    let (ep, spr) = (topo.ep, topo.slots_per_rank);
    let n = items.weight.len();
    let mut first = vec![0usize; num_experts + 1];
    for &e in &items.expert {
        first[e as usize + 1] += 1;
    }
    let counts: Vec<usize> = first[1..].to_vec();
    for e in 0..num_experts {
        first[e + 1] += first[e];
    }
    let w = |e: usize| items.weight[first[e]];
    let mut holders: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
    let mut est = vec![0.0f64; ep];
    for (q, &e) in old.iter().enumerate() {
        if e >= 0 && (e as usize) < num_experts {
            holders[e as usize].push(q / spr);
            est[q / spr] += w(e as usize);
        }
    }
    for e in 0..num_experts {
        while holders[e].len() > counts[e] {
            let k = (0..holders[e].len()).fold(0, |b, k| if est[holders[e][k]] >= est[holders[e][b]] { k } else { b });
            est[holders[e][k]] -= w(e);
            holders[e].remove(k);
        }
    }
    let mut bin_of = vec![usize::MAX; n];
    let mut fill = vec![0usize; ep];
    let mut load = vec![0.0f64; ep];
    let mut mult = vec![0u16; ep * num_experts];
    for e in 0..num_experts {
        for (k, &r) in holders[e].iter().enumerate() {
            let i = first[e] + k;
            bin_of[i] = r;
            fill[r] += 1;
            load[r] += items.weight[i];
            mult[r * num_experts + e] += 1;
        }
    }
    let mut rest: Vec<usize> = (0..n).filter(|&i| bin_of[i] == usize::MAX).collect();
    rest.sort_by(|&a, &b| items.weight[b].total_cmp(&items.weight[a]).then(a.cmp(&b)));
    for i in rest {
        let e = items.expert[i] as usize;
        let limit = counts[e].div_ceil(ep).max(1) as u16;
        let pick = |strict: bool| {
            (0..ep)
                .filter(|&r| fill[r] < spr && (!strict || mult[r * num_experts + e] < limit))
                .fold(None, |b: Option<usize>, r| match b {
                    Some(x) if load[x] <= load[r] => Some(x),
                    _ => Some(r),
                })
        };
        let r = pick(true).or_else(|| pick(false)).expect("as many slots as replicas");
        bin_of[i] = r;
        fill[r] += 1;
        load[r] += items.weight[i];
        mult[r * num_experts + e] += 1;
    }
    bin_of
}

/// Incremental candidates: `(swaps, [ep] item lists)` after 0, 1, 2, 4, ... local-search swaps
/// from the inherited assignment, aiming at the fresh placement's largest rank load `target`:
/// min-max search down to `target`, the fluctuation pass with `explore` room, tightening
/// back to `target` (the phases of a fresh packing, over all ranks at once).
fn incremental_bins(items: &Items, num_experts: usize, old: &[i32], topo: &Topology, target: f64, opts: &Options) -> Vec<(usize, Vec<Vec<usize>>)> {
    let start = inherit(items, num_experts, old, topo);
    let p = items.problem(num_experts, topo.ep, topo.slots_per_rank);
    let mut s = Pack::from_assignment(&p, &start);
    let bins_of = |s: &Pack| {
        let mut b = vec![Vec::with_capacity(topo.slots_per_rank); topo.ep];
        for (i, &r) in s.bin_of.iter().enumerate() {
            b[r].push(i);
        }
        b
    };
    let base = s.swaps;
    let mut out = vec![(0, bins_of(&s))];
    let (mut phase, mut evals) = (0usize, 0usize);
    let budget = opts.fluct_evals;
    let mut limit = 1usize;
    while phase < 3 {
        let left = |s: &Pack| limit - (s.swaps - base);
        let finished = match phase {
            0 => s.improve_max(target, left(&s)),
            1 => s.improve_fluct(target * (1.0 + opts.explore), left(&s), &mut evals, budget / 2) || evals >= budget / 2,
            _ => s.tighten(target, left(&s), &mut evals, budget - budget / 4),
        };
        if finished {
            phase += 1;
        } else {
            limit *= 2;
        }
        let used = s.swaps - base;
        if used > out.last().expect("seeded").0 {
            out.push((used, bins_of(&s)));
        }
    }
    out
}

/// Expert lists of rank bins given as item lists.
fn as_experts(items: &Items, bins: &[Vec<usize>]) -> Vec<Vec<i32>> {
    bins.iter().map(|b| b.iter().map(|&i| items.expert[i] as i32).collect()).collect()
}

/// The predicted-time proxy of one layer's phy2log: Σ over cells of the largest rank load in
/// that cell (tokens), times the seconds one token on the critical rank costs (expert compute
/// and its all-to-all share), over the number of EP groups (each runs 1/G of the cells).
struct Predictor<'a> {
    /// `[E, C]` demand per cell (chunks merged into `cells` consecutive runs).
    cells: Vec<f64>,
    num_cells: usize,
    per_token: f64,
    groups: f64,
    topo: &'a Topology,
}

impl<'a> Predictor<'a> {
    fn new(loads: &[f64], chunks: &[f64], num_chunks: usize, opts: &Options, cost: &CostModel, topo: &'a Topology) -> Self {
        let e_n = loads.len();
        let (cells, num_cells) = if num_chunks == 0 {
            (loads.to_vec(), 1)
        } else {
            let c = if opts.cells == 0 { num_chunks } else { opts.cells.min(num_chunks) };
            let cell_of: Vec<usize> = (0..num_chunks).map(|b| b * c / num_chunks).collect();
            let mut v = vec![0.0; e_n * c];
            for (row, src) in v.chunks_exact_mut(c).zip(chunks.chunks_exact(num_chunks)) {
                for (&k, &x) in cell_of.iter().zip(src) {
                    row[k] += x;
                }
            }
            (v, c)
        };
        let (ep, rpn) = (topo.ep as f64, topo.ranks_per_group_node() as f64);
        let a2a = cost.token_bytes * ((rpn - 1.0) / ep / cost.bw_intra + (ep - rpn) / ep / cost.bw_inter);
        let per_token = COMPUTE_PASSES * cost.c_tok + 2.0 * COMM_PASSES * a2a;
        Self { cells, num_cells, per_token, groups: topo.num_groups() as f64, topo }
    }

    fn time(&self, layer: &[i32]) -> f64 {
        let (c_n, spr) = (self.num_cells, self.topo.slots_per_rank);
        let e_n = self.cells.len() / c_n;
        let mut cnt = vec![0u32; e_n];
        for &e in layer.iter().filter(|&&e| e >= 0) {
            cnt[e as usize] += 1;
        }
        let mut peak = vec![0.0f64; c_n];
        let mut rank = vec![0.0f64; c_n];
        for r in 0..self.topo.ep {
            rank.iter_mut().for_each(|x| *x = 0.0);
            for &e in layer[r * spr..(r + 1) * spr].iter().filter(|&&e| e >= 0) {
                let share = 1.0 / cnt[e as usize] as f64;
                for (x, &y) in rank.iter_mut().zip(&self.cells[e as usize * c_n..(e as usize + 1) * c_n]) {
                    *x += y * share;
                }
            }
            for (p, &x) in peak.iter_mut().zip(&rank) {
                *p = p.max(x);
            }
        }
        peak.iter().sum::<f64>() * self.per_token / self.groups
    }
}

/// One layer's candidates: phy2log, predicted time, moves (migration rows), kind, swaps.
struct Candidate {
    layer: Vec<i32>,
    time: f64,
    moves: Vec<MigrationRow>,
    choice: Choice,
    swaps: usize,
}

struct LayerPlan {
    candidates: Vec<Candidate>,
    /// Index of the fresh candidate.
    fresh: usize,
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

fn accumulate(links: &mut [LinkBytes], rows: &[MigrationRow], topo: &Topology) {
    for mv in rows {
        let (s, d) = (mv.src_rank as usize, mv.dst_rank as usize);
        if s != d {
            LinkBytes::add(links, s, d, mv.bytes, topo.local_node_of(s) == topo.local_node_of(d));
        }
    }
}

/// Picks one candidate per layer: starts from keeping every layer and repeatedly applies the
/// single layer change with the largest net saving (predicted time saved minus the increase
/// of the exposed migration time of all chosen moves), while one is positive.
///
/// A moving candidate is credited at most the fresh placement's predicted time: the fresh
/// search is the optimiser, the incremental ones only approximate it with fewer moves, and a
/// proxy "improvement" beyond it is noise, not a reason to move. So when the placement in
/// force is what the fresh search produces (unchanged loads), nothing moves.
fn choose(plans: &[LayerPlan], topo: &Topology, cost: &CostModel) -> (Vec<usize>, f64) {
    let credited = |lp: &LayerPlan, c: usize| {
        let cand = &lp.candidates[c];
        if cand.choice == Choice::Keep {
            cand.time
        } else {
            cand.time.max(lp.candidates[lp.fresh].time)
        }
    };
    let ep = topo.ep;
    // per-rank link bytes of every candidate's moves, summed once
    let own: Vec<Vec<Vec<LinkBytes>>> = plans
        .iter()
        .map(|lp| {
            lp.candidates
                .iter()
                .map(|c| {
                    let mut v = vec![LinkBytes::default(); ep];
                    accumulate(&mut v, &c.moves, topo);
                    v
                })
                .collect()
        })
        .collect();
    let mut pick = vec![0usize; plans.len()];
    let links_of = |pick: &[usize]| {
        let mut links = vec![LinkBytes::default(); ep];
        for (l, &c) in pick.iter().enumerate() {
            for (x, y) in links.iter_mut().zip(&own[l][c]) {
                x.merge(y, 1.0);
            }
        }
        links
    };
    let mut links = links_of(&pick);
    let mut now = LinkBytes::time(&links, cost);
    let mut with = vec![LinkBytes::default(); ep];
    for _ in 0..plans.iter().map(|p| p.candidates.len()).sum::<usize>() {
        let mut best: Option<(f64, usize, usize)> = None;
        for (l, lp) in plans.iter().enumerate() {
            let cur_time = credited(lp, pick[l]);
            for c in 0..lp.candidates.len() {
                let gain = cur_time - credited(lp, c);
                if c == pick[l] || gain <= 0.0 {
                    continue;
                }
                for r in 0..ep {
                    with[r] = links[r];
                    with[r].merge(&own[l][pick[l]][r], -1.0);
                    with[r].merge(&own[l][c][r], 1.0);
                }
                let net = gain - (LinkBytes::time(&with, cost) - now);
                if net > 0.0 && best.is_none_or(|b| net > b.0) {
                    best = Some((net, l, c));
                }
            }
        }
        let Some((_, l, c)) = best else { break };
        pick[l] = c;
        links = links_of(&pick);
        now = LinkBytes::time(&links, cost);
    }
    (pick, now)
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
    use crate::plan::Plan;
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
