//! Which candidate each layer takes when a placement is in force: keep it, move part of the
//! way, or re-place, by predicted saving net of the exposed migration time of all layers'
//! moves together (priced by `CostModel::migration_time`, as `simulate::migration_time` does). Holds
//! [`Choice`], the kind of candidate a layer took, which the stage's report carries.

use crate::cost::links::LinkBytes;
use crate::cost::CostModel;
use crate::plan::ExpertMove;
use crate::topology::Topology;

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

/// One candidate placement of a layer: phy2log, predicted time, moves (migration),
/// kind, swaps.
pub(crate) struct Candidate {
    pub(crate) layer: Vec<i32>,
    pub(crate) time: f64,
    pub(crate) moves: Vec<ExpertMove>,
    pub(crate) choice: Choice,
    pub(crate) swaps: usize,
}

/// One layer's candidates, the fresh one among them.
pub(crate) struct LayerPlan {
    pub(crate) candidates: Vec<Candidate>,
    /// Index of the fresh candidate.
    pub(crate) fresh: usize,
}

/// Adds the bytes of migration moves `moves` to the per-rank links they cross (moves within a
/// rank cross none).
pub(crate) fn accumulate(links: &mut [LinkBytes], moves: &[ExpertMove], topo: &Topology, cost: &CostModel) {
    for mv in moves {
        LinkBytes::add_move(links, mv, topo, cost);
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
pub(crate) fn choose(plans: &[LayerPlan], topo: &Topology, cost: &CostModel) -> (Vec<usize>, f64) {
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
                    accumulate(&mut v, &c.moves, topo, cost);
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
    let mut now = cost.migration_time(&links);
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
                let net = gain - (cost.migration_time(&with) - now);
                if net > 0.0 && best.is_none_or(|b| net > b.0) {
                    best = Some((net, l, c));
                }
            }
        }
        let Some((_, l, c)) = best else { break };
        pick[l] = c;
        links = links_of(&pick);
        now = cost.migration_time(&links);
    }
    (pick, now)
}
