//! Property tests of `packing::sequential` (and the `packing::rows` cap check it applies):
//! never over the cap, plans built from it with the static placement pass `validate_plan` and
//! price under `simulate`, an over-long sample is named, malformed input gives `Err`.

mod common;

use common::{cell_tokens, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::error::Error;
use routepack_core::packing::rows::check_cap;
use routepack_core::packing::sequential::sequential;
use routepack_core::placement::static_placement;
use routepack_core::plan::Plan;
use routepack_core::simulate::simulate;
use routepack_core::validate::validate_plan;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn sequential_respects_cap_and_static_plans_validate(
        topo in topologies(),
        seed in any::<u64>(),
        samples in 1usize..40,
        layers in 1usize..3,
        cap_extra in 0i64..200,
    ) {
        let mut mix = Mix(seed);
        let experts = 1 + mix.below(topo.num_slots().min(8));
        let w = window(&mut mix, samples, layers, experts, 100);
        let cap = *w.seq_lens.iter().max().unwrap() + cap_extra;
        let packed = sequential(&w.seq_lens, cap, topo.dp);
        let p = match packed {
            Err(Error::Infeasible(msg)) => {
                // refused only when the ranks cannot all be filled: fewer samples than ranks, or
                // proven to need more rows than samples (first fit opening too many rows falls
                // back to the certified rows, issue 13)
                prop_assert!(samples < topo.dp || msg.contains("needs at least"), "{msg}");
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
            Ok(p) => p,
        };
        prop_assert_eq!(p.sample_rank.len(), samples);
        let placement = static_placement(layers, experts, &topo).unwrap();
        let plan = Plan {
            placement,
            sample_rank: p.sample_rank.clone(),
            sample_micro: p.sample_micro.clone(),
            num_micro: p.num_micro,
            replicas: vec![],
            migration: vec![],
        };
        let tokens = cell_tokens(&plan, &w.seq_lens, topo.dp);
        prop_assert!(tokens.iter().all(|&t| t > 0 && t <= cap), "cells {:?} cap {}", tokens, cap);
        prop_assert_eq!(tokens.iter().sum::<i64>(), w.seq_lens.iter().sum::<i64>());
        let view = w.view();
        prop_assert!(validate_plan(&plan, &view, &topo, cap).is_ok());
        let rep = simulate(&plan, &view, &topo, &CostModel::for_tests(layers), None).unwrap();
        prop_assert!(rep.step_time.is_finite() && rep.step_time > 0.0);
        let parts = rep.attention + rep.expert + rep.all_to_all + rep.replication + rep.migration;
        prop_assert!((parts - rep.step_time).abs() <= 1e-9 * rep.step_time);
    }

    #[test]
    fn a_sample_over_the_cap_is_named(lens in prop::collection::vec(1i64..50, 1..20), pick in any::<prop::sample::Index>(), dp in 1usize..4) {
        let mut lens = lens;
        let s = pick.index(lens.len());
        lens[s] = 100;
        let first = lens.iter().position(|&n| n > 60).unwrap();
        match sequential(&lens, 60, dp) {
            Err(Error::Infeasible(msg)) => prop_assert!(msg.contains(&format!("sample {first} has 100 tokens")), "{msg}"),
            other => return Err(TestCaseError::fail(format!("expected Infeasible, got {other:?}"))),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn packing_never_panics(lens in prop::collection::vec(-3i64..40, 0..20), cap in prop_oneof![-2i64..60, Just(i64::MAX)], dp in 0usize..6) {
        let _ = check_cap(&lens, cap);
        if let Ok(p) = sequential(&lens, cap, dp) {
            prop_assert_eq!(p.sample_rank.len(), lens.len());
            prop_assert!(p.num_micro >= 1);
        }
    }
}
