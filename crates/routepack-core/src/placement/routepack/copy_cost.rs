//! What one placement copy of an expert costs the rank that hosts it, per token of the
//! expert's load: the packer's weight of a replica (`Items::weighted`).
//!
//! The all-to-all is receiver-bound on `flash` (the slowest EP rank's incoming bytes set every
//! exchange's time), and what a rank receives over the slow inter-node link is not its token
//! load: `flow` feeds each copy from its own rank, then its node, then the other nodes, so a
//! copy of an expert with copies on every node receives almost nothing across nodes, while a
//! lone copy receives the tokens of every other node. Balancing token loads alone left the
//! slowest rank's receiving link time at 1.119 of the mean of a `flash` layer (median over
//! layers, aggregate loads of one window), with token loads within 0.02%; with these weights
//! it is 1.059, the tokens 1.089.
//!
//! So a copy weighs, per token of its expert's load (`copy_shares`):
//! compute `3·per_token / c` (an even split over the c copies, at the expert curve's slope,
//! `CostModel::expert_line`: `c_tok` for the linear model; weighed
//! `COMPUTE_WEIGHT` times) plus
//! the receiving all-to-all of its tokens from other ranks of its node and from other nodes,
//! each over its link (`CostModel::link_time`, dispatch and combine, forward and backward:
//! `CostModel::all_to_all_of_link_time`), under these assumptions:
//! * tokens of the expert originate evenly over the EP group's ranks (the packing, which
//!   decides where samples run, comes later);
//! * the c copies lie on distinct nodes as far as they can: ceil(c / nodes) on a node at most,
//!   as the node-level packing and `spread` keep them;
//! * each copy takes an even split, fed node first (`flow`).
//!
//! Weights are normalised by a lone copy's, so an expert with one copy weighs its load. A
//! group inside one node has one link for every byte; there the weight stays the even split
//! `1/c` (the old packing, its plans unchanged).

use crate::cost::{CostModel, ExpertLine};
use crate::topology::Topology;

/// How much more a copy's expert compute weighs than the cost model's seconds say, next to
/// its receiving all-to-all. The packer balances one weight per rank, the sum of the two,
/// while the step pays each exchange's slowest rank of each separately, and the replication
/// stage later relieves the hottest receivers (not the compute) further. Measured on `flash`
/// (windows 1-3 after the first, routepack preset, step seconds summed over the three):
/// 304.6 with the even split, 298.7 at weight 1, 297.4 at 2, 296.9 at 3, 296.6 at 5, 297.1 at
/// 8 (layout noise about ±0.3 per window); 4 sits in the flat part.
const COMPUTE_WEIGHT: f64 = 4.0;

/// (tokens from other ranks of the node, tokens from other nodes) one copy receives on
/// average, as fractions of the expert's load, when the expert has `c` >= 1 copies over
/// `nodes` nodes of `rpn` ranks each (see the module docs).
fn received_fractions(c: usize, nodes: usize, rpn: usize) -> (f64, f64) {
    let (ep, cf) = ((nodes * rpn) as f64, c as f64);
    let own = 1.0 / ep; // what the copy's own rank sends it (no link)
    let node_supply = rpn as f64 / ep; // what each node's ranks send the expert
    let (mut intra, mut inter) = (0.0, 0.0);
    for n in 0..nodes {
        // the copies of node n, spread as evenly as possible
        let k = c / nodes + usize::from(n < c % nodes);
        if k == 0 {
            continue;
        }
        let kf = k as f64;
        let want = kf / cf; // the node's copies' even split
        let local = (node_supply - kf * own).min(want - kf * own).max(0.0);
        intra += local;
        inter += (want - kf * own - local).max(0.0);
    }
    (intra / cf, inter / cf)
}

/// Per-copy weight multipliers `[max_count + 1]`: entry c is one copy's cost per token of its
/// expert's load when the expert has c copies, over a lone copy's (entry 0 unused, 0.0); a
/// copy's compute per token is `line.per_token` (the layer's expert curve,
/// `predict::Predictor::line`). With one node per group, or a cost model without per-token
/// terms, the even split 1/c.
pub(crate) fn copy_shares(max_count: usize, topo: &Topology, cost: &CostModel, line: &ExpertLine) -> Vec<f64> {
    let (nodes, rpn) = (topo.nodes_per_group(), topo.ranks_per_group_node());
    let even: Vec<f64> = (0..=max_count).map(|c| if c == 0 { 0.0 } else { 1.0 / c as f64 }).collect();
    if nodes < 2 {
        return even;
    }
    let compute = cost.compute_passes() * line.per_token;
    let per_intra = cost.all_to_all_of_link_time(cost.link_time(cost.token_bytes, true));
    let per_inter = cost.all_to_all_of_link_time(cost.link_time(cost.token_bytes, false));
    let time = |c: usize| {
        let (intra, inter) = received_fractions(c, nodes, rpn);
        COMPUTE_WEIGHT * compute / c as f64 + per_intra * intra + per_inter * inter
    };
    let lone = time(1);
    if !(lone.is_finite() && lone > 0.0) {
        return even;
    }
    (0..=max_count).map(|c| if c == 0 { 0.0 } else { time(c) / lone }).collect()
}

