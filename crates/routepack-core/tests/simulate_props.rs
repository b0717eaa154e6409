//! Property tests of `simulate`: arbitrary (also malformed) plans and cost models give `Err`,
//! never a panic, and a plan it prices has a finite positive step time.

mod common;

use common::{random_phy2log, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::placement::Placement;
use routepack_core::plan::{ExpertMove, Plan, Replica};
use routepack_core::simulate::simulate;
use routepack_core::validate::validate_plan;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn validate_and_simulate_never_panic(
        topo in topologies(),
        seed in any::<u64>(),
        sample_rank in prop::collection::vec(-1i32..9, 1..12),
        sample_micro in prop::collection::vec(-1i32..3, 1..12),
        num_micro in 0usize..3,
        reps in prop::collection::vec((-1i32..3, -1i32..3, -1i32..3, -1i32..4, -1i32..9, -1i32..9, prop_oneof![-1.0f32..2.0, Just(f32::NAN)]), 0..4),
        migs in prop::collection::vec((-1i32..3, -1i32..4, -1i32..9, -1i32..9, -1i32..40, -1i32..40, prop_oneof![-1.0f64..9.0, Just(f64::NAN)]), 0..4),
        bad_cost in 0usize..4,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(2);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, sample_rank.len(), layers, experts, 30);
        let placement = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
        let plan = Plan {
            placement,
            sample_rank,
            sample_micro,
            num_micro,
            replicas: reps.iter().map(|&(micro, group, layer, expert, src_rank, dst_rank, share)| Replica { micro, group, layer, expert, src_rank, dst_rank, share }).collect(),
            migration: migs.iter().map(|&(layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)| ExpertMove { layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes }).collect(),
        };
        let view = w.view();
        let _ = validate_plan(&plan, &view, &topo, 50);
        let mut cost = CostModel::for_tests(layers);
        match bad_cost {
            1 => cost.a_quad.push(0.0),
            2 => cost.bw_inter = f64::NAN,
            3 => cost.c_tok = -1.0,
            _ => {}
        }
        if let Ok(rep) = simulate(&plan, &view, &topo, &cost, Some(1 + mix.below(3))) {
            prop_assert!(bad_cost == 0 && validate_plan(&plan, &view, &topo, i64::MAX).is_ok());
            prop_assert!(rep.step_time.is_finite() && rep.step_time > 0.0);
        }
    }
}
