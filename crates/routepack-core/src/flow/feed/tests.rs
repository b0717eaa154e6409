//! The fast feed emits exactly the reference feed's flows, in the same order, on random
//! experts: up to 8 slots over 1-8 nodes, sparse and dense origins, large counts.

use proptest::prelude::*;

use super::{feed_slots, reference};
use crate::topology::Topology;

/// A flow as the feed emits it: (origin rank, destination rank, slot, tokens).
type Flow = (usize, usize, usize, i64);

fn flows(f: impl Fn(&mut Vec<i64>, &mut Vec<Flow>), origin: &[i64]) -> (Vec<Flow>, Vec<i64>) {
    let mut buf = origin.to_vec();
    let mut out = Vec::new();
    f(&mut buf, &mut out);
    (out, buf[..origin.len()].to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fast_feed_equals_the_reference(
        nodes in 1usize..=8,
        rpn in 1usize..=8,
        spr in 1usize..=4,
        c in 2usize..=8,
        dense in any::<bool>(),
        big in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let ep = nodes * rpn;
        let topo = Topology::new(ep, ep, rpn, spr).unwrap();
        let mut x = seed | 1;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let hi = if big { 1 << 40 } else { 60 };
        let origin: Vec<i64> = (0..ep).map(|_| if !dense && next(3) == 0 { 0 } else { next(hi) as i64 }).collect();
        let mut slots: Vec<usize> = (0..topo.num_slots()).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, next(i as u64 + 1) as usize);
        }
        slots.truncate(c.min(topo.num_slots()));
        slots.sort_unstable();
        prop_assume!(slots.len() >= 2);
        let fast = flows(|b, o| feed_slots(b, &slots, &topo, |a, d, p, n| o.push((a, d, p, n))), &origin);
        let slow = flows(|b, o| reference::feed_slots(b, &slots, &topo, |a, d, p, n| o.push((a, d, p, n))), &origin);
        prop_assert_eq!(fast, slow);
    }
}
