//! Property tests of `Topology::new` (and the static placement built on it): any sizes give
//! `Err` or a consistent topology, never a panic.

mod common;

use common::usizes;
use proptest::prelude::*;
use routepack_core::placement::static_placement;
use routepack_core::topology::Topology;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn topology_and_static_placement_never_panic(dp in usizes(), ep in usizes(), gpn in usizes(), spr in usizes(), layers in 0usize..3, experts in 0usize..12) {
        if let Ok(topo) = Topology::new(dp, ep, gpn, spr) {
            prop_assert!(dp >= 1 && ep >= 1 && dp % ep == 0);
            let _ = topo.check_experts(experts);
            if topo.check_experts(experts).is_ok() && (spr as u128) * (ep as u128) <= 64 {
                let p = static_placement(layers, experts, &topo);
                prop_assert_eq!(p.is_ok(), layers >= 1 && experts >= 1);
            }
        }
    }
}