/// All-to-all seconds one copy receives per token of its expert's load, `[max_count + 1]` by
/// copy count (entry 0 unused, 0.0): its share from the other ranks of its node over the
/// intra-node link and from other nodes over the inter-node link, under the assumptions
/// above (what the weights of [`copy_shares`] hold besides compute, unnormalised).
pub(crate) fn receive_seconds(max_count: usize, topo: &Topology, cost: &CostModel) -> Vec<f64> {
    let (nodes, rpn) = (topo.nodes_per_group(), topo.ranks_per_group_node());
    let per_intra = cost.all_to_all_of_link_time(cost.link_time(cost.token_bytes, true));
    let per_inter = cost.all_to_all_of_link_time(cost.link_time(cost.token_bytes, false));
    (0..=max_count)
        .map(|c| {
            if c == 0 {
                return 0.0;
            }
            let (intra, inter) = received_fractions(c, nodes, rpn);
            per_intra * intra + per_inter * inter
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every copy's tokens are accounted for: own rank + node + other nodes = the even split.
    #[test]
    fn fractions_add_up_to_the_even_split() {
        for (nodes, rpn) in [(2, 4), (4, 8), (3, 2), (8, 1)] {
            let ep = nodes * rpn;
            for c in 1..=ep {
                let (intra, inter) = received_fractions(c, nodes, rpn);
                let own = 1.0 / ep as f64;
                assert!(intra >= 0.0 && inter >= 0.0, "c={c}");
                assert!((intra + inter + own - 1.0 / c as f64).abs() < 1e-12, "nodes={nodes} rpn={rpn} c={c}");
            }
        }
    }

    /// The fractions are what `flow::route_expert` delivers: an expert's tokens from every
    /// rank of the group (as many from each), its copies spread as the packer keeps them
    /// (copy j on node j mod nodes, the node's ranks in turn), each copy's intra- and
    /// inter-node tokens counted from the router's flows, averaged over the copies. Inter-node
    /// tokens match; intra-node ones to within one rank's share of the load (1/ep), as the router fills
    /// copies in slot order, so a rank's tokens can feed an earlier copy of its node before
    /// its own (the model keeps every rank's tokens for its own copy).
    #[test]
    fn fractions_are_what_the_router_delivers() {
        use crate::flow::route_expert;
        for (ep, gpn) in [(32usize, 8usize), (8, 4), (12, 4), (16, 2)] {
            let topo = Topology::new(ep, ep, gpn, 4).unwrap();
            let (nodes, rpn) = (topo.nodes_per_group(), topo.ranks_per_group_node());
            let per_rank = 1_000_000i64; // large: the router's rounding is below the tolerance
            let origin = vec![per_rank; ep];
            for c in 1..=ep.min(2 * nodes + 1) {
                let mut slots: Vec<usize> = (0..c).map(|j| (j % nodes) * rpn + j / nodes).map(|r| r * 4).collect();
                slots.sort_unstable();
                let (mut intra, mut inter) = (0i64, 0i64);
                let mut scratch = Vec::new();
                route_expert(&origin, &slots, &[], &topo, &mut scratch, |from, to, _, n| {
                    if from != to {
                        if from / rpn == to / rpn {
                            intra += n
                        } else {
                            inter += n
                        }
                    }
                });
                let total = (per_rank * ep as i64) as f64;
                let (fi, fe) = received_fractions(c, nodes, rpn);
                let (mi, me) = (intra as f64 / total / c as f64, inter as f64 / total / c as f64);
                assert!(
                    (fi - mi).abs() < 1.0 / ep as f64 && (fe - me).abs() < 1e-5,
                    "ep={ep} gpn={gpn} c={c}: model ({fi}, {fe}), router ({mi}, {me})"
                );
            }
        }
    }

    /// A lone copy receives the other nodes' tokens; a copy per node receives none across.
    #[test]
    fn copies_on_every_node_receive_nothing_across() {
        let (lone_intra, lone_inter) = received_fractions(1, 4, 8);
        assert!((lone_inter - 0.75).abs() < 1e-12 && (lone_intra - 7.0 / 32.0).abs() < 1e-12);
        assert_eq!(received_fractions(4, 4, 8).1, 0.0);
        assert!((received_fractions(2, 4, 8).1 - 0.25).abs() < 1e-12);
    }

    /// A lone copy weighs 1; an expert's copies together never weigh more than one lone copy
    /// (compute is split, and more of its tokens stay on their rank or node); a copy on every
    /// node weighs less than its even split; inside one node the shares are the even split.
    #[test]
    fn shares_fall_with_copies() {
        let cost = CostModel::for_tests(1);
        let topo = Topology::new(64, 32, 8, 17).unwrap();
        let s = copy_shares(8, &topo, &cost, &cost.expert_line(0.0));
        assert_eq!(s[1], 1.0);
        assert!((1..=8).all(|c| c as f64 * s[c] <= 1.0 + 1e-12), "{s:?}");
        // a replica of an expert with a copy on every node costs less than its even split
        assert!(s[4] < 0.25, "{s:?}");
        let one_node = Topology::new(16, 8, 8, 17).unwrap();
        assert_eq!(copy_shares(3, &one_node, &cost, &cost.expert_line(0.0)), vec![0.0, 1.0, 0.5, 1.0 / 3.0]);
    }
}
