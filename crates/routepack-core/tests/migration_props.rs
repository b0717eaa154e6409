//! Property tests of `migration::diff`: between random placements every move takes an expert
//! from a slot that holds it to one that will, and only mismatched shapes are refused.

mod common;

use common::{random_phy2log, topologies, Mix};
use proptest::prelude::*;
use routepack_core::migration::diff;
use routepack_core::placement::Placement;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn migration_diff_never_panics(topo in topologies(), seed in any::<u64>(), other in topologies()) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(2);
        let experts = 1 + mix.below(topo.num_slots().min(other.num_slots()));
        let a = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
        let b = Placement::new(random_phy2log(&mut mix, layers, experts, &other), layers, experts, other.slots_per_rank).unwrap();
        match diff(&a, &b, 7.0) {
            Ok(rows) => {
                prop_assert_eq!(a.num_slots, b.num_slots);
                for r in rows {
                    prop_assert_eq!(b.layer(r.layer as usize)[r.dst_slot as usize], r.expert);
                    prop_assert_eq!(a.layer(r.layer as usize)[r.src_slot as usize], r.expert);
                    prop_assert_eq!(r.bytes == 0.0, r.src_rank == r.dst_rank);
                }
            }
            Err(e) => prop_assert!(a.num_slots != b.num_slots || a.slots_per_rank != b.slots_per_rank, "{}", e),
        }
    }
}
