//! Property tests of `Placement::new`: arbitrary tables give `Err` or a placement that gives
//! every logical expert a slot, never a panic.

mod common;

use common::usizes;
use proptest::prelude::*;
use routepack_core::placement::{static_placement, Placement};
use routepack_core::sizes;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn placement_new_never_panics(vals in prop::collection::vec(-3i32..9, 0..24), layers in usizes(), experts in 1usize..10, spr in usizes()) {
        if let Ok(p) = Placement::new(vals.clone(), layers, experts, spr) {
            prop_assert!(layers >= 1 && spr >= 1 && vals.len() % layers == 0);
            prop_assert!(p.logcnt().iter().all(|&c| c >= 1));
        }
    }
}

/// A placement must give every logical expert a slot (docs/design.md): with no experts or no
/// slots there is nothing to place, and `check` would otherwise walk every (possibly
/// astronomically many) empty layer.
#[test]
fn empty_placements_are_refused() {
    assert!(Placement::new(vec![], 3, 0, 1).is_err(), "no experts");
    assert!(Placement::new(vec![0, 0], 2, 0, 1).is_err(), "num_experts = 0");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// The static placement's table is sized by its arguments: past the ceiling it is refused
    /// naming the larger of its factors (`num_layers` or `topo.slots_per_rank`) and the bytes
    /// before anything is allocated; below it (small here) it is built.
    #[test]
    fn static_placement_checks_its_size_first(layers in 1usize..1 << 30, ep_log in 0u32..4, spr_log in 0u32..31) {
        let ep = 1usize << ep_log;
        let spr = 1usize << spr_log;
        let Ok(topo) = routepack_core::Topology::new(ep, ep, 1, spr) else { return Ok(()) };
        let bytes = sizes::table_bytes(&[layers, ep * spr], 4);
        if bytes > sizes::MAX_TABLE_BYTES {
            let e = static_placement(layers, 1, &topo).unwrap_err().to_string();
            let arg = if layers >= ep * spr { "num_layers" } else { "topo.slots_per_rank" };
            prop_assert!(e.starts_with(&format!("{arg}: phy2log")) && e.contains(&bytes.to_string()), "{e}");
        } else if bytes <= 1 << 16 {
            let p = static_placement(layers, 1, &topo).unwrap();
            prop_assert_eq!(p.phy2log.len(), layers * ep * spr);
        }
    }

    /// `log2phy` grows with E × the largest replica count, so a small `phy2log` can ask for
    /// a huge table: refused past the ceiling naming `placement.phy2log`, built below it.
    #[test]
    fn log2phy_checks_its_size_first(experts in 1usize..200, copies in 0usize..200, huge in any::<bool>()) {
        let (experts, copies) = if huge { (65536, 65537) } else { (experts, copies) };
        let mut row: Vec<i32> = (0..experts as i32).collect();
        row.extend(std::iter::repeat_n(0, copies));
        let p = Placement::new(row, 1, experts, 1).unwrap();
        match p.log2phy() {
            Ok((t, r)) => {
                prop_assert!(!huge && r == copies + 1 && t.len() == experts * r);
            }
            Err(e) => prop_assert!(huge && e.to_string().starts_with("placement.phy2log: log2phy"), "{e}"),
        }
    }
}
