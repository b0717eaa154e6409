//! Property tests of `Placement::new`: arbitrary tables give `Err` or a placement that gives
//! every logical expert a slot, never a panic.

mod common;

use common::usizes;
use proptest::prelude::*;
use routepack_core::placement::Placement;

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

/// A placement must give every logical expert a slot (DESIGN.md): with no experts or no
/// slots there is nothing to place, and `check` would otherwise walk every (possibly
/// astronomically many) empty layer.
#[test]
fn empty_placements_are_refused() {
    assert!(Placement::new(vec![], 3, 0, 1).is_err(), "no experts");
    assert!(Placement::new(vec![0, 0], 2, 0, 1).is_err(), "num_experts = 0");
}
