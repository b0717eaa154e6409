//! The simulator's exchanges one by one ([`super::simulate_terms`]): each exchange's parts as the
//! simulator summed them, and each EP rank's own attention and expert time, so that a timeline
//! of the step per rank (`routepack.timeline`) is drawn from the one cost model, not priced again.
//!
//! In exchange (g, m, l), EP rank r spends `attention[r]` on its cell's attention and waits
//! for the slowest rank (`LayerCost::attention` − `attention[r]`), then the dispatch, its
//! expert work `expert[r]` and the wait for the busiest rank (`LayerCost::expert` −
//! `expert[r]`), the combine and the exposed replication: every rank's parts add up to
//! `LayerCost::total` (the all-to-all less what is hidden), and the exchanges of a group to its
//! `SimReport::group_times` entry (without a pipeline).

use super::{GmResult, LayerCost};
use crate::cost::CostModel;

/// Every exchange of a plan as [`super::simulate_terms`] priced it. Indices: exchange
/// `x = (g · M + m) · L + l`; rank values `[x · ep + r]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeTerms {
    /// EP groups G, microbatches M, MoE layers L, EP ranks a group.
    pub shape: (usize, usize, usize, usize),
    /// `[G · M · L]` each exchange's parts (all passes; `LayerCost::total` its time).
    pub layer: Vec<LayerCost>,
    /// `[G · M · L]` the exposed replication split into (forward copies, gradient reduction).
    pub replication_parts: Vec<(f64, f64)>,
    /// `[G · M · L · ep]` each EP rank's attention over all compute passes (its cell's; the
    /// exchange's `LayerCost::attention` is their max).
    pub attention: Vec<f64>,
    /// `[G · M · L · ep]` each EP rank's expert time over all compute passes (the exchange's
    /// `LayerCost::expert` is their max).
    pub expert: Vec<f64>,
}

impl ExchangeTerms {
    /// From the simulator's per-(group, microbatch) results, gathered with their ranks' detail.
    pub(super) fn gather(per_gm: &[GmResult], shape: (usize, usize, usize, usize), cost: &CostModel) -> Self {
        let (g_n, m_n, l_n, ep) = shape;
        let n = g_n * m_n * l_n;
        let passes = cost.compute_passes();
        let mut out = Self {
            shape,
            layer: Vec::with_capacity(n),
            replication_parts: Vec::with_capacity(n),
            attention: Vec::with_capacity(n * ep),
            expert: Vec::with_capacity(n * ep),
        };
        for (layers, sums) in per_gm {
            for (l, (lc, _, rep)) in layers.iter().enumerate() {
                out.layer.push(*lc);
                out.replication_parts.push(*rep);
                let ranks = &sums.ranks[l * 2 * ep..(l + 1) * 2 * ep];
                out.attention.extend(ranks[..ep].iter().map(|a| passes * a));
                out.expert.extend(ranks[ep..].iter().map(|x| passes * x));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{simulate_in, simulate_terms, Scoring};
    use crate::cost::{CostModel, Overlap};
    use crate::placement::static_placement;
    use crate::plan::{Plan, Replica};
    use crate::topology::Topology;
    use crate::window::WindowView;

    #[test]
    fn every_ranks_parts_add_up_to_its_groups_time() {
        // 2 groups of 4 EP ranks on 2 nodes, 3 microbatches, a replica in one exchange
        let topo = Topology::new(8, 4, 2, 3).unwrap().with_replica_slots(1).unwrap();
        let (l_n, e_n, m_n) = (2, 8, 3);
        let s_n = 8 * m_n + 5;
        let seq: Vec<i64> = (0..s_n).map(|s| 5 + (s as i64 * 7) % 31).collect();
        let tok: Vec<i32> = (0..s_n * l_n * e_n).map(|i| ((i * 13 + i / 5) % 9) as i32 * i32::from(i % 3 != 0)).collect();
        let w = WindowView::new(&seq, &tok, l_n, e_n).unwrap();
        let cells: Vec<usize> = (0..s_n).map(|s| if s < 8 * m_n { s } else { (s * 5) % (8 * m_n) }).collect();
        let placement = static_placement(l_n, e_n, &topo).unwrap();
        let replicas = vec![Replica { group: 1, micro: 2, layer: 1, expert: 0, src_rank: 0, dst_rank: 3, share: 0.5 }];
        let plan = Plan {
            placement,
            sample_rank: cells.iter().map(|&c| (c / m_n) as i32).collect(),
            sample_micro: cells.iter().map(|&c| (c % m_n) as i32).collect(),
            num_micro: m_n,
            replicas,
            migration: vec![],
        };
        for overlap in [Overlap::None, Overlap::DispatchCombine] {
            let cost = CostModel { overlap, c_call: 1e-4, ..CostModel::for_tests(l_n) };
            let scoring = Scoring::default();
            let (report, terms) = simulate_terms(&plan, &w, &topo, &cost, &scoring).unwrap();
            assert_eq!(report, simulate_in(&plan, &w, &topo, &cost, &scoring).unwrap(), "the report is simulate's");
            let (g_n, _, _, ep) = terms.shape;
            for g in 0..g_n {
                for r in 0..ep {
                    let mut sum = 0.0;
                    for x in g * m_n * l_n..(g + 1) * m_n * l_n {
                        let lc = &terms.layer[x];
                        let (a, e) = (terms.attention[x * ep + r], terms.expert[x * ep + r]);
                        assert!(a <= lc.attention && e <= lc.expert, "a rank's part is at most the slowest's");
                        // own work, the waits for the slowest rank, the exchange's communication
                        sum += a + (lc.attention - a) + e + (lc.expert - e) + lc.all_to_all - lc.hidden + lc.replication;
                    }
                    let want = report.group_times[g];
                    assert!((sum - want).abs() <= 1e-12 * want.max(1.0), "group {g} rank {r}: {sum} vs {want}");
                }
            }
            assert!(terms.replication_parts.iter().any(|&(f, b)| f + b > 0.0), "the replica is priced");
        }
    }
}
