//! Copies of one expert on distinct nodes. `flow` feeds a copy from its own node first, so two
//! copies of an expert on one node, while another node has none, make that other node's
//! tokens cross to reach either: the node-level packing of a fresh placement never does this
//! (`binpack` keeps at most ceil(copies / nodes) on a node), but the flat packings over all
//! ranks (incremental candidates, the fresh placement's flat alternative) limit copies per
//! rank only. [`spread_copies`] repairs what they leave, each repair a swap with the item of
//! closest weight on the emptier node, so the rank loads barely move.
//!
//! Measured on `flash` (3 windows after the first, routepack preset): placements with every
//! expert's copies spread simulate 0.5–0.8% faster than the flat packings left them; the
//! choice between candidates still weighs the extra moves.

use super::items::Items;
use crate::topology::Topology;

/// Moves copies so that no node holds more than ceil(copies / nodes) copies of an expert,
/// where a swap that keeps every other expert within the same limit exists. `bins`: `[ep]`
/// item lists (indices into `items`). Experts in ascending order, deterministic. Returns the
/// swaps made.
pub(crate) fn spread_copies(items: &Items, num_experts: usize, bins: &mut [Vec<usize>], topo: &Topology) -> usize {
    let (ep, rpn) = (bins.len(), topo.ranks_per_group_node());
    let nodes = ep.div_ceil(rpn);
    if nodes < 2 {
        return 0;
    }
    let mut copies = vec![0usize; num_experts];
    for &e in &items.expert {
        copies[e as usize] += 1;
    }
    // [nodes · E] copies of each expert on each node
    let mut on = vec![0usize; nodes * num_experts];
    for (r, b) in bins.iter().enumerate() {
        for &i in b {
            on[(r / rpn) * num_experts + items.expert[i] as usize] += 1;
        }
    }
    let limit = |e: usize| copies[e].div_ceil(nodes);
    let mut swaps = 0;
    // A repair of a later expert can free the partner an earlier one lacked, so passes repeat
    // until one makes no swap. Each swap lowers the total excess (copies above the limit, over
    // every node and expert) by one, so the passes end.
    loop {
        let before = swaps;
        for e in (0..num_experts).filter(|&e| copies[e] > 1) {
            loop {
                // the fullest node beyond the limit (lowest index on ties)
                let count = |n: usize| on[n * num_experts + e];
                let src = (0..nodes).filter(|&n| count(n) > limit(e)).fold(None, |b: Option<usize>, n| match b {
                    Some(x) if count(x) >= count(n) => Some(x),
                    _ => Some(n),
                });
                let Some(src) = src else { break };
                // the copy on src's last rank holding one
                let (pr, pk) = (src * rpn..((src + 1) * rpn).min(ep))
                    .rev()
                    .find_map(|r| bins[r].iter().position(|&i| items.expert[i] as usize == e).map(|k| (r, k)))
                    .expect("src holds a copy");
                let we = items.weight[bins[pr][pk]];
                // the nodes that may gain a copy, emptiest first (lowest index on ties); on the
                // first that has one, the partner of closest weight whose expert may gain a copy
                // on src
                let mut dsts: Vec<usize> = (0..nodes).filter(|&n| count(n) < limit(e)).collect();
                dsts.sort_by_key(|&n| (count(n), n));
                let mut best: Option<(f64, usize, usize)> = None;
                // a swap must not put a second copy on a rank: x must be absent from pr, e from r
                let holds = |r: usize, x: usize| bins[r].iter().any(|&i| items.expert[i] as usize == x);
                for dst in dsts {
                    for (r, bin) in bins.iter().enumerate().take(((dst + 1) * rpn).min(ep)).skip(dst * rpn) {
                        if holds(r, e) {
                            continue;
                        }
                        for (k, &i) in bin.iter().enumerate() {
                            let x = items.expert[i] as usize;
                            if x == e || on[src * num_experts + x] + 1 > limit(x) || holds(pr, x) {
                                continue;
                            }
                            let gap = (items.weight[i] - we).abs();
                            if best.is_none_or(|b| gap < b.0) {
                                best = Some((gap, r, k));
                            }
                        }
                    }
                    if best.is_some() {
                        break;
                    }
                }
                let Some((_, qr, qk)) = best else { break };
                let dst = qr / rpn;
                let (i, j) = (bins[pr][pk], bins[qr][qk]);
                let x = items.expert[j] as usize;
                bins[pr][pk] = j;
                bins[qr][qk] = i;
                on[src * num_experts + e] -= 1;
                on[dst * num_experts + e] += 1;
                on[dst * num_experts + x] -= 1;
                on[src * num_experts + x] += 1;
                swaps += 1;
            }
        }
        if swaps == before {
            break;
        }
    }
    swaps
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Copies of each expert on each node.
    fn per_node(items: &Items, e_n: usize, bins: &[Vec<usize>], rpn: usize) -> Vec<usize> {
        let mut on = vec![0usize; bins.len().div_ceil(rpn) * e_n];
        for (r, b) in bins.iter().enumerate() {
            for &i in b {
                on[(r / rpn) * e_n + items.expert[i] as usize] += 1;
            }
        }
        on
    }

    proptest! {
        /// Any packing of replicas onto ranks (a shuffle of the items into full ranks): the
        /// repair keeps every rank's size and the items, never leaves an expert more crowded
        /// on a node than before, and, when single-copy experts are the majority (a partner
        /// is then always at hand), leaves no node above ceil(copies / nodes).
        #[test]
        fn copies_end_spread_over_nodes(seed in any::<u64>(), nodes in 2usize..5, rpn in 1usize..4, spr in 2usize..5) {
            use rand::{RngExt, SeedableRng};
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
            let ep = nodes * rpn;
            let slots = ep * spr;
            // a few experts with 2..=nodes+1 copies, the rest single
            let mut counts = Vec::new();
            let mut left = slots;
            while left > 0 {
                let c = if counts.len() % 4 == 0 { rng.random_range(2..=nodes + 1).min(left) } else { 1 };
                counts.push(c as u32);
                left -= c;
            }
            let e_n = counts.len();
            let loads: Vec<f64> = (0..e_n).map(|_| rng.random_range(1..100) as f64).collect();
            let items = Items::new(&loads, &[], 0, &counts);
            let mut ids: Vec<usize> = (0..slots).collect();
            for i in (1..slots).rev() {
                ids.swap(i, rng.random_range(0..=i));
            }
            let mut bins: Vec<Vec<usize>> = ids.chunks(spr).map(|c| c.to_vec()).collect();
            let before = per_node(&items, e_n, &bins, rpn);
            let before_bins = bins.clone();
            let topo = Topology::new(ep, ep, rpn, spr).unwrap();
            spread_copies(&items, e_n, &mut bins, &topo);
            prop_assert!(bins.iter().all(|b| b.len() == spr));
            let mut all: Vec<usize> = bins.concat();
            all.sort_unstable();
            prop_assert_eq!(all, (0..slots).collect::<Vec<_>>());
            let after = per_node(&items, e_n, &bins, rpn);
            // and never crowds a rank: per rank, no expert gains a copy it already had
            let ranks_before = per_node(&items, e_n, &before_bins, 1);
            let ranks_after = per_node(&items, e_n, &bins, 1);
            for e in 0..e_n {
                let worst = |on: &[usize]| (0..ep).map(|r| on[r * e_n + e]).max().unwrap();
                prop_assert!(worst(&ranks_after) <= worst(&ranks_before).max(1), "expert {} crowds a rank", e);
            }
            let single = counts.iter().filter(|&&c| c == 1).count();
            for e in 0..e_n {
                let limit = (counts[e] as usize).div_ceil(nodes);
                let worst = |on: &[usize]| (0..nodes).map(|n| on[n * e_n + e]).max().unwrap();
                prop_assert!(worst(&after) <= worst(&before).max(limit), "expert {}", e);
                if 2 * single > e_n {
                    prop_assert!(worst(&after) <= limit, "expert {} has {} copies on one node, limit {}", e, worst(&after), limit);
                }
            }
        }
    }
}
